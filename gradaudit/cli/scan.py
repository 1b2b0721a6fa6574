"""``gradaudit scan``: audit files and exit with the verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gradaudit.audit import scan_paths
from gradaudit.cli.app import (
    EXIT_CODES_HELP,
    app,
    check_device_option,
    exit_codes,
)
from gradaudit.cli.options import (
    ConfigOption,
    DeviceOption,
    EngineOption,
    ExplodingThresholdOption,
    FailOnOption,
    FormatOption,
    IgnoreOption,
    MaxGlobalNormOption,
    MaxVanishingFractionOption,
    NoConfigOption,
    OutputOption,
    QuietOption,
    VanishingThresholdOption,
    settings_from_flags,
)
from gradaudit.cli.output import check_output_path, emit_report
from gradaudit.kernels import Engine
from gradaudit.report.base import DEFAULT_TOP_ROWS


@app.command(epilog=EXIT_CODES_HELP)
def scan(
    paths: Annotated[
        list[Path],
        typer.Argument(help="Gradient dumps (.safetensors).", metavar="PATH"),
    ],
    output_format: FormatOption = None,
    output: OutputOption = None,
    quiet: QuietOption = None,
    device: DeviceOption = None,
    vanishing_threshold: VanishingThresholdOption = None,
    exploding_threshold: ExplodingThresholdOption = None,
    fail_on: FailOnOption = None,
    max_global_norm: MaxGlobalNormOption = None,
    max_vanishing_fraction: MaxVanishingFractionOption = None,
    ignore: IgnoreOption = None,
    config: ConfigOption = None,
    no_config: NoConfigOption = False,
    show_all: Annotated[
        bool, typer.Option("--all", help="Show every tensor, not only flagged and top rows.")
    ] = False,
    top: Annotated[
        int, typer.Option(min=0, help="Unflagged rows shown, largest norms first.")
    ] = DEFAULT_TOP_ROWS,
    engine: EngineOption = None,
    chunk_elements: Annotated[
        int | None, typer.Option(min=1, hidden=True, help="Elements reduced at once.")
    ] = None,
    debug: Annotated[bool, typer.Option(help="Show tracebacks of errors.")] = False,
) -> None:
    """Audit gradient dumps: per-tensor NaN/Inf counts, norms, and a global norm."""
    with exit_codes(debug):
        settings = settings_from_flags(
            config,
            no_config,
            format=output_format,
            output=output,
            quiet=quiet,
            device=device,
            engine=engine,
            vanishing_threshold=vanishing_threshold,
            exploding_threshold=exploding_threshold,
            fail_on=fail_on,
            max_global_norm=max_global_norm,
            max_vanishing_fraction=max_vanishing_fraction,
            ignore=ignore,
        )
        thresholds = settings.thresholds()
        check_device_option(settings.device or "auto")
        check_output_path(settings.output, paths)
        report = scan_paths(
            paths,
            thresholds=thresholds,
            device=settings.device or "auto",
            chunk_elements=chunk_elements,
            engine=settings.engine or Engine.AUTO,
        )
        raise typer.Exit(int(emit_report(report, settings, show_all=show_all, top=top)))
