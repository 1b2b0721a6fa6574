"""Malicious pickles written opcode by opcode never run, however they are packaged.

``test_hostile_inputs.py`` covers payloads that ``torch.save`` can write (a
``__reduce__`` returning ``open``, ``exec``, a bound method). Attackers write
opcodes by hand; these are the classic ones: ``os.system`` through GLOBAL and
REDUCE, ``posix.system``, ``eval``/``exec`` through protocol 4's STACK_GLOBAL,
``getattr(__import__("os"), "system")``, ``subprocess.getoutput``,
``runpy.run_path`` and ``torch.hub``'s loader importing a ``hubconf.py``. Each
is packaged as a bare pickle, as the ``data.pkl`` of a zip checkpoint and as a
legacy (pre-zip) torch file, and scanned with and without
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (which makes ``torch.load`` default to
unpickling anything). Every payload creates a marker file when it runs; a guard
test proves each one does under ``pickle.loads``.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from gradaudit import ExitCode
from gradaudit.cli import app
from tests.conftest import runner

MARKER = "PWNED"


def _arg(text: str) -> bytes:
    """A protocol-0 ``V`` (unicode) string argument line."""
    assert "\n" not in text
    assert "\\" not in text
    return b"V" + text.encode("utf-8") + b"\n"


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _short(text: str) -> bytes:
    """SHORT_BINUNICODE, the string opcode of protocol 4."""
    data = text.encode("utf-8")
    return b"\x8c" + bytes([len(data)]) + data


def call(module: str, name: str, *args: str) -> bytes:
    """``module.name(*args)`` with GLOBAL, MARK, TUPLE, REDUCE (protocol 0)."""
    return _global(module, name) + b"(" + b"".join(map(_arg, args)) + b"tR."


def stack_global_call(module: str, name: str, arg: str) -> bytes:
    """``module.name(arg)`` with protocol 4's STACK_GLOBAL, TUPLE1, REDUCE."""
    return b"\x80\x04" + _short(module) + _short(name) + b"\x93" + _short(arg) + b"\x85R."


def _touch(folder: Path) -> str:
    return f"touch {folder / MARKER}"


def _open(folder: Path) -> str:
    return f"open({str(folder / MARKER)!r}, 'w').close()"


def _script(folder: Path) -> str:
    script = folder / "evil.py"
    script.write_text(_open(folder) + "\n", encoding="utf-8")
    return str(script)


def _hub(folder: Path) -> str:
    hub = folder / "hub"
    hub.mkdir(exist_ok=True)
    (hub / "hubconf.py").write_text(_open(folder) + "\ndef entry():\n    return 0\n")
    return str(hub)


#: name -> payload bytes for a folder (the marker goes there).
PAYLOADS: dict[str, Callable[[Path], bytes]] = {
    "os.system": lambda tmp: call("os", "system", _touch(tmp)),
    "posix.system, protocol 2": lambda tmp: b"\x80\x02" + call("posix", "system", _touch(tmp)),
    "eval via STACK_GLOBAL": lambda tmp: stack_global_call("builtins", "eval", _open(tmp)),
    "exec via STACK_GLOBAL": lambda tmp: stack_global_call("builtins", "exec", _open(tmp)),
    "getattr(__import__)": lambda tmp: (
        _global("builtins", "getattr")
        + b"("
        + _global("builtins", "__import__")
        + b"("
        + _arg("os")
        + b"tR"
        + _arg("system")
        + b"tR("
        + _arg(_touch(tmp))
        + b"tR."
    ),
    "subprocess.getoutput": lambda tmp: call("subprocess", "getoutput", _touch(tmp)),
    "runpy.run_path": lambda tmp: call("runpy", "run_path", _script(tmp)),
    "torch.hub loader": lambda tmp: call("torch.hub", "_load_local", _hub(tmp), "entry"),
}

#: The legacy torch format: magic number, protocol version and system info pickles first.
LEGACY_HEAD = (
    pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
    + pickle.dumps(1001, protocol=2)
    + pickle.dumps(
        {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4}},
        protocol=2,
    )
)


def package(kind: str, payload: bytes, folder: Path) -> Path:
    path = folder / f"evil-{kind}.pt"
    if kind == "bare":
        path.write_bytes(payload)
    elif kind == "legacy":
        path.write_bytes(LEGACY_HEAD + payload)
    else:
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr("evil/data.pkl", payload)
            archive.writestr("evil/byteorder", "little")
            archive.writestr("evil/version", "3\n")
    return path


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_each_payload_really_runs_under_pickle_loads(name: str, tmp_path: Path) -> None:
    """Guards the test below: unpickled the unsafe way, the payload creates the marker."""
    pickle.loads(PAYLOADS[name](tmp_path))
    assert (tmp_path / MARKER).exists()


@pytest.mark.parametrize("force", [False, True], ids=["default", "TORCH_FORCE_NO_WEIGHTS_ONLY"])
@pytest.mark.parametrize("kind", ["bare", "zip", "legacy"])
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_no_payload_runs_in_any_package(
    name: str, kind: str, force: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if force:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    else:
        monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    path = package(kind, PAYLOADS[name](tmp_path), tmp_path)

    result = runner.invoke(app, ["scan", str(path), "--no-config"], env={"COLUMNS": "120"})

    assert not (tmp_path / MARKER).exists(), f"{name} ran from a {kind} file"
    assert result.exit_code == ExitCode.INPUT_ERROR, (result.exit_code, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"gradaudit: error: {path}: ")
