"""The options of :class:`~gradaudit.training.monitor.GradientMonitor`: what it does about
a step (the action literals), the keyword options the framework adapters pass through, and
the one check of their values.

Apart from the monitor so that an adapter, a config or a test can name them without the
monitor's collection machinery, and so that the checks read as the list of rules they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypedDict, get_args

from gradaudit.policy import Thresholds
from gradaudit.precision import Precision

__all__ = [
    "AdapterOptions",
    "DivergenceAction",
    "FindingAction",
    "LocateMode",
    "MonitorOptions",
    "NonFiniteAction",
    "check_options",
]

#: What a monitor does when a collected step has NaN or Inf gradients:
#: ``dump`` writes a dump and warns; ``raise`` writes a dump and raises
#: :class:`~gradaudit.NonFiniteGradientError`; ``warn`` only warns; ``ignore``
#: only records it in the history.
NonFiniteAction = Literal["dump", "raise", "warn", "ignore"]
#: What a monitor does about a collected step's other findings (exploding, vanishing,
#: outlier …): ``warn`` (default) issues a :class:`~gradaudit.GradientFindingWarning`
#: for findings new since the previous collected step; ``dump`` warns and writes a dump
#: when a finding fails (``Thresholds.fail_on``: ``exploding`` by default); ``raise``
#: warns, dumps and raises :class:`~gradaudit.GradientFindingError` on a failing one;
#: ``ignore`` only records them (history, logged counts).
FindingAction = Literal["dump", "raise", "warn", "ignore"]
#: What a monitor of a ``DistributedDataParallel`` model does when a replicated gradient is
#: not bit-identical on every rank (:mod:`gradaudit.training.replicas`): ``dump`` (default)
#: writes each rank's dump and warns; ``raise`` dumps and raises
#: :class:`~gradaudit.ReplicaDivergenceError`; ``warn`` only warns; ``ignore`` only records
#: it (``record.replicas``, the logged count); ``off`` does not check (no collective).
DivergenceAction = Literal["dump", "raise", "warn", "ignore", "off"]
#: When a monitor arms a :class:`~gradaudit.NanLocator` (see ``docs/locate.md``):
#: never, from the first collected NaN/Inf until a step is located, or every
#: ``locate_every`` steps.
LocateMode = Literal["off", "on_nonfinite", "always"]


class AdapterOptions(TypedDict, total=False):
    """:class:`~gradaudit.training.monitor.GradientMonitor`'s keyword options but ``every``,
    for adapters that build monitors.

    The framework callbacks (:mod:`gradaudit.integrations`) take these as
    ``**options`` and hand them to the monitors they build, so a new monitor option
    reaches every adapter without being declared again; the monitor's signature
    holds the defaults and :func:`check_options` checks the values. ``every`` is
    each callback's own argument: by default they collect the steps their trainer logs.
    """

    dump_dir: str | Path | None
    on_nonfinite: NonFiniteAction
    on_finding: FindingAction
    on_divergence: DivergenceAction
    sync: bool
    history: int
    max_dumps: int
    thresholds: Thresholds | None
    locate: LocateMode
    locate_every: int
    precision: Precision | str | None
    max_underflow: float


class MonitorOptions(AdapterOptions, total=False):
    """Every keyword option of :class:`~gradaudit.training.monitor.GradientMonitor`."""

    every: int


def check_options(
    *,
    every: int,
    on_nonfinite: str,
    on_finding: str,
    on_divergence: str,
    history: int,
    max_dumps: int,
    locate: str,
    locate_every: int,
    precision: Precision | str | None,
    max_underflow: float,
    hooks_modules: bool,
) -> None:
    """Raise :class:`ValueError` naming the first option whose value a monitor cannot take
    (``hooks_modules``: whether the watched model is an ``nn.Module``, which ``locate``
    needs to hook its modules)."""
    if precision is not None and precision not in tuple(Precision):
        choices = ", ".join(repr(p.value) for p in Precision)
        raise ValueError(f"precision must be None or one of {choices}; got {precision!r}")
    if not 0 <= max_underflow <= 1:
        raise ValueError(f"max_underflow must be in [0, 1]; got {max_underflow!r}")
    if locate not in get_args(LocateMode):
        choices = ", ".join(repr(a) for a in get_args(LocateMode))
        raise ValueError(f"locate must be one of {choices}; got {locate!r}")
    if locate != "off" and not hooks_modules:
        raise ValueError("locate needs the model itself (an nn.Module) to hook its modules")
    if locate_every < 1:
        raise ValueError("locate_every must be >= 1")
    if every < 1:
        raise ValueError("every must be >= 1")
    if history < 1:
        raise ValueError("history must be >= 1")
    if max_dumps < 0:
        raise ValueError("max_dumps must be >= 0")
    if on_nonfinite not in get_args(NonFiniteAction):
        choices = ", ".join(repr(a) for a in get_args(NonFiniteAction))
        raise ValueError(f"on_nonfinite must be one of {choices}; got {on_nonfinite!r}")
    if on_finding not in get_args(FindingAction):
        choices = ", ".join(repr(a) for a in get_args(FindingAction))
        raise ValueError(f"on_finding must be one of {choices}; got {on_finding!r}")
    if on_divergence not in get_args(DivergenceAction):
        choices = ", ".join(repr(a) for a in get_args(DivergenceAction))
        raise ValueError(f"on_divergence must be one of {choices}; got {on_divergence!r}")
