"""``gradaudit compare``: host vs seed gradient intensity, A vs B per parameter, and a gate."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated

import typer

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
from gradaudit.compare import compare_paths
from gradaudit.compare_checks import comparison_exit_code
from gradaudit.comparison import DEFAULT_MAX_CHANGE, ComparePolicy
from gradaudit.errors import UsageError
from gradaudit.policy import (
    DEFAULT_EXPLODING_THRESHOLD,
    DEFAULT_FAIL_ON,
    DEFAULT_VANISHING_THRESHOLD,
)
from gradaudit.report import OutputFormat, RenderOptions, comparison_formatter
from gradaudit.report.base import DEFAULT_TOP_ROWS
from gradaudit.report.text import printable
from gradaudit.stats import DEFAULT_CHUNK_ELEMENTS

COMPARE_EPILOG = (
    "normalized ratio = (seed_norm / host_norm) * sqrt(host_params / seed_params): the ratio "
    "of the RMS gradient element, comparable across modules of different sizes. "
    + EXIT_CODES_HELP
    + " A ratio outside --min-ratio/--max-ratio, or not computable while they are set, is a "
    "failing finding (1)."
)


def make_policy(
    min_ratio: float | None, max_ratio: float | None, max_change: float, fail_on_change: bool
) -> ComparePolicy:
    """The gate from option values; a bad value is a usage error (exit 2)."""
    for option, value in (("--min-ratio", min_ratio), ("--max-ratio", max_ratio)):
        if value is not None and math.isnan(value):
            raise UsageError(f"{option} must be a number, not nan")
    try:
        return ComparePolicy(
            min_ratio=min_ratio,
            max_ratio=max_ratio,
            max_change=max_change,
            fail_on_change=fail_on_change,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


@app.command(epilog=COMPARE_EPILOG)
def compare(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="HOST and SEED dumps (A and B), or one dump split by --host-prefix/--seed-prefix.",
            metavar="HOST [SEED]",
        ),
    ],
    host_prefix: Annotated[
        str | None,
        typer.Option(help="Host tensors are those whose name starts with this (removed for A/B)."),
    ] = None,
    seed_prefix: Annotated[
        str | None,
        typer.Option(help="Seed tensors are those whose name starts with this (removed for A/B)."),
    ] = None,
    min_ratio: Annotated[
        float | None, typer.Option(help="Fail when the normalized ratio is below this.")
    ] = None,
    max_ratio: Annotated[
        float | None, typer.Option(help="Fail when the normalized ratio is above this.")
    ] = None,
    max_change: Annotated[
        float,
        typer.Option(help="Flag shared tensors whose norm ratio B/A leaves [1/k, k].", metavar="K"),
    ] = DEFAULT_MAX_CHANGE,
    fail_on_change: Annotated[
        bool, typer.Option(help="Flagged per-parameter changes fail the run (default: warn).")
    ] = False,
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
        bool, typer.Option("--all", help="Show every shared tensor and every finding.")
    ] = False,
    top: Annotated[
        int, typer.Option(min=0, help="Unflagged shared tensors shown, largest changes first.")
    ] = DEFAULT_TOP_ROWS,
    chunk_elements: Annotated[
        int, typer.Option(min=1, hidden=True, help="Elements reduced at once.")
    ] = DEFAULT_CHUNK_ELEMENTS,
    debug: Annotated[bool, typer.Option(help="Show tracebacks of errors.")] = False,
) -> None:
    """Compare gradient intensity: host vs seed (normalized by size) and A vs B per tensor."""
    with exit_codes(debug):
        if len(paths) > 2:
            raise UsageError(f"compare takes one or two files, got {len(paths)}")
        thresholds = make_thresholds(vanishing_threshold, exploding_threshold, fail_on)
        policy = make_policy(min_ratio, max_ratio, max_change, fail_on_change)
        check_device_option(device)
        render = comparison_formatter(output_format)  # an unsupported format fails before work
        comparison = compare_paths(
            paths[0],
            paths[1] if len(paths) == 2 else None,
            host_prefix=host_prefix,
            seed_prefix=seed_prefix,
            thresholds=thresholds,
            policy=policy,
            device=device,
            chunk_elements=chunk_elements,
        )
        for problem in comparison.errors:
            say(f"error: {printable(problem.path)}: {printable(problem.message)}")
        options = RenderOptions(width=output_width(), color=use_color(), show_all=show_all, top=top)
        sys.stdout.write(render(comparison, options))
        raise typer.Exit(int(comparison_exit_code(comparison)))
