"""Pickles are unpickled under a byte budget and an object budget, checked before any
unpickling.

A pickle is a program that builds objects: 10 MB of ``EMPTY_SET`` opcodes builds ten
million empty sets, about 2.5 GB, and a ``LONG_BINPUT`` of index 2**31 makes CPython's
unpickler grow its memo table to 2**31 slots. Neither the size cap of a file nor
PyTorch's weights-only allowlist stops that: each opcode is allowed, it is only the
count that hurts. So before a pickle from a file is handed to an unpickler (DCP
``.metadata``, a zip checkpoint's ``data.pkl``, the pickles at the head of a legacy
``torch.save`` file), :func:`budget_problem` walks its opcodes with
:func:`pickletools.genops` — which builds nothing and checks every declared length against
the bytes that remain — and adds up an upper bound of the memory each opcode can make
live (:data:`_COST`: a stack slot, plus the object it creates). The pickle is refused when

* the estimate exceeds ``max(FLOOR_BYTES, RATIO * len(pickle))`` over the bytes walked so
  far: real checkpoints need about 14 bytes of Python objects per pickled byte (a DCP
  ``.metadata`` of 100,000 tensors: 26 MB pickled, 354 MB unpickled), but the estimate,
  an upper bound, reaches 35 over the state-dict part of a real ``dcp.save``'s metadata;
  the one-opcode bombs estimate 64 (empty lists) to 232 (empty sets);
* a memo store names an index beyond the opcodes read so far (pickle writers number
  them 0, 1, 2 …; the C unpickler sizes its memo table by the highest index);
* the opcodes do not parse (an unknown opcode, a length past the end, a line without its
  newline): the unpickler would fail there too, and refusing it here means no unpickler
  ever reads further than this walk did.

The walk costs about a quarter of a microsecond per opcode, two thirds of it
:func:`pickletools.genops` itself: 2.8 s for the 20.6 MB ``.metadata`` of a ``dcp.save``
of 100,000 tensors (10.6 M opcodes; genops alone 2.0 s, the unpickling after it 2.9 s;
it was 3.0 s with the opcode's name looked up in sets per opcode), 5 ms for the
``optimizer.pt`` of a 50-layer MLP.
"""

from __future__ import annotations

import io
import pickletools
from typing import BinaryIO

from gradaudit.io.pickle_scan import STRING_OPS

__all__ = ["FLOOR_BYTES", "RATIO", "budget_problem"]

#: Every pickle may use this much memory, however small it is.
FLOOR_BYTES = 256 << 20
#: ... and this many bytes of estimated memory per pickled byte: between real checkpoints'
#: estimates (up to 35: a ``dcp.save`` of 100,000 tensors was refused at 32) and the
#: cheapest one-opcode bomb's (64, empty lists).
RATIO = 48

#: Bytes of memory an opcode can make live, an upper bound over CPython's C unpickler and
#: PyTorch's pure-Python weights-only one: its stack slot plus what it creates. Opcodes
#: that push no new object (a memo read, a small int, ``None``) cost their stack slot.
_COST: dict[str, int] = {
    "EMPTY_SET": 232,
    "FROZENSET": 232,
    "ADDITEMS": 16,
    "EMPTY_DICT": 72,
    "DICT": 72,
    "SETITEM": 48,
    "SETITEMS": 48,
    "EMPTY_LIST": 64,
    "LIST": 64,
    "APPEND": 16,
    "APPENDS": 16,
    "EMPTY_TUPLE": 8,
    "TUPLE": 64,
    "TUPLE1": 56,
    "TUPLE2": 64,
    "TUPLE3": 72,
    # The weights-only unpickler keeps each mark's stack as a new Python list.
    "MARK": 104,
    "BINFLOAT": 32,
    "FLOAT": 32,
    "LONG1": 48,
    "LONG4": 48,
    "LONG": 48,
    "INT": 40,
    "BININT": 40,
    "NEWOBJ": 200,
    "NEWOBJ_EX": 200,
    "REDUCE": 200,
    "OBJ": 200,
    "INST": 200,
    "BUILD": 200,
    "GLOBAL": 72,
    "STACK_GLOBAL": 72,
    "BINPERSID": 200,
    "PERSID": 200,
    "MEMOIZE": 40,
    "PUT": 40,
    "BINPUT": 40,
    "LONG_BINPUT": 40,
}
_STACK_SLOT = 8
#: Opcodes whose argument (text or bytes) is copied into a new object.
_STRINGS = STRING_OPS | frozenset({"SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BYTEARRAY8"})
_STRING_OVERHEAD = 64
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
#: What the walk does per opcode, looked up once by the opcode object: its cost and
#: whether its argument is copied (a string), it adds a memo entry, or it names one.
_PLAIN, _STRING, _MEMOIZE, _PUT = range(4)
_STEP: dict[pickletools.OpcodeInfo, tuple[int, int]] = {
    op: (
        _COST.get(op.name, _STACK_SLOT) + (_STRING_OVERHEAD if op.name in _STRINGS else 0),
        _STRING
        if op.name in _STRINGS
        else _MEMOIZE
        if op.name == "MEMOIZE"
        else _PUT
        if op.name in _PUTS
        else _PLAIN,
    )
    for op in pickletools.opcodes
}


def budget_problem(
    data: bytes | memoryview | BinaryIO, max_pickles: int = 1, seen: set[str] | None = None
) -> str | None:
    """Why the ``max_pickles`` consecutive pickles at the start of ``data`` (bytes, or a
    stream at its start: a legacy file, whose storages follow its pickles) must not be
    unpickled, or ``None`` when they fit the budget (see the module docstring).

    ``seen``, when given, receives the name of every opcode walked: the torch-free reader
    (:mod:`gradaudit.io.zip_checkpoint`) takes only those torch's own loader supports,
    and learns it from this walk rather than a second one.

    The budget grows with the bytes walked so far, so bytes after the pickles (a legacy
    file's storages) buy nothing.
    """
    stream = io.BytesIO(data) if isinstance(data, bytes | memoryview) else data
    start = stream.tell()
    cost, ops, memo = 0, 0, 0
    for _ in range(max_pickles):
        if _at_end(stream):
            break
        try:
            for opcode, arg, pos in pickletools.genops(stream):
                # One lookup per opcode: the walk's own share of its time (genops' is
                # the rest) went from 1.05 to 0.85 s on a 100,000-tensor DCP .metadata.
                step, kind = _STEP[opcode]
                ops += 1
                if seen is not None:
                    seen.add(opcode.name)
                cost += step
                if not kind:
                    pass
                elif kind == _STRING:
                    cost += len(arg)  # type: ignore[arg-type]
                elif kind == _MEMOIZE:
                    memo += 1
                else:
                    # Writers number memo entries 0, 1, 2 …; the C unpickler sizes its memo
                    # table by the highest index, so an index is paid for by the opcodes
                    # before it, and its slots are counted.
                    if type(arg) is not int or not 0 <= arg <= ops:
                        return f"pickle memo index {_short(arg)} is out of range; refused unread"
                    if arg >= memo:
                        cost += 16 * (arg + 1 - memo)
                        memo = arg + 1
                if cost > FLOOR_BYTES and cost > RATIO * ((pos or 0) + 1 - start):
                    return (
                        f"pickle would build more than {max(FLOOR_BYTES, cost) >> 20} MiB of "
                        f"objects from its first {(pos or 0) + 1 - start:,} bytes (a pickle memory "
                        "bomb?); refused unread"
                    )
        except ValueError as error:
            return f"corrupt pickle data ({_short(str(error).splitlines()[0], 120)})"
    return None


def _short(value: object, limit: int = 24) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _at_end(stream: BinaryIO) -> bool:
    here = stream.tell()
    at_end = not stream.read(1)
    stream.seek(here)
    return at_end
