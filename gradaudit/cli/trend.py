"""``gradaudit trend``: audit a series of dumps and report how each layer's norm evolved."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gradaudit.cli.app import app, check_device_option, exit_codes, output_width, say, use_color
from gradaudit.cli.options import KindOption
from gradaudit.cli.output import write_stdout
from gradaudit.cli.visuals import (
    GroupByOption,
    PlotOption,
    check_plot_target,
    group_by_option,
    write_trend_plot,
)
from gradaudit.engine.options import Engine
from gradaudit.errors import UsageError
from gradaudit.policy import DEFAULT_VANISHING_THRESHOLD, PolicyError, check_kind, parse_kinds
from gradaudit.precision import Precision
from gradaudit.report.base import RenderOptions
from gradaudit.report.text import printable
from gradaudit.report.trend_report import TrendFormat
from gradaudit.trend.builder import (
    DEFAULT_SPIKE_FACTOR,
    DEFAULT_TREND_FAIL_ON,
    TrendKind,
    TrendPolicy,
    trend_exit_code,
    trend_paths,
)

TREND_EXIT_CODES_HELP = (
    "Exit codes: 0 every dump audited, no failing finding; 1 failing findings (nonfinite and "
    "spike by default); 2 usage error; 3 a dump could not be audited (missing, unreadable, "
    "corrupt, step unknown or taken twice) or nothing to audit - beats 1; 4 internal error "
    "(rerun with --debug); 5 the report or a message could not be written (stdout/stderr "
    "closed or full) - beats all."
)


def _policy(spike_factor: float, vanishing: float, fail_on: str) -> TrendPolicy:
    try:
        return TrendPolicy(spike_factor, vanishing, parse_kinds(fail_on, TrendKind))
    except ValueError as error:
        raise UsageError(str(error)) from None


@app.command(epilog=TREND_EXIT_CODES_HELP)
def trend(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="Dumps (.safetensors) or directories of dumps, one dump per step; ordered by "
            "the 'step' metadata, else the last number in the file name.",
            metavar="PATH",
        ),
    ],
    output_format: Annotated[
        TrendFormat, typer.Option("--format", "-f", help="Output format.")
    ] = TrendFormat.TABLE,
    group_by: GroupByOption = "auto",
    spike_factor: Annotated[
        float,
        typer.Option(help="A layer's norm above this many times its running median is a spike."),
    ] = DEFAULT_SPIKE_FACTOR,
    vanishing_threshold: Annotated[
        float, typer.Option(help="A layer whose norm falls below this and stays has collapsed.")
    ] = DEFAULT_VANISHING_THRESHOLD,
    fail_on: Annotated[
        str,
        typer.Option(help="Findings that fail the run: nonfinite,spike,collapse, all or none."),
    ] = ",".join(sorted(kind.value for kind in DEFAULT_TREND_FAIL_ON)),
    show_all: Annotated[
        bool, typer.Option("--all", help="List every step, not only the first, last and flagged.")
    ] = False,
    plot: PlotOption = None,
    device: Annotated[
        str, typer.Option(help="Where to reduce: auto (CUDA when available), cpu, cuda, cuda:N.")
    ] = "auto",
    engine: Annotated[
        Engine,
        typer.Option(
            help=(
                "Kernel: native (single-pass C for CPU tensors), triton (single-pass Triton "
                "for CUDA tensors), eager, or compiled with torch.compile; auto picks native "
                "and triton where available."
            )
        ),
    ] = Engine.AUTO,
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
    debug: Annotated[bool, typer.Option(help="Show tracebacks of errors.")] = False,
) -> None:
    """Audit a series of dumps: per-layer norm over steps, spikes, first NaN/Inf, collapse."""
    with exit_codes(debug):
        policy = _policy(spike_factor, vanishing_threshold, fail_on)
        spec = group_by_option(group_by)
        check_device_option(device)
        plot_format = check_plot_target(plot, paths)
        try:
            input_kind = check_kind(kind or "auto")
        except PolicyError as error:
            raise UsageError(f"--{error}") from None
        if precision is not None and output_format is not TrendFormat.TABLE:
            raise UsageError("--precision prints a table: use it with --format table")
        report = trend_paths(
            paths,
            kind=input_kind,
            policy=policy,
            group_by=spec,
            device=device,
            engine=engine,
            chunk_elements=chunk_elements,
            precision=precision,
        )
        for problem in report.errors:
            say(f"error: {printable(problem.path)}: {printable(problem.message)}")
        if not report.errors and not any(step.tensors for step in report.steps):
            say("error: nothing to audit: no floating-point tensor in the dumps")
        options = RenderOptions(width=output_width(), color=use_color(), show_all=show_all)
        write_stdout(output_format.formatter()(report, options))
        if precision is not None and report.headroom:
            from gradaudit.report.precision_table import render_headroom_trend

            write_stdout("\n" + render_headroom_trend(report.headroom, precision))
        write_trend_plot(plot, plot_format, report)
        raise typer.Exit(int(trend_exit_code(report)))
