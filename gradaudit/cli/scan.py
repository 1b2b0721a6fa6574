"""``gradaudit scan``: audit files and exit with the verdict."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from gradaudit.cli.app import (
    EXIT_CODES_HELP,
    app,
    check_device_option,
    exit_codes,
    output_width,
    say,
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
from gradaudit.cli.visuals import ChartOption, GroupByOption, PlotOption, ScanVisuals, write_plot
from gradaudit.engine.options import DEFAULT_MEMORY_BUDGET, Engine, EngineOptions
from gradaudit.errors import UsageError
from gradaudit.policy import Thresholds
from gradaudit.precision.formats import Precision
from gradaudit.precision.judging import DEFAULT_MAX_UNDERFLOW, PrecisionReport
from gradaudit.report.base import DEFAULT_TOP_ROWS
from gradaudit.report.output_format import OutputFormat
from gradaudit.report.precision_plot import precision_plot
from gradaudit.report.precision_table import render_precision
from gradaudit.report.text import plural
from gradaudit.results import Report
from gradaudit.results.verdict import exit_code
from gradaudit.scan.torchrun import TorchrunEnv, launched_as_rank, parent_command, torchrun_env


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
    precision: Annotated[
        Precision | None,
        typer.Option(
            help="Also report the headroom in a narrower format: the fraction of each "
            "tensor's values that would flush to zero, turn subnormal or overflow, and the "
            "power-of-two scale that fits them. The native kernel (CPU tensors) counts them "
            "in the same read as the stats; the eager and Triton engines (and any GPU "
            "tensor) read each tensor once more. With --plot, draws the log2 magnitude "
            "histogram against the format's range instead.",
        ),
    ] = None,
    max_underflow: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="With --precision: a tensor in which more than this fraction of the "
            "non-zero values would flush to zero is a failing finding (any overflow is one).",
        ),
    ] = DEFAULT_MAX_UNDERFLOW,
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
        check_output_path(settings.output, paths, recursive=recursive, config=settings.source)
        visuals = ScanVisuals.prepare(
            chart=chart,
            group_by=group_by,
            plot=plot,
            inputs=paths,
            table=(settings.format or OutputFormat.TABLE) is OutputFormat.TABLE,
            recursive=recursive,
            config=settings.source,
        )
        if precision is not None:
            _check_precision_options(settings.format, settings.output, distributed)
        total = input_bytes(paths, recursive=recursive)
        # Only the human table gets a bar by default; machine formats never do.
        machine = (settings.format or OutputFormat.TABLE) is not OutputFormat.TABLE
        job = _torchrun_job(distributed)
        engine_options = EngineOptions(
            device=settings.device or "auto",
            chunk_elements=chunk_elements,
            engine=settings.engine or Engine.AUTO,
            memory_budget=max_memory * 1024 * 1024,
        )
        options: dict[str, Any] = {
            "thresholds": thresholds,
            "include": include or (),
            "exclude": exclude or (),
            "recursive": recursive,
            "options": engine_options,
        }
        if precision is not None:
            options["histograms"] = True
        bar = (total, wants_progress(progress, machine, total))
        report = _scan_report(paths, job, options, precision=precision, bar=bar)
        headroom = None
        if precision is not None and report.tensors:
            # Judged before anything is printed: its findings are the report's, so the
            # verdict line and the exit code are one (issue 26: it printed OK, exited 1).
            from gradaudit.scan.judge import with_headroom  # numpy: only once a command runs

            report = with_headroom(report, precision, max_underflow)
            headroom = report.headroom
        if settings.output is None:  # the chart is for the terminal, above the table
            write_stdout(visuals.chart_text(report, render_options(settings, show_all=show_all)))
        verdict = emit_report(report, settings, show_all=show_all, top=top, debug=debug)
        if precision is None:
            visuals.write_plot(report)
        elif headroom is not None:
            table = (settings.format or OutputFormat.TABLE) is OutputFormat.TABLE
            _emit_precision(headroom, precision, visuals, table=table, show_all=show_all, top=top)
        raise typer.Exit(int(verdict))


def _torchrun_job(distributed: bool | None) -> TorchrunEnv | None:
    """The torchrun job this scan joins (``--distributed``; by default when run by
    torchrun), or ``None`` to scan alone."""
    job = None if distributed is False else torchrun_env()
    if job is not None and distributed is None and not launched_as_rank(parent_command()):
        # RANK/WORLD_SIZE inherited from a training job's rank (a subprocess of it):
        # joining would wait forever for ranks that never come.
        say(
            f"note: RANK={job.rank} and WORLD_SIZE={job.world_size} are set, but this "
            "process was not started by torchrun: scanning alone (--distributed joins)"
        )
        job = None
    if distributed and job is None:
        raise UsageError(
            "--distributed: not started by torchrun (RANK and WORLD_SIZE > 1 are not set)"
        )
    return job


def _scan_report(
    paths: list[Path],
    job: TorchrunEnv | None,
    options: dict[str, Any],
    *,
    precision: Precision | None,
    bar: tuple[int, bool],
) -> Report:
    """The report of one of the three scans: across torchrun's ranks, without torch when
    it applies, else with torch (``options``: :func:`~gradaudit.scan.paths.scan_paths`')."""
    # The scan core imports torch (~1.2 s): only here, so that --help, --version and
    # shell completion start in a fraction of that; and not at all for the commonest
    # scan, safetensors files on the CPU with the native kernel.
    if job is not None:
        from gradaudit.scan.distributed import scan_under_torchrun  # torch: see above

        report = scan_under_torchrun(paths, job, **options)
        if job.rank != 0:  # every rank has the report; rank 0 alone prints it
            raise typer.Exit(int(exit_code(report)))
        return report
    torch_free = _scan_without_torch(
        paths,
        options["options"],
        precision=precision,
        thresholds=options["thresholds"],
        include=options["include"],
        exclude=options["exclude"],
        recursive=options["recursive"],
        bar=bar,
    )
    if torch_free is not None:
        return torch_free
    from gradaudit.scan.paths import scan_paths  # torch: see above

    with progress_bar(*bar) as advance:
        return scan_paths(paths, progress=advance, **options)


def _scan_without_torch(
    paths: list[Path],
    engine_options: EngineOptions,
    *,
    precision: Precision | None,
    thresholds: Thresholds,
    include: Sequence[str],
    exclude: Sequence[str],
    recursive: bool,
    bar: tuple[int, bool],
) -> Report | None:
    """The report of the torch-free scan when it applies (:mod:`gradaudit.scan.torch_free`),
    else ``None``: the caller then scans with torch, as it always did."""
    from gradaudit.io import expand_inputs  # numpy: only once a command runs
    from gradaudit.scan import torch_free  # numpy: only once a command runs

    device = str(engine_options.device or "auto")
    if not torch_free.applies(device=device, engine=engine_options.engine):
        return None
    entries = list(expand_inputs(paths, recursive=recursive))
    if not torch_free.takes(entries):
        return None
    try:
        with progress_bar(*bar) as advance:
            return torch_free.scan_torch_free(
                entries,
                thresholds=thresholds,
                include=include,
                exclude=exclude,
                progress=advance,
                histograms=precision is not None,
            )
    except torch_free.NeedsTorch:
        return None


def _check_precision_options(
    output_format: OutputFormat | None, output: Path | None, distributed: bool | None
) -> None:
    """Refuse what ``--precision`` cannot honour yet. Every format carries the headroom
    (``Report.headroom``): the table format prints its own headroom table to stdout after
    the report, so only the table format refuses ``--output``."""
    if output is not None and (output_format or OutputFormat.TABLE) is OutputFormat.TABLE:
        raise UsageError(
            "--precision writes its table to stdout: leave out --output "
            "(or use --format json, markdown, github or junit)"
        )
    if distributed:
        raise UsageError("--precision is not supported with --distributed yet")


def _emit_precision(
    headroom: PrecisionReport,
    precision: Precision,
    visuals: ScanVisuals,
    *,
    table: bool,
    show_all: bool,
    top: int,
) -> None:
    """The headroom table after a table report (the other formats have it inside), and its
    figure; its findings are the report's."""
    if table:
        text = render_precision(headroom, width=output_width(), top=top, show_all=show_all)
        write_stdout("\n" + text)
    if visuals.plot is not None and visuals.plot_format is not None:
        title = f"Headroom in {precision.value}: {plural(len(headroom.tensors), 'tensor')}"
        write_plot(visuals.plot, precision_plot(headroom, visuals.plot_format, title=title))
