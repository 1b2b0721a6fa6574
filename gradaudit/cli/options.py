"""Options every auditing command shares: policy, configuration, output.

A command declares them with these ``Annotated`` aliases (defaults are
``None`` so a flag that was not given never hides the config file's value) and
turns the values into :class:`~gradaudit.cli.config.Settings` with
:func:`settings_from_flags`::

    @app.command()
    def mycommand(
        ...,
        output_format: FormatOption = None,
        output: OutputOption = None,
        quiet: QuietOption = None,
        fail_on: FailOnOption = None,
        ...
        config: ConfigOption = None,
        no_config: NoConfigOption = False,
    ) -> None:
        with exit_codes(debug):
            settings = settings_from_flags(
                config, no_config, command="mycommand", format=output_format,
                output=output, quiet=quiet, fail_on=fail_on, ...
            )
            thresholds = settings.thresholds()
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gradaudit.cli.config import (
    COMMAND_KEYS,
    KEYS,
    SettingError,
    Settings,
    parse_setting,
    resolve,
)
from gradaudit.engine.options import Engine
from gradaudit.errors import UsageError
from gradaudit.policy import DEFAULT_FAIL_ON, FAIL_ON_WORDS
from gradaudit.report.output_format import OutputFormat

_DEFAULT_FAIL_ON = ",".join(sorted(kind.value for kind in DEFAULT_FAIL_ON))

FormatOption = Annotated[
    OutputFormat | None,
    typer.Option(
        "--format",
        "-f",
        help="Output format: table, json, markdown, github (workflow commands), junit. "
        "[default: table]",
    ),
]
OutputOption = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        help="Write the report to this file instead of stdout (atomically, once the audit "
        "has finished).",
    ),
]
QuietOption = Annotated[
    bool | None,
    typer.Option("--quiet/--no-quiet", "-q", help="Print only findings: no summary, no OK rows."),
]
DeviceOption = Annotated[
    str | None,
    typer.Option(
        help="Where to reduce: auto (CUDA when available), cpu, cuda, cuda:N. [default: auto]"
    ),
]
EngineOption = Annotated[
    Engine | None,
    typer.Option(
        help=(
            "Kernel: native (single-pass C for CPU tensors), triton (single-pass Triton "
            "for CUDA tensors), eager, or compiled with torch.compile; auto picks native "
            "and triton where available. [default: auto]"
        )
    ),
]
VanishingThresholdOption = Annotated[
    float | None,
    typer.Option(help="Norm below which a tensor is vanishing. [default: 1e-07]"),
]
ExplodingThresholdOption = Annotated[
    float | None,
    typer.Option(help="Norm above which a tensor is exploding. [default: 100]"),
]
FailOnOption = Annotated[
    str | None,
    typer.Option(
        help=f"Findings that fail the run, comma-separated: {', '.join(FAIL_ON_WORDS)} "
        f"(nonfinite = nan,inf). [default: {_DEFAULT_FAIL_ON}]"
    ),
]
MaxGlobalNormOption = Annotated[
    float | None,
    typer.Option(help="Fail when a file's global gradient norm exceeds this."),
]
MaxVanishingFractionOption = Annotated[
    float | None,
    typer.Option(
        help="Fail when more than this fraction (0-1) of a file's tensors vanish; "
        "single vanishing tensors then only warn."
    ),
]
IgnoreOption = Annotated[
    list[str] | None,
    typer.Option(
        help="Glob on tensor names whose findings are ignored (repeatable). "
        "Ignored tensors stay in the report with their stats.",
        metavar="PATTERN",
    ),
]
KindOption = Annotated[
    str | None,
    typer.Option(
        "--kind",
        help="What the inputs hold: gradients, weights, or auto (decided per file from its "
        "metadata, structure and names; the summary says how). [default: auto]",
        metavar="KIND",
    ),
]
CastCheckOption = Annotated[
    str | None,
    typer.Option(
        "--cast-check",
        help="Check weights against a narrower dtype: fp16, bf16, fp8_e4m3fn, fp8_e5m2 "
        "(values beyond its range, or tensors that would flush to zero).",
        metavar="DTYPE",
    ),
]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        help="Settings file (pyproject.toml with [tool.gradaudit], or a TOML file of those "
        "keys). Default: the nearest pyproject.toml with [tool.gradaudit], from the current "
        "directory up.",
        metavar="FILE",
    ),
]
NoConfigOption = Annotated[
    bool, typer.Option("--no-config", help="Ignore configuration files; flags only.")
]


def settings_from_flags(
    config: Path | None, no_config: bool, *, command: str, **flags: Any
) -> Settings:
    """The settings that apply to ``command``: config file overridden by the flags given.

    ``flags`` are named like :class:`Settings` fields (``fail_on``,
    ``max_global_norm``, ``format`` …); ``None`` means the flag was not given.
    Every value goes through the same parser as the config file's, so a bad
    ``--max-vanishing-fraction 2`` and a bad ``max-vanishing-fraction = 2`` get
    the same message (naming the flag or the file and key). ``command`` picks
    the config file's ``[tool.gradaudit.<command>]`` sub-table.
    """
    own = COMMAND_KEYS.get(command, {})
    keys = {spec.field: key for key, spec in [*KEYS.items(), *own.items()]}
    given: dict[str, Any] = {}
    for name, raw in flags.items():
        if raw is None or raw == []:  # a repeatable option that was not given
            continue
        try:
            field, value = parse_setting(keys[name], raw, command)
        except SettingError as error:
            raise UsageError(f"--{error.key}: {error.problem}") from None
        given[field] = value
    return resolve(Settings(**given), config=config, no_config=no_config, command=command)
