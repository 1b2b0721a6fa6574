"""Plain option values (``gradaudit/cli/coercion.py``) are what Typer's coercion makes of them.

Each parameter of each command coerces a set of values both ways: the plain path's result
(or its hand-over to Typer) against Typer's own ``RuntimeParam``, built as Typer builds it.
Equal values of equal types, or the same error with the same message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("typer._coercion", reason="a Typer that coerces with Click's types")

import typer.main
from typer._coercion import build_runtime_param

from gradaudit.cli import app
from gradaudit.cli.coercion import PlainValues
from tests.conftest import runner

TEXTS = (
    "0", "5", "16", "007", "-1", "-0", "1.0", "0.5", ".5", "5.", "1e-3", "1E3", "1e400",
    "nan", "inf", "1_000", " 5", "+5", "abc", "", "json", "JSON", "table", "auto", "cpu",
    "native", "eager", "fp16", "bf16", "weights", "nan,inf", "99999999999999999999",
    "0.30000000000000004", "0.1000000000000000055511151231257827", "4.9e-324", "1.8e308",
    "2.2250738585072011e-308", "123456789.123456789e-5", "00.5", "-.5", "1e+3", "5e",
)  # fmt: skip


def _params() -> list[tuple[str, Any, Any]]:
    group = typer.main.get_command(app)
    found = [("gradaudit", group, param) for param in group.params]
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        found += [(name, command, param) for param in command.params]
        found.append((name, command, command.get_help_option(command.context_class(command))))
    return [item for item in found if getattr(item[2], "type_descriptor", None) is not None]


def _outcome(runtime: Any, value: Any, param: Any, ctx: Any) -> tuple[str, Any]:
    try:
        result = runtime.coerce(value, param=param, ctx=ctx)
    except Exception as error:  # noqa: BLE001 - the error is the outcome compared
        return "error", (type(error).__name__, str(getattr(error, "message", error)))
    return "value", (type(result), repr(result))  # repr: NaN equals itself


@pytest.mark.parametrize(
    ("command", "param"),
    [pytest.param(c, p, id=f"{name}-{p.name}") for name, c, p in _params()],
)
def test_plain_values_are_typers(command: Any, param: Any, tmp_path: Path) -> None:
    (tmp_path / "file.pt").write_bytes(b"x")
    paths = (str(tmp_path / "file.pt"), str(tmp_path), str(tmp_path / "missing"), "-")
    values: list[Any] = [None, param.default, True, False, 3, 0.25, *TEXTS, *paths]
    values += [(text,) for text in TEXTS[:6]] + [paths, (), ["a", "b"]]
    ctx = command.context_class(command)
    descriptor = param.type_descriptor
    plain, typer_own = PlainValues(descriptor), build_runtime_param(descriptor)
    for value in values:
        assert _outcome(plain, value, param, ctx) == _outcome(typer_own, value, param, ctx), value


def test_a_plain_scan_builds_no_typer_coercion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The point of it: no pydantic adapter for options left alone, defaults and plain
    text; a value that is not plain still gets Typer's check."""

    def refuse(descriptor: Any) -> Any:
        raise AssertionError(f"Typer's coercion built for {descriptor.annotation!r}")

    monkeypatch.setattr("gradaudit.cli.coercion.build_runtime_param", refuse)
    monkeypatch.setattr("typer.core.build_runtime_param", refuse)  # Typer's own, unplain
    result = runner.invoke(app, ["scan", "--top", "5", "--format", "json", str(tmp_path)])
    assert result.exit_code == 3, result.exception  # an empty directory: nothing to audit
    monkeypatch.setattr("gradaudit.cli.coercion.build_runtime_param", build_runtime_param)
    result = runner.invoke(app, ["scan", "--top", "1e1", str(tmp_path)])
    assert result.exit_code == 2
    assert "--top: '1e1' is not a whole number" in result.stderr


def _plain_params() -> list[Any]:
    group = typer.main.get_command(app)
    params = [*group.params, *(p for c in group.commands.values() for p in c.params)]  # type: ignore[attr-defined]
    return [p for p in params if isinstance(getattr(p, "_runtime_param", None), PlainValues)]


def test_only_a_checked_typer_release_gets_plain_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed release is one this module was checked against (update TESTED_TYPER
    after running this file on a new one); any other keeps Typer's own coercion."""
    import typer as typer_module

    from gradaudit.cli.coercion import TESTED_TYPER, typer_release

    assert typer_release() in TESTED_TYPER
    assert _plain_params()
    monkeypatch.setattr(typer_module, "__version__", "0.99.0")
    assert _plain_params() == []
    assert runner.invoke(app, ["scan", "--top", "1e1", "x"]).exit_code == 2
