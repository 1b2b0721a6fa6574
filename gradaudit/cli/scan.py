"""``gradaudit scan``: audit files and exit with the verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from gradaudit.audit import scan_paths
from gradaudit.checks import exit_code
from gradaudit.cli.app import (
    EXIT_CODES_HELP,
    app,
    check_device_option,
    exit_codes,
)
from gradaudit.cli.options import (
    CastCheckOption,
    ConfigOption,
    DeviceOption,
    EngineOption,
    ExplodingThresholdOption,
    FailOnOption,
    FormatOption,
    IgnoreOption,
    KindOption,
    MaxGlobalNormOption,
    MaxVanishingFractionOption,
    NoConfigOption,
    OutputOption,
    QuietOption,
    VanishingThresholdOption,
    settings_from_flags,
)
from gradaudit.cli.output import check_output_path, emit_report, render_options, write_stdout
from gradaudit.cli.progress import input_bytes, progress_bar, wants_progress
from gradaudit.cli.visuals import ChartOption, GroupByOption, PlotOption, ScanVisuals
from gradaudit.distributed import scan_under_torchrun, torchrun_env
from gradaudit.errors import UsageError
from gradaudit.kernels import Engine
from gradaudit.report import OutputFormat
from gradaudit.report.base import DEFAULT_TOP_ROWS
from gradaudit.stats import DEFAULT_MEMORY_BUDGET


@app.command(epilog=EXIT_CODES_HELP)
def scan(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="Checkpoints and gradient dumps: .safetensors, *.safetensors.index.json "
            "(sharded), .pt/.pth/.bin/.ckpt (torch.save, loaded weights-only), or directories.",
            metavar="PATH",
            # Click's own readability check would make an unreadable input a usage error
            # (exit 2) and stop the run; the readers report it as an input error instead.
            readable=False,
        ),
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
    kind: KindOption = None,
    cast_check: CastCheckOption = None,
    config: ConfigOption = None,
    no_config: NoConfigOption = False,
    show_all: Annotated[
        bool, typer.Option("--all", help="Show every tensor, not only flagged and top rows.")
    ] = False,
    top: Annotated[
        int, typer.Option(min=0, help="Unflagged rows shown, largest norms first.")
    ] = DEFAULT_TOP_ROWS,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            metavar="GLOB",
            help="Audit only tensors whose name matches (repeatable; * matches dots too).",
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option(
            "--exclude",
            metavar="GLOB",
            help="Leave out tensors whose name matches (repeatable; beats --include).",
        ),
    ] = None,
    recursive: Annotated[
        bool, typer.Option("--recursive", "-r", help="Search directories' subdirectories too.")
    ] = False,
    max_memory: Annotated[
        int,
        typer.Option(min=16, help="Working-memory budget in MiB (scratch and buckets)."),
    ] = DEFAULT_MEMORY_BUDGET // (1024 * 1024),
    engine: EngineOption = None,
    chunk_elements: Annotated[
        int | None, typer.Option(min=1, hidden=True, help="Elements reduced at once.")
    ] = None,
    distributed: Annotated[
        bool | None,
        typer.Option(
            "--distributed/--no-distributed",
            help="Split the inputs across torchrun ranks (default: when run by torchrun).",
        ),
    ] = None,
    progress: Annotated[
        bool | None,
        typer.Option(
            "--progress/--no-progress",
            help="Progress bar on stderr; by default on a terminal for large inputs, never JSON.",
        ),
    ] = None,
    chart: ChartOption = None,
    group_by: GroupByOption = "auto",
    plot: PlotOption = None,
    debug: Annotated[bool, typer.Option(help="Show tracebacks of errors.")] = False,
) -> None:
    """Audit gradient dumps and checkpoints: per-tensor NaN/Inf counts, norms, a global norm."""
    with exit_codes(debug):
        settings = settings_from_flags(
            config,
            no_config,
            command="scan",
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
            kind=kind,
            cast_check=cast_check,
        )
        thresholds = settings.thresholds()
        check_device_option(settings.device or "auto")
        check_output_path(settings.output, paths)
        visuals = ScanVisuals.prepare(
            chart=chart,
            group_by=group_by,
            plot=plot,
            inputs=paths,
            table=(settings.format or OutputFormat.TABLE) is OutputFormat.TABLE,
        )
        total = input_bytes(paths, recursive=recursive)
        # Only the human table gets a bar by default; machine formats never do.
        machine = (settings.format or OutputFormat.TABLE) is not OutputFormat.TABLE
        job = None if distributed is False else torchrun_env()
        if distributed and job is None:
            raise UsageError(
                "--distributed: not started by torchrun (RANK and WORLD_SIZE > 1 are not set)"
            )
        options: dict[str, Any] = {
            "thresholds": thresholds,
            "chunk_elements": chunk_elements,
            "engine": settings.engine or Engine.AUTO,
            "memory_budget": max_memory * 1024 * 1024,
            "include": include or (),
            "exclude": exclude or (),
            "recursive": recursive,
        }
        if job is not None:
            report = scan_under_torchrun(paths, job, device=settings.device or "auto", **options)
            if job.rank != 0:  # every rank has the report; rank 0 alone prints it
                raise typer.Exit(int(exit_code(report)))
        else:
            with progress_bar(total, wants_progress(progress, machine, total)) as advance:
                report = scan_paths(
                    paths, device=settings.device or "auto", progress=advance, **options
                )
        if settings.output is None:  # the chart is for the terminal, above the table
            write_stdout(visuals.chart_text(report, render_options(settings, show_all=show_all)))
        verdict = emit_report(report, settings, show_all=show_all, top=top)
        visuals.write_plot(report)
        raise typer.Exit(int(verdict))
