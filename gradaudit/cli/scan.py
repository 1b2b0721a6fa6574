"""``gradaudit scan``: audit files and exit with the verdict."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from gradaudit.audit import scan_paths
from gradaudit.checks import exit_code
from gradaudit.cli.app import (
    EXIT_CODES_HELP,
    app,
    check_device_option,
    exit_codes,
    make_thresholds,
    output_width,
    say,
    use_color,
)
from gradaudit.cli.visuals import ChartOption, GroupByOption, PlotOption, ScanVisuals
from gradaudit.kernels import Engine
from gradaudit.policy import (
    DEFAULT_EXPLODING_THRESHOLD,
    DEFAULT_FAIL_ON,
    DEFAULT_VANISHING_THRESHOLD,
)
from gradaudit.report import OutputFormat, RenderOptions
from gradaudit.report.base import DEFAULT_TOP_ROWS
from gradaudit.report.text import printable


@app.command(epilog=EXIT_CODES_HELP)
def scan(
    paths: Annotated[
        list[Path],
        typer.Argument(help="Gradient dumps (.safetensors).", metavar="PATH"),
    ],
    output_format: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="Output format.")
    ] = OutputFormat.TABLE,
    device: Annotated[
        str, typer.Option(help="Where to reduce: auto (CUDA when available), cpu, cuda, cuda:N.")
    ] = "auto",
    vanishing_threshold: Annotated[
        float, typer.Option(help="Norm below which a tensor is vanishing.")
    ] = DEFAULT_VANISHING_THRESHOLD,
    exploding_threshold: Annotated[
        float, typer.Option(help="Norm above which a tensor is exploding.")
    ] = DEFAULT_EXPLODING_THRESHOLD,
    fail_on: Annotated[
        str,
        typer.Option(help="Findings that fail the run: nan,inf,exploding,vanishing, all or none."),
    ] = ",".join(sorted(kind.value for kind in DEFAULT_FAIL_ON)),
    show_all: Annotated[
        bool, typer.Option("--all", help="Show every tensor, not only flagged and top rows.")
    ] = False,
    top: Annotated[
        int, typer.Option(min=0, help="Unflagged rows shown, largest norms first.")
    ] = DEFAULT_TOP_ROWS,
    engine: Annotated[
        Engine,
        typer.Option(help="Kernel: eager (default for auto), or compiled with torch.compile."),
    ] = Engine.AUTO,
    chunk_elements: Annotated[
        int | None, typer.Option(min=1, hidden=True, help="Elements reduced at once.")
    ] = None,
    chart: ChartOption = None,
    group_by: GroupByOption = "auto",
    plot: PlotOption = None,
    debug: Annotated[bool, typer.Option(help="Show tracebacks of errors.")] = False,
) -> None:
    """Audit gradient dumps: per-tensor NaN/Inf counts, norms, and a global norm."""
    with exit_codes(debug):
        thresholds = make_thresholds(vanishing_threshold, exploding_threshold, fail_on)
        check_device_option(device)
        visuals = ScanVisuals.prepare(
            chart=chart,
            group_by=group_by,
            plot=plot,
            inputs=paths,
            table=output_format is OutputFormat.TABLE,
        )
        report = scan_paths(
            paths,
            thresholds=thresholds,
            device=device,
            chunk_elements=chunk_elements,
            engine=engine,
        )
        for problem in report.errors:
            say(f"error: {printable(problem.path)}: {printable(problem.message)}")
        if not report.errors and report.summary.tensors == 0:
            say("error: nothing to audit: no floating-point tensor in the inputs")
        options = RenderOptions(width=output_width(), color=use_color(), show_all=show_all, top=top)
        sys.stdout.write(visuals.chart_text(report, options))
        sys.stdout.write(output_format.formatter()(report, options))
        visuals.write_plot(report)
        raise typer.Exit(int(exit_code(report)))
