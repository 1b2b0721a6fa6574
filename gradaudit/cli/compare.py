"""``gradaudit compare``: host vs seed gradient intensity, A vs B per parameter, and a gate.

Shares ``scan``'s policy, configuration and output options (``cli/options.py``)
and adds the comparison's own gate. Those four flags are settings too: they can
be written in the config file's ``[tool.gradaudit.compare]`` sub-table.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NamedTuple

import typer

from gradaudit.cli.app import EXIT_CODES_HELP, app, check_device_option, exit_codes
from gradaudit.cli.options import (
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
from gradaudit.cli.output import check_output_path, emit_comparison
from gradaudit.engine.options import Engine, EngineOptions
from gradaudit.errors import UsageError
from gradaudit.report.base import DEFAULT_TOP_ROWS
from gradaudit.results.comparison import DEFAULT_MAX_CHANGE

if TYPE_CHECKING:  # its type only: the module is numpy
    from gradaudit.policy import Thresholds
    from gradaudit.results.comparison import ComparePolicy, Comparison

COMPARE_EPILOG = (
    "normalized ratio = (seed_norm / host_norm) * sqrt(host_params / seed_params): the ratio "
    "of the RMS gradient element, comparable across modules of different sizes. "
    + EXIT_CODES_HELP
    + " A ratio outside --min-ratio/--max-ratio, or not computable while they are set, is a "
    "failing finding (1). Settings: [tool.gradaudit] in pyproject.toml, and "
    "[tool.gradaudit.compare] for compare's own (min-ratio, max-ratio, max-change, "
    "fail-on-change) or to override shared keys for compare only."
)

MinRatioOption = Annotated[
    float | None, typer.Option(help="Fail when the normalized ratio is below this.")
]
MaxRatioOption = Annotated[
    float | None, typer.Option(help="Fail when the normalized ratio is above this.")
]
MaxChangeOption = Annotated[
    float | None,
    typer.Option(
        help="Flag shared tensors whose norm ratio B/A leaves [1/k, k]. "
        f"[default: {DEFAULT_MAX_CHANGE:g}]",
        metavar="K",
    ),
]
FailOnChangeOption = Annotated[
    bool | None,
    typer.Option(
        "--fail-on-change/--no-fail-on-change",
        help="Flagged per-parameter changes fail the run. [default: warn]",
    ),
]


@app.command(epilog=COMPARE_EPILOG)
def compare(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="HOST and SEED dumps (A and B), or one dump split by --host-prefix/--seed-prefix.",
            metavar="HOST [SEED]",
            readable=False,  # an unreadable input is an input error (exit 3), as in scan
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
    min_ratio: MinRatioOption = None,
    max_ratio: MaxRatioOption = None,
    max_change: MaxChangeOption = None,
    fail_on_change: FailOnChangeOption = None,
    output_format: FormatOption = None,
    output: OutputOption = None,
    quiet: QuietOption = None,
    device: DeviceOption = None,
    engine: EngineOption = None,
    vanishing_threshold: VanishingThresholdOption = None,
    exploding_threshold: ExplodingThresholdOption = None,
    fail_on: FailOnOption = None,
    max_global_norm: MaxGlobalNormOption = None,
    max_vanishing_fraction: MaxVanishingFractionOption = None,
    ignore: IgnoreOption = None,
    kind: KindOption = None,
    config: ConfigOption = None,
    no_config: NoConfigOption = False,
    show_all: Annotated[
        bool, typer.Option("--all", help="Show every shared tensor and every finding.")
    ] = False,
    top: Annotated[
        int, typer.Option(min=0, help="Unflagged shared tensors shown, largest changes first.")
    ] = DEFAULT_TOP_ROWS,
    chunk_elements: Annotated[
        int | None, typer.Option(min=1, hidden=True, help="Elements reduced at once.")
    ] = None,
    debug: Annotated[bool, typer.Option(help="Show tracebacks of errors.")] = False,
) -> None:
    """Compare gradient intensity: host vs seed (normalized by size) and A vs B per tensor."""
    with exit_codes(debug):
        if len(paths) > 2:
            raise UsageError(f"compare takes one or two files, got {len(paths)}")
        settings = settings_from_flags(
            config,
            no_config,
            command="compare",
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
            min_ratio=min_ratio,
            max_ratio=max_ratio,
            max_change=max_change,
            fail_on_change=fail_on_change,
        )
        thresholds = settings.thresholds()
        policy = settings.compare_policy()
        check_device_option(settings.device or "auto")
        check_output_path(settings.output, paths, config=settings.source)
        engine_options = EngineOptions(
            device=settings.device or "auto",
            chunk_elements=chunk_elements,
            engine=settings.engine or Engine.AUTO,
        )
        host, seed = paths[0], paths[1] if len(paths) == 2 else None
        sides = Sides(host_prefix, seed_prefix, thresholds, policy)
        comparison = _compare_without_torch(host, seed, engine_options, sides)
        if comparison is None:
            # torch (~1.2 s): only once there is work to do, and only when the torch-free
            # path does not apply.
            from gradaudit.comparison.api import compare_paths  # torch: see above

            comparison = compare_paths(
                host,
                seed,
                host_prefix=sides.host_prefix,
                seed_prefix=sides.seed_prefix,
                thresholds=sides.thresholds,
                policy=sides.policy,
                options=engine_options,
            )
        raise typer.Exit(
            int(emit_comparison(comparison, settings, show_all=show_all, top=top, debug=debug))
        )


class Sides(NamedTuple):
    """What both paths of a comparison are given besides the files and the engine."""

    host_prefix: str | None
    seed_prefix: str | None
    thresholds: Thresholds
    policy: ComparePolicy


def _compare_without_torch(
    host: Path, seed: Path | None, engine_options: EngineOptions, sides: Sides
) -> Comparison | None:
    """The comparison on the torch-free path when it applies (the scan's conditions:
    :mod:`gradaudit.scan.torch_free`), else ``None``: the caller then compares with torch."""
    from gradaudit.comparison import files  # numpy: only once a command runs
    from gradaudit.scan import torch_free  # numpy: only once a command runs

    device = str(engine_options.device or "auto")
    if not torch_free.applies(device=device, engine=engine_options.engine):
        return None
    try:
        return files.compare_paths_torch_free(
            host,
            seed,
            host_prefix=sides.host_prefix,
            seed_prefix=sides.seed_prefix,
            thresholds=sides.thresholds,
            policy=sides.policy,
        )
    except torch_free.NeedsTorch:
        return None
