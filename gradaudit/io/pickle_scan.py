"""Read a pickle's opcodes without running it, to say why PyTorch refused it.

PyTorch's weights-only unpickler is the gate: gradaudit never loads a pickle any other
way, and it never decides on its own that a pickle is safe. This module only explains a
refusal. torch's own message is long, recommends ``weights_only=False`` (the one thing a
tool that audits files from strangers must never suggest), and for a protocol-4 pickle
only says "Unsupported operand 149" even when the file calls ``os.system``. Listing the
globals a pickle references with :mod:`pickletools` names the real problem, and nothing
in the file is imported or called to do it.
"""

from __future__ import annotations

import _compat_pickle
import pickletools
import re
from collections.abc import Iterator
from typing import BinaryIO

from gradaudit.io.files import show

#: Opcodes that push a string (module or attribute names for ``STACK_GLOBAL``).
STRING_OPS = frozenset(
    {
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "UNICODE",
        "SHORT_BINSTRING",
        "BINSTRING",
        "STRING",
    }
)
#: Opcodes that push nothing, so the last pushed strings stay the last.
_NO_PUSH_OPS = frozenset({"FRAME", "PROTO", "MARK", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})

_TORCH_GLOBAL = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module)")
_UNSUPPORTED_OPCODE = re.compile(r"Unsupported operand (\d+)")
_NEEDS_IMPORT = re.compile(r"``(torch\.\w+(?:\.\w+)*)`` (?:and ``\S+`` )?must be imported")


def _canonical(module: str, name: str) -> str:
    """``module.name`` with Python 2 names mapped the way PyTorch maps them before checking."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _ops(stream: BinaryIO, max_pickles: int) -> Iterator[tuple[str, object]]:
    """Opcode names and arguments of up to ``max_pickles`` consecutive pickles.

    A legacy ``torch.save`` file is several pickles in a row (magic number, protocol,
    system info, the object). Stops quietly at the first byte that is not a valid opcode:
    this is for naming globals, and whatever was read before the damage still counts.
    """
    for _ in range(max_pickles):
        try:
            for opcode, arg, _pos in pickletools.genops(stream):
                yield opcode.name, arg
        except Exception:  # noqa: BLE001 - damaged or hostile bytes end the listing, nothing else
            return


def pickle_globals(stream: BinaryIO, max_pickles: int = 1) -> list[str]:
    """Every global (``module.name``) the pickle references, in order of first use.

    Covers ``GLOBAL`` and ``INST`` (protocols 0-3) and ``STACK_GLOBAL`` (protocol 4+), whose
    module and name come from the strings pushed before it, possibly through the memo.
    """
    found: dict[str, None] = {}
    pushed: list[object] = []
    memo: dict[object, object] = {}
    for name, arg in _ops(stream, max_pickles):
        if name in ("GLOBAL", "INST") and isinstance(arg, str) and " " in arg:
            module, attribute = arg.split(" ", 1)
            found[_canonical(module, attribute)] = None
            pushed.append(None)
        elif name == "STACK_GLOBAL":
            pair = pushed[-2:] if len(pushed) >= 2 else [None, None]
            if isinstance(pair[0], str) and isinstance(pair[1], str):
                found[_canonical(pair[0], pair[1])] = None
            pushed.append(None)
        elif name in STRING_OPS:
            pushed.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
        elif name in _GET_OPS:
            pushed.append(memo.get(arg))
        elif name in _PUT_OPS:
            memo[arg] = pushed[-1] if pushed else None
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name not in _NO_PUSH_OPS:
            pushed.append(None)
        del pushed[:-2]
    return list(found)


def allowed_globals() -> frozenset[str]:
    """The globals PyTorch's weights-only unpickler accepts (its defaults and user additions).

    Read from torch's private tables because no public API lists them; if a future torch
    moves them, the answer is empty and every global found is named, which only makes the
    explanation longer, never lets anything through (torch still decides).
    """
    try:
        from torch import _weights_only_unpickler as unpickler

        names = set(unpickler._get_allowed_globals())
        names |= set(unpickler._get_user_allowed_globals())  # type: ignore[no-untyped-call]
    except (ImportError, AttributeError):  # pragma: no cover - depends on the torch version
        return frozenset()
    return frozenset(str(name) for name in names)


def _unsafe_message(names: list[str]) -> str:
    first = names[0]
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    hint = ""
    if first.startswith("torch.nn.modules.") or first.startswith("__main__."):
        hint = "; it holds a pickled object, not a state dict: save model.state_dict() instead"
    return (
        f"refused as unsafe: the pickle references {show(first)}{more}, which PyTorch's "
        f"weights-only loader does not allow (nothing from the file was run){hint}"
    )


def _torch_detail(message: str) -> str:
    """The part of torch's weights-only error that says what went wrong, advice removed."""
    detail = message.split("WeightsUnpickler error:")[-1]
    detail = detail.split("Check the documentation of torch.load")[0]
    lines = [line.strip() for line in detail.splitlines() if line.strip()]
    kept = [
        line
        for line in lines
        if "weights_only" not in line and not line.startswith(("Weights only load failed", "("))
    ]
    text = (kept or ["the pickle does something the weights-only loader forbids"])[-1]
    for advice in (" Please use `torch.serialization.add_safe_globals", " Please file an issue"):
        text = text.split(advice)[0]
    return text[:200]


def explain_refusal(message: str, pickle_bytes: BinaryIO | None, max_pickles: int = 1) -> str:
    """One line saying why PyTorch's weights-only unpickler refused a file.

    ``message`` is torch's ``UnpicklingError`` text, ``pickle_bytes`` the pickle it read
    (``data.pkl`` of a zip checkpoint, or the legacy file itself), when it can be re-read.
    Globals outside the allowlist are named first; then an opcode the loader does not
    support; then torch's own reason, stripped of its advice.
    """
    needs = _NEEDS_IMPORT.search(message)
    if needs:
        return (
            f"holds tensors that need {needs.group(1)} (DTensor or nested tensors), which "
            "gradaudit does not load: save a plain, full state dict to audit it"
        )
    found = pickle_globals(pickle_bytes, max_pickles) if pickle_bytes is not None else []
    allowed = allowed_globals()
    unsafe = [name for name in found if name not in allowed] if allowed else []
    if unsafe:
        return _unsafe_message(unsafe)
    named = _TORCH_GLOBAL.search(message)
    if named:
        return _unsafe_message([named.group(1)])
    opcode = _UNSUPPORTED_OPCODE.search(message)
    if opcode:
        code = int(opcode.group(1))
        op = next((o for o in pickletools.opcodes if ord(o.code) == code), None)
        if op is None:
            return f"corrupt pickle data (byte 0x{code:02x} is not a pickle opcode)"
        return (
            f"cannot be loaded safely: it uses pickle opcode {op.name} (pickle protocol "
            f"{op.proto}), which PyTorch's weights-only loader does not support; torch.save "
            "writes protocol 2 by default"
        )
    return f"refused as unsafe: {_torch_detail(message)} (nothing from the file was run)"
