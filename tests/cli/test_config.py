"""``[tool.gradaudit]`` in pyproject.toml: discovery, parsing, and the errors that name the key."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from gradaudit import ExitCode
from gradaudit.cli import app
from gradaudit.cli.config import (
    COMMAND_KEYS,
    COMMANDS,
    KEYS,
    Settings,
    find_config,
    load_config,
    parse_setting,
    resolve,
)
from gradaudit.engine.kernels import Engine
from gradaudit.errors import UsageError
from gradaudit.policy import FindingKind
from gradaudit.report import OutputFormat
from gradaudit.results.comparison import ComparePolicy
from gradaudit.results.trend import TrendKind
from tests.conftest import WriteDump, runner


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_every_key_is_a_flag_spelling_and_a_settings_field() -> None:
    fields = set(Settings.__dataclass_fields__) - {"source"}
    own = [spec for keys in COMMAND_KEYS.values() for spec in keys.values()]
    assert {spec.field for spec in [*KEYS.values(), *own]} == fields
    assert all(key == key.lower() and "_" not in key for key in KEYS)
    assert all(spec.commands <= set(COMMANDS) and spec.commands for spec in KEYS.values())
    assert not set(KEYS) & set(COMMANDS)  # a key never shadows a command's sub-table
    # A command's own spelling of a key is read by that command alone.
    assert all(
        spec.commands == {command}
        for command, keys in COMMAND_KEYS.items()
        for spec in keys.values()
    )


def test_only_the_compare_gate_and_trend_keys_are_command_only() -> None:
    only = {key for key, spec in KEYS.items() if not spec.shared}
    assert only == {"min-ratio", "max-ratio", "max-change", "fail-on-change", "spike-factor"}
    assert KEYS["spike-factor"].commands == {"trend"}
    assert all(KEYS[key].commands == {"compare"} for key in only - {"spike-factor"})


def test_trend_reads_its_sub_table_and_the_shared_keys_it_has_flags_for(tmp_path: Path) -> None:
    path = write(
        tmp_path / "pyproject.toml",
        """
[tool.gradaudit]
fail-on = "nan"               # scan's and compare's words; trend does not read it
vanishing-threshold = 1e-6
exploding-threshold = 50      # trend has no such flag
format = "json"

[tool.gradaudit.trend]
spike-factor = 4
fail-on = ["spike", "collapse"]
output = "trend.json"
""",
    )
    trend = load_config(path, "trend")
    policy = trend.trend_policy()
    assert (policy.spike_factor, policy.vanishing) == (4.0, 1e-6)
    assert policy.fail_on == {TrendKind.SPIKE, TrendKind.COLLAPSE}
    assert trend.format is OutputFormat.JSON
    assert trend.output == tmp_path / "trend.json"
    scan = load_config(path, "scan")
    assert scan.fail_on == {FindingKind.NAN}
    assert scan.spike_factor is None
    assert scan.output is None


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[tool.gradaudit.trend]\nexploding-threshold = 5\n", "trend does not read it"),
        ('[tool.gradaudit.trend]\nfail-on = "nan"\n', "unknown --fail-on kind 'nan'"),
        ("[tool.gradaudit.trend]\nspike-factor = 1\n", "must be a finite number above 1"),
        ("[tool.gradaudit]\nspike-factor = 5\n", "put it in [tool.gradaudit.trend]"),
    ],
)
def test_trend_settings_are_checked(tmp_path: Path, table: str, message: str) -> None:
    path = write(tmp_path / "pyproject.toml", table)
    with pytest.raises(UsageError, match=re.escape(message)):
        load_config(path, "scan")  # every sub-table is checked, whatever the command


def test_a_full_table_parses_to_typed_settings(tmp_path: Path) -> None:
    path = write(
        tmp_path / "pyproject.toml",
        """
[project]
name = "demo"

[tool.gradaudit]
fail-on = ["nonfinite", "exploding"]
vanishing-threshold = 1e-8
exploding-threshold = 50
max-global-norm = 1e3
max-vanishing-fraction = 0.25
ignore = ["*.key.bias", "embed.*"]
format = "Markdown"
output = "reports/grads.md"
quiet = true
device = "cpu"
engine = "eager"
""",
    )
    settings = load_config(path)
    assert settings == Settings(
        fail_on=frozenset({FindingKind.NAN, FindingKind.INF, FindingKind.EXPLODING}),
        vanishing_threshold=1e-8,
        exploding_threshold=50.0,
        max_global_norm=1e3,
        max_vanishing_fraction=0.25,
        ignore=("*.key.bias", "embed.*"),
        format=OutputFormat.MARKDOWN,
        output=tmp_path / "reports" / "grads.md",  # relative to the config file
        quiet=True,
        device="cpu",
        engine=Engine.EAGER,
        source=path,
    )
    assert isinstance(settings.exploding_threshold, float)
    thresholds = settings.thresholds()
    assert thresholds.ignore == ("*.key.bias", "embed.*")
    assert thresholds.max_vanishing_fraction == 0.25


def test_fail_on_as_a_comma_string_too(tmp_path: Path) -> None:
    path = write(tmp_path / "pyproject.toml", '[tool.gradaudit]\nfail-on = "nan, inf"\n')
    assert load_config(path).fail_on == {FindingKind.NAN, FindingKind.INF}


def test_find_config_walks_up_and_passes_over_pyprojects_without_the_table(
    tmp_path: Path,
) -> None:
    root = write(tmp_path / "pyproject.toml", '[tool.gradaudit]\nfail-on = ["all"]\n')
    write(tmp_path / "pkg" / "pyproject.toml", '[project]\nname = "pkg"\n[tool.ruff]\n')
    deep = tmp_path / "pkg" / "src" / "deep"
    deep.mkdir(parents=True)
    assert find_config(deep) == root
    nearer = write(tmp_path / "pkg" / "src" / "pyproject.toml", "[tool.gradaudit]\n")
    assert find_config(deep) == nearer  # an empty table still counts: it was written on purpose
    assert find_config(tmp_path) == root


def test_resolve_flags_override_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(
        tmp_path / "pyproject.toml",
        '[tool.gradaudit]\nfail-on = ["vanishing"]\nignore = ["a.*"]\nformat = "json"\n',
    )
    monkeypatch.chdir(tmp_path)
    merged = resolve(Settings(ignore=("b.*",), quiet=False))
    assert merged.fail_on == {FindingKind.VANISHING}  # from the file
    assert merged.ignore == ("b.*",)  # replaced, not extended
    assert merged.format is OutputFormat.JSON
    assert merged.quiet is False
    assert resolve(Settings(quiet=True), no_config=True) == Settings(quiet=True)
    with pytest.raises(UsageError, match="cannot be combined"):
        resolve(Settings(), config=tmp_path / "pyproject.toml", no_config=True)


def test_other_toml_files_are_the_table_itself(tmp_path: Path) -> None:
    plain = write(tmp_path / "gradaudit.toml", 'fail-on = "none"\n')
    assert load_config(plain).fail_on == frozenset()
    nested = write(tmp_path / "ci.toml", "[tool.gradaudit]\nquiet = true\n")
    assert load_config(nested).quiet is True


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[project]\n", "no [tool.gradaudit] table"),
        ("[tool.other]\nx = 1\n", "no [tool.gradaudit] table"),
        ("[tool]\ngradaudit = 3\n", "tool.gradaudit must be a table"),
        ("[tool.gradaudit\n", "not valid TOML"),
    ],
)
def test_broken_pyproject_is_a_usage_error(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path / "pyproject.toml", text)
    with pytest.raises(UsageError) as error:
        load_config(path)
    assert message in str(error.value)
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    ("line", "key", "problem"),
    [
        ("fail_on = ['nan']", "fail_on", "unknown key (did you mean 'fail-on'?)"),
        ("vanishing = 1e-8", "vanishing", "unknown key (did you mean 'vanishing-threshold'?)"),
        ("colour = true", "colour", "unknown key; known keys: fail-on"),
        ("fail-on = 3", "fail-on", "expected a string or a list of strings, got an integer (3)"),
        ("fail-on = ['nan', 'bogus']", "fail-on", "unknown kind 'bogus'"),
        ("fail-on = []", "fail-on", "needs at least one of"),
        ("vanishing-threshold = '1e-8'", "vanishing-threshold", "expected a number, got a string"),
        ("vanishing-threshold = true", "vanishing-threshold", "expected a number, got a boolean"),
        ("vanishing-threshold = -1", "vanishing-threshold", "must be >= 0"),
        ("exploding-threshold = 0", "exploding-threshold", "must be > 0"),
        ("max-global-norm = -5.0", "max-global-norm", "must be > 0"),
        ("max-global-norm = nan", "max-global-norm", "must be > 0 (got nan)"),
        ("max-vanishing-fraction = 1.5", "max-vanishing-fraction", "must be between 0 and 1"),
        ("ignore = [1, 2]", "ignore", "expected a string or a list of strings, got a list"),
        ("ignore = ['']", "ignore", "a pattern cannot be empty"),
        ("format = 'xml'", "format", "unknown value 'xml' (choose from table, json, markdown"),
        ("format = ['json']", "format", "expected a string, got a list"),
        ("output = ''", "output", "expected a file name"),
        ("quiet = 'yes'", "quiet", "expected true or false, got a string ('yes')"),
        ("device = 'tpu'", "device", "unknown device 'tpu'"),
        ("device = 'meta'", "device", "unknown device 'meta'"),
        (
            "engine = 'fast'",
            "engine",
            "unknown value 'fast' (choose from native, triton, eager, compiled, auto)",
        ),
        ("[tool.gradaudit.nested]", "nested", "unknown key"),
    ],
)
def test_bad_keys_and_values_name_the_file_and_the_key(
    tmp_path: Path, line: str, key: str, problem: str
) -> None:
    path = write(tmp_path / "pyproject.toml", f"[tool.gradaudit]\n{line}\n")
    with pytest.raises(UsageError) as error:
        load_config(path)
    message = str(error.value)
    assert message.startswith(f"{path}: [tool.gradaudit] {key}: ")
    assert problem in message
    assert "\n" not in message


def test_cross_field_problems_show_up_when_the_policy_is_built(tmp_path: Path) -> None:
    path = write(tmp_path / "pyproject.toml", "[tool.gradaudit]\nvanishing-threshold = 1e3\n")
    settings = load_config(path)  # each value is fine on its own
    with pytest.raises(UsageError, match="below the exploding threshold") as error:
        settings.thresholds()
    assert str(path) in str(error.value)


def test_unreadable_configs_are_usage_errors_and_never_block(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read the config file: No such file"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(UsageError, match="not a regular file"):
        load_config(tmp_path)
    fifo = tmp_path / "pipe.toml"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="not a regular file"):
        load_config(fifo)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"ignore = ['caf\xe9']\n")
    with pytest.raises(UsageError, match="not valid TOML"):
        load_config(latin1)


def test_parse_setting_is_shared_by_flags_and_files() -> None:
    assert parse_setting("max-global-norm", 5) == ("max_global_norm", 5.0)
    assert parse_setting("format", OutputFormat.JUNIT) == ("format", OutputFormat.JUNIT)
    assert parse_setting("output", Path("x.md")) == ("output", Path("x.md"))
    assert parse_setting("ignore", ["a", "b"]) == ("ignore", ("a", "b"))


# --- one file for every command: [tool.gradaudit.<command>] sub-tables ----------------

SHARED_AND_COMPARE = """
[tool.gradaudit]
fail-on = ["nonfinite"]
ignore = ["*.k.bias"]
format = "markdown"
output = "reports/scan.md"

[tool.gradaudit.compare]
min-ratio = 0.1
max-ratio = 10
max-change = 5
fail-on-change = true
output = "reports/compare.md"
ignore = ["seed.*"]
"""


def test_a_command_reads_the_shared_table_then_its_own(tmp_path: Path) -> None:
    path = write(tmp_path / "pyproject.toml", SHARED_AND_COMPARE)
    scan = load_config(path, "scan")
    assert scan.fail_on == {FindingKind.NAN, FindingKind.INF}
    assert scan.output == tmp_path / "reports" / "scan.md"
    assert scan.ignore == ("*.k.bias",)
    assert (scan.min_ratio, scan.max_ratio, scan.max_change, scan.fail_on_change) == (
        None,
        None,
        None,
        None,
    )
    assert load_config(path) == scan  # no command: the shared table alone
    compare = load_config(path, "compare")
    assert compare.fail_on == scan.fail_on  # shared
    assert compare.format is OutputFormat.MARKDOWN  # shared
    assert compare.output == tmp_path / "reports" / "compare.md"  # its own, relative to the file
    assert compare.ignore == ("seed.*",)  # a list replaces, as a flag's does
    assert compare.compare_policy() == ComparePolicy(
        min_ratio=0.1, max_ratio=10.0, max_change=5.0, fail_on_change=True
    )


def test_flags_beat_the_command_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "pyproject.toml", SHARED_AND_COMPARE)
    monkeypatch.chdir(tmp_path)
    settings = resolve(Settings(min_ratio=0.5, fail_on_change=False), command="compare")
    assert settings.compare_policy() == ComparePolicy(
        min_ratio=0.5, max_ratio=10.0, max_change=5.0, fail_on_change=False
    )
    assert resolve(Settings(), command="scan").min_ratio is None


def test_without_settings_the_compare_policy_is_the_default() -> None:
    assert Settings().compare_policy() == ComparePolicy()


@pytest.mark.parametrize(
    ("text", "table", "key", "problem"),
    [
        (
            "[tool.gradaudit]\nmin-ratio = 0.1\n",
            "[tool.gradaudit]",
            "min-ratio",
            "only compare reads it: put it in [tool.gradaudit.compare]",
        ),
        (
            "[tool.gradaudit.scan]\nmax-change = 3\n",
            "[tool.gradaudit.scan]",
            "max-change",
            "scan does not read it (only compare)",
        ),
        (
            "[tool.gradaudit.compare]\nmin-ratio = -1\n",
            "[tool.gradaudit.compare]",
            "min-ratio",
            "must be >= 0 (got -1.0)",
        ),
        (
            "[tool.gradaudit.compare]\nmax-ratio = nan\n",
            "[tool.gradaudit.compare]",
            "max-ratio",
            "must be > 0 (got nan)",
        ),
        (
            "[tool.gradaudit.compare]\nmax-change = 0.5\n",
            "[tool.gradaudit.compare]",
            "max-change",
            "must be >= 1, the band is [1/k, k] (got 0.5)",
        ),
        (
            "[tool.gradaudit.compare]\nfail-on-change = 1\n",
            "[tool.gradaudit.compare]",
            "fail-on-change",
            "expected true or false, got an integer (1)",
        ),
        (
            "[tool.gradaudit.compare]\nmin_ratio = 1\n",
            "[tool.gradaudit.compare]",
            "min_ratio",
            "unknown key (did you mean 'min-ratio'?)",
        ),
        (
            "[tool.gradaudit]\ncompare = 3\n",
            "[tool.gradaudit]",
            "compare",
            "must be a table",
        ),
        (
            "[tool.gradaudit]\ncomparison = {}\n",
            "[tool.gradaudit]",
            "comparison",
            "sub-tables: [scan], [compare]",
        ),
    ],
)
def test_sub_table_problems_name_the_sub_table_for_every_command(
    tmp_path: Path, text: str, table: str, key: str, problem: str
) -> None:
    path = write(tmp_path / "pyproject.toml", text)
    # Checked whatever the command: a typo in the compare gate also fails a quick scan.
    for command in (None, *COMMANDS):
        with pytest.raises(UsageError) as error:
            load_config(path, command)
        message = str(error.value)
        assert message.startswith(f"{path}: {table} {key}: "), message
        assert problem in message
        assert "\n" not in message


def test_plain_toml_files_have_plain_sub_tables(tmp_path: Path) -> None:
    path = write(tmp_path / "gradaudit.toml", 'fail-on = "all"\n[compare]\nmax-ratio = 4\n')
    assert load_config(path, "compare").max_ratio == 4.0
    assert load_config(path, "scan").max_ratio is None
    bad = write(tmp_path / "bad.toml", "[compare]\nmax-ratio = 0\n")
    with pytest.raises(UsageError) as error:
        load_config(bad, "scan")
    assert str(error.value) == f"{bad}: [compare] max-ratio: must be > 0 (got 0.0)"
    top = write(tmp_path / "top.toml", "min-ratio = 1\n")
    with pytest.raises(
        UsageError,
        match=r"top.toml: min-ratio: only compare reads it: put it "
        r"in \[compare\]",
    ):
        load_config(top, "compare")


def test_ratio_bounds_that_conflict_across_tables_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "pyproject.toml", "[tool.gradaudit.compare]\nmin-ratio = 5\n")
    settings = load_config(path, "compare").overridden_by(Settings(max_ratio=2.0))
    with pytest.raises(UsageError) as error:
        settings.compare_policy()
    assert str(error.value) == (
        f"min-ratio: must not exceed max-ratio (5 > 2) (settings from {path} and the command line)"
    )


# --- numbers and values out of bounds: a usage error naming the key, never exit 4 ------

HUGE = "9" * 310  # beyond float64's range
LONGER_THAN_INT_STR = "9" * 5000  # beyond Python's int-to-str limit (4,300 digits)


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        (
            f"[tool.gradaudit]\nvanishing-threshold = {HUGE}\n",
            "[tool.gradaudit] vanishing-threshold: ",
            "out of range: an integer of 310 digits",
        ),
        (
            f"[tool.gradaudit]\nmax-global-norm = -{HUGE}\n",
            "[tool.gradaudit] max-global-norm: ",
            "out of range: an integer of 310 digits",
        ),
        (
            f"[tool.gradaudit.compare]\nmax-change = {HUGE}\n",
            "[tool.gradaudit.compare] max-change: ",
            "out of range",
        ),
        (
            f"[tool.gradaudit]\nfail-on = {HUGE}\n",
            "[tool.gradaudit] fail-on: ",
            "got an integer of 310 digits",
        ),
        (
            "[tool.gradaudit]\nexploding-threshold = inf\n",
            "[tool.gradaudit] exploding-threshold: ",
            "must be a finite number (got inf)",
        ),
        (
            f"[tool.gradaudit]\nexploding-threshold = {LONGER_THAN_INT_STR}\n",
            "line 2: exploding-threshold: ",
            "an integer too long to read",
        ),
        (
            f"[tool.gradaudit.trend]\nspike-factor = [1, {LONGER_THAN_INT_STR}]\n",
            "line 2: spike-factor: ",
            "an integer too long to read",
        ),
        (
            "[tool.gradaudit]\nignore = " + "[" * 5000 + "]" * 5000 + "\n",
            "line 2: ignore: ",
            "nested too deeply",
        ),
        (
            "[tool.gradaudit]\nkind = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n",
            "line 2: kind: ",
            "nested too deeply",
        ),
        (
            '[tool.gradaudit]\noutput = "report\\u0000.md"\n',
            "[tool.gradaudit] output: ",
            "a file name cannot hold a NUL byte",
        ),
    ],
)
def test_values_out_of_bounds_are_usage_errors_naming_the_key(
    tmp_path: Path, text: str, where: str, problem: str
) -> None:
    path = write(tmp_path / "pyproject.toml", text)
    with pytest.raises(UsageError) as error:
        load_config(path, "trend" if "trend" in text else "scan")
    message = str(error.value)
    assert message.startswith(f"{path}: {where}")
    assert problem in message
    assert len(message) < 300  # the number is described, not printed


def test_the_largest_finite_numbers_are_still_settings() -> None:
    assert parse_setting("exploding-threshold", 10**308) == ("exploding_threshold", 1e308)
    assert parse_setting("max-change", 1.7976931348623157e308)[1] == 1.7976931348623157e308


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        ("scan", "--exploding-threshold", HUGE),
        ("scan", "--max-global-norm", "1e999"),
        ("scan", "--vanishing-threshold", "inf"),
        ("compare", "--min-ratio", HUGE),
        ("compare", "--max-change", LONGER_THAN_INT_STR),
    ],
)
def test_flags_out_of_bounds_are_usage_errors_naming_the_flag(
    write_dump: WriteDump, command: str, flag: str, value: str
) -> None:
    # Float parsing rounds these to inf: a gate that never (or always) fires, so refused.
    dump = str(write_dump({"w": torch.ones(3)}))
    inputs = [dump, dump] if command == "compare" else [dump]
    result = runner.invoke(app, [command, "--no-config", flag, value, *inputs])
    assert result.exit_code == ExitCode.USAGE_ERROR, result.output
    assert f"{flag}: must be a finite number (got inf)" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "text",
    [
        f"[tool.gradaudit]\nexploding-threshold = {HUGE}\n",
        f"[tool.gradaudit]\nexploding-threshold = {LONGER_THAN_INT_STR}\n",
        "[tool.gradaudit]\nignore = " + "[" * 5000 + "]" * 5000 + "\n",
        '[tool.gradaudit]\noutput = "a\\u0000b"\n',
    ],
)
def test_the_cli_exits_2_on_such_a_config(write_dump: WriteDump, tmp_path: Path, text: str) -> None:
    config = write(tmp_path / "bad.toml", text)
    result = runner.invoke(
        app, ["scan", "--config", str(config), str(write_dump({"w": torch.ones(3)}))]
    )
    assert result.exit_code == ExitCode.USAGE_ERROR, result.output
    assert result.stderr.startswith(f"gradaudit: error: {config}: ")
    assert "Traceback" not in result.output
