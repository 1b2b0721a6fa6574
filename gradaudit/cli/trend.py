"""``gradaudit trend``: audit a series of dumps and report how each layer's norm evolved.

Shares ``scan``'s configuration and output options (``cli/options.py``): every
``--format``, ``--output`` (never over an input), ``--quiet``, ``--device``,
``--engine``, ``--kind`` and ``--vanishing-threshold``, from the flags or the
config file; trend's own ``spike-factor`` and ``fail-on`` (whose words are
trend's: nonfinite, spike, collapse) sit in its ``[tool.gradaudit.trend]`` sub-table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gradaudit.cli.app import app, check_device_option, exit_codes
from gradaudit.cli.options import (
    ConfigOption,
    DeviceOption,
    EngineOption,
    FormatOption,
    KindOption,
    NoConfigOption,
    OutputOption,
    QuietOption,
    settings_from_flags,
)
from gradaudit.cli.output import check_output_path, emit_trend, write_stdout
from gradaudit.cli.visuals import (
    GroupByOption,
    PlotOption,
    check_plot_target,
    group_by_option,
    write_trend_plot,
)
from gradaudit.engine.options import Engine
from gradaudit.errors import UsageError
from gradaudit.policy import DEFAULT_VANISHING_THRESHOLD, InputKind
from gradaudit.precision.formats import Precision
from gradaudit.report.output_format import OutputFormat
from gradaudit.report.precision_table import render_headroom_trend
from gradaudit.results.trend import DEFAULT_SPIKE_FACTOR, DEFAULT_TREND_FAIL_ON

TREND_EXIT_CODES_HELP = (
    "Exit codes: 0 every dump audited, no failing finding; 1 failing findings (nonfinite and "
    "spike by default); 2 usage error; 3 a dump could not be audited (missing, unreadable, "
    "corrupt, step unknown or taken twice) or nothing to audit - beats 1; 4 internal error "
    "(rerun with --debug); 5 the report or a message could not be written (stdout/stderr "
    "closed or full) - beats all. Settings: [tool.gradaudit] in pyproject.toml, and "
    "[tool.gradaudit.trend] for trend's own (spike-factor, fail-on)."
)
_DEFAULT_FAIL_ON = ",".join(sorted(kind.value for kind in DEFAULT_TREND_FAIL_ON))


@app.command(epilog=TREND_EXIT_CODES_HELP)
def trend(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="Dumps (.safetensors, or .pt/.bin written by torch.save) or directories of "
            "dumps, one dump per step; ordered by a safetensors dump's 'step' metadata, else "
            "the last number in the file name.",
            metavar="PATH",
        ),
    ],
    output_format: FormatOption = None,
    output: OutputOption = None,
    quiet: QuietOption = None,
    group_by: GroupByOption = "auto",
    spike_factor: Annotated[
        float | None,
        typer.Option(
            help="A layer's norm above this many times its running median is a spike. "
            f"[default: {DEFAULT_SPIKE_FACTOR:g}]"
        ),
    ] = None,
    vanishing_threshold: Annotated[
        float | None,
        typer.Option(
            help="A layer whose norm falls below this and stays has collapsed. "
            f"[default: {DEFAULT_VANISHING_THRESHOLD:g}]"
        ),
    ] = None,
    fail_on: Annotated[
        str | None,
        typer.Option(
            help="Findings that fail the run: nonfinite,spike,collapse, all or none. "
            f"[default: {_DEFAULT_FAIL_ON}]"
        ),
    ] = None,
    show_all: Annotated[
        bool, typer.Option("--all", help="List every step, not only the first, last and flagged.")
    ] = False,
    recursive: Annotated[
        bool, typer.Option("--recursive", "-r", help="Search directories' subdirectories too.")
    ] = False,
    plot: PlotOption = None,
    device: DeviceOption = None,
    engine: EngineOption = None,
    chunk_elements: Annotated[
        int | None, typer.Option(min=1, hidden=True, help="Elements reduced at once.")
    ] = None,
    kind: KindOption = None,
    precision: Annotated[
        Precision | None,
        typer.Option(
            help="Also show how the headroom in this format (flushed, subnormal, overflowing "
            "values; the scale that fits them) moves over the steps. Informational.",
        ),
    ] = None,
    config: ConfigOption = None,
    no_config: NoConfigOption = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks of errors.")] = False,
) -> None:
    """Audit a series of dumps: per-layer norm over steps, spikes, first NaN/Inf, collapse."""
    with exit_codes(debug):
        settings = settings_from_flags(
            config,
            no_config,
            command="trend",
            format=output_format,
            output=output,
            quiet=quiet,
            device=device,
            engine=engine,
            vanishing_threshold=vanishing_threshold,
            kind=kind,
            spike_factor=spike_factor,
            trend_fail_on=fail_on,
        )
        policy = settings.trend_policy()
        spec = group_by_option(group_by)
        check_device_option(settings.device or "auto")
        check_output_path(settings.output, paths, recursive=recursive, config=settings.source)
        plot_format = check_plot_target(plot, paths, recursive=recursive, config=settings.source)
        if precision is not None:
            if (settings.format or OutputFormat.TABLE) is not OutputFormat.TABLE:
                raise UsageError("--precision prints a table: use it with --format table")
            if settings.output is not None:
                raise UsageError("--precision writes its table to stdout: leave out --output")
        # Reads files: only once there is work to do; without torch when it can.
        from gradaudit.scan import torch_free  # numpy: only once a command runs
        from gradaudit.trend import builder  # numpy: only once a command runs

        device_text = settings.device or "auto"
        engine_choice = settings.engine or Engine.AUTO
        kind_of = settings.kind or InputKind.AUTO
        report = None
        if torch_free.applies(device=device_text, engine=engine_choice):
            try:
                report = builder.trend_paths_torch_free(
                    paths,
                    kind=kind_of,
                    policy=policy,
                    group_by=spec,
                    precision=precision,
                    recursive=recursive,
                )
            except torch_free.NeedsTorch:
                report = None  # the torch path below, as scan falls back
        if report is None:
            report = builder.trend_paths(
                paths,
                kind=kind_of,
                policy=policy,
                group_by=spec,
                device=device_text,
                engine=engine_choice,
                chunk_elements=chunk_elements,
                precision=precision,
                recursive=recursive,
            )
        verdict = emit_trend(report, settings, show_all=show_all, debug=debug)
        if precision is not None and report.headroom:
            write_stdout("\n" + render_headroom_trend(report.headroom, precision))
        write_trend_plot(plot, plot_format, report)
        raise typer.Exit(int(verdict))
