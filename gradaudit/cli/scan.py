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
from gradaudit.cli.progress import input_bytes, progress_bar, wants_progress
from gradaudit.kernels import Engine
from gradaudit.policy import (
    DEFAULT_EXPLODING_THRESHOLD,
    DEFAULT_FAIL_ON,
    DEFAULT_VANISHING_THRESHOLD,
)
from gradaudit.report import OutputFormat, RenderOptions
from gradaudit.report.base import DEFAULT_TOP_ROWS
from gradaudit.report.table import nothing_to_audit
from gradaudit.report.text import printable
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
    engine: Annotated[
        Engine,
        typer.Option(help="Kernel: eager (default for auto), or compiled with torch.compile."),
    ] = Engine.AUTO,
    max_memory: Annotated[
        int,
        typer.Option(min=16, help="Working-memory budget in MiB (scratch and buckets)."),
    ] = DEFAULT_MEMORY_BUDGET // (1024 * 1024),
    chunk_elements: Annotated[
        int | None, typer.Option(min=1, hidden=True, help="Elements reduced at once.")
    ] = None,
    progress: Annotated[
        bool | None,
        typer.Option(
            "--progress/--no-progress",
            help="Progress bar on stderr; by default on a terminal for large inputs, never JSON.",
        ),
    ] = None,
    debug: Annotated[bool, typer.Option(help="Show tracebacks of errors.")] = False,
) -> None:
    """Audit gradient dumps and checkpoints: per-tensor NaN/Inf counts, norms, a global norm."""
    with exit_codes(debug):
        thresholds = make_thresholds(vanishing_threshold, exploding_threshold, fail_on)
        check_device_option(device)
        total = input_bytes(paths, recursive=recursive)
        show = wants_progress(progress, output_format is OutputFormat.JSON, total)
        with progress_bar(total, show) as advance:
            report = scan_paths(
                paths,
                thresholds=thresholds,
                device=device,
                chunk_elements=chunk_elements,
                engine=engine,
                memory_budget=max_memory * 1024 * 1024,
                progress=advance,
                include=include or (),
                exclude=exclude or (),
                recursive=recursive,
            )
        for problem in report.errors:
            say(f"error: {printable(problem.path)}: {printable(problem.message)}")
        if not report.errors and report.summary.tensors == 0:
            say(f"error: {nothing_to_audit(report)}")
        options = RenderOptions(width=output_width(), color=use_color(), show_all=show_all, top=top)
        sys.stdout.write(output_format.formatter()(report, options))
        raise typer.Exit(int(exit_code(report)))
