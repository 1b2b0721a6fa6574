"""Gradients of a model by parameter name: the engine's entry point inside a training loop.

Call :func:`collect_module` between ``backward()`` and ``optimizer.step()``: it
queues the device work for every gradient and returns a :class:`PendingStats`
without reading anything back, so the loop never waits for the device.
Gradients that are ``DTensor`` shards (FSDP2, tensor parallel), or plain
tensors with a process group passed, are combined across ranks by
:mod:`gradaudit.training.distributed`.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol, TypeAlias

import numpy as np
import torch

from gradaudit.engine.dtensor import any_dtensor
from gradaudit.engine.stats import StatsCollector
from gradaudit.scan.pending import PendingStats
from gradaudit.training.distributed import collect_sharded, collect_sharded_with_histograms

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: What :func:`collect_module` accepts: a module, a mapping of names to
#: parameters, or an iterable of parameters or of ``(name, parameter)`` pairs
#: (``model.parameters()``, ``model.named_parameters()``, an optimizer's param group).
ParametersInput: TypeAlias = (
    torch.nn.Module
    | Mapping[str, torch.Tensor]
    | Iterable[torch.Tensor]
    | Iterable[tuple[str, torch.Tensor]]
)

#: Name given to the i-th of an iterable of bare parameters when no prefix is passed.
DEFAULT_PARAMETER_PREFIX = "param"


def unwrap_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``DistributedDataParallel``, ``DataParallel`` or ``torch.compile``
    wrapper holds (through any nesting of them); other modules as they are.

    Their ``named_parameters()`` prefix every name with ``module.`` or ``_orig_mod.``: the
    wrapped module's names are the ones a checkpoint (``model.module.state_dict()``), the
    framework callbacks and a single-process run use, so dumps and reports use them too.
    """
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            model = model.module
            continue
        # The name first: a plain module's ``_orig_mod`` lookup raises inside torch's
        # ``__getattr__`` (~2 us, on every monitor step: issue 28 item 9).
        inner = (
            getattr(model, "_orig_mod", None) if type(model).__name__ == "OptimizedModule" else None
        )
        if isinstance(inner, torch.nn.Module):
            model = inner
        else:
            return model


def named_parameters(
    params: ParametersInput, *, prefix: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` pairs, each parameter once, in the order given.

    A module's names are its ``named_parameters()`` names, looked through a
    ``DistributedDataParallel``/``DataParallel``/``torch.compile`` wrapper (no ``module.``
    or ``_orig_mod.`` prefix: :func:`unwrap_module`); bare parameters are
    named by position, ``param.0``, ``param.1``, ... (or ``PREFIX.0``, ...). A
    ``prefix`` is prepended to every other name as ``PREFIX.name``. A parameter
    seen twice (tied weights) is yielded once, under its first name, as
    ``Module.named_parameters`` does: counting it twice would inflate the global norm.
    """
    if isinstance(params, torch.nn.Module):
        items: Iterable[object] = unwrap_module(params).named_parameters()
    elif isinstance(params, Mapping):
        items = params.items()
    else:
        items = params
    seen: set[int] = set()
    for index, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            name = f"{prefix or DEFAULT_PARAMETER_PREFIX}.{index}"
            tensor = item
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            name = str(item[0]) if prefix is None else f"{prefix}.{item[0]}"
            tensor = item[1]
        else:
            raise TypeError(
                "expected a module, parameters, or (name, parameter) pairs; "
                f"got an item of type {type(item).__name__}"
            )
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield name, tensor


def named_gradients(
    params: ParametersInput, *, prefix: str | None = None
) -> list[tuple[str, torch.Tensor]]:
    """``(name, gradient)`` of every parameter whose ``grad`` is not ``None``.

    Frozen parameters and parameters that took no part in the backward pass
    have no gradient and are left out: they have nothing to audit. The result
    is a list, so it can be handed to several consumers (``collect_async``,
    ``save_gradients``, ``dual_stats``).
    """
    return [
        (name, param.grad)
        for name, param in named_parameters(params, prefix=prefix)
        if param.grad is not None
    ]


class GradientLister:
    """:func:`named_gradients` of the same parameters again and again, for a training loop.

    Walking a module's ``named_parameters()`` costs ~1.5 us per parameter (0.6 ms for
    400) on every collected step, while the parameters almost never change. A module's
    ``(name, parameter)`` list is therefore walked once and kept, with every module's
    ``_parameters`` and ``_modules`` entries; each call checks those (~0.06 us an entry:
    a parameter replaced, registered, deleted or renamed, a submodule added or swapped,
    a parametrization) and walks again when any differs. Only which parameters have a
    ``grad`` is read on every call. Not seen: a module's ``_parameters`` dict itself
    replaced, or an entry deleted and inserted again (the same object, another place in
    the order). Other inputs (a mapping, parameters) are walked every time, as
    :func:`named_gradients` does: a caller's dict or list may change.
    """

    def __init__(self, params: ParametersInput, *, prefix: str | None = None) -> None:
        self._params = params
        self._prefix = prefix
        self._root: torch.nn.Module | None = None
        self._pairs: list[tuple[str, torch.Tensor]] = []
        # The pairs as columns, and a column of ``None`` as long, for :meth:`__call__`.
        self._names: list[str] = []
        self._parameters: list[torch.Tensor] = []
        self._nones: list[None] = []
        #: Every module's ``_parameters`` and ``_modules`` dicts and their lengths, and
        #: every entry of them, as walked. Held, so no id is reused meanwhile.
        self._dicts: list[dict[str, object]] = []
        self._lengths: list[int] = []
        # The entries as three parallel lists (dict, key, value), checked in one C pass.
        self._entry_dicts: list[dict[str, object]] = []
        self._entry_keys: list[str] = []
        self._entry_values: list[object] = []
        self._missing: list[object] = []

    def __call__(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(*self.columns(), strict=True))

    def columns(self) -> tuple[list[str], list[torch.Tensor]]:
        """:meth:`__call__` as two lists, the names and the gradients: what the collector
        takes (a monitor's every step builds no pairs to split again)."""
        if not isinstance(self._params, torch.nn.Module):
            pairs = named_gradients(self._params, prefix=self._prefix)
            return [name for name, _ in pairs], [grad for _, grad in pairs]
        if self._root is None or not self._unchanged(self._params):
            self._walk(self._params)
        # ``grad`` read once per parameter (a property through torch's C code), in a C loop.
        grads = list(map(_GRAD, self._parameters))
        if all(map(operator.is_not, grads, self._nones)):  # every parameter has one
            return self._names.copy(), grads
        kept = list(map(operator.is_not, grads, self._nones))
        return list(itertools.compress(self._names, kept)), list(itertools.compress(grads, kept))

    def names(self) -> list[str]:
        """The name of every parameter, with or without a gradient, in order (a module's
        walk is kept as for :meth:`__call__`)."""
        if not isinstance(self._params, torch.nn.Module):
            return [name for name, _ in named_parameters(self._params, prefix=self._prefix)]
        if self._root is None or not self._unchanged(self._params):
            self._walk(self._params)
        return [name for name, _ in self._pairs]

    def _walk(self, module: torch.nn.Module) -> None:
        self._root = unwrap_module(module)
        self._pairs = list(named_parameters(module, prefix=self._prefix))
        self._names = [name for name, _ in self._pairs]
        self._parameters = [param for _, param in self._pairs]
        self._nones = [None] * len(self._pairs)
        dicts: list[dict[str, object]] = []
        for each in self._root.modules():
            dicts += [each._parameters, each._modules]  # type: ignore[list-item]
        self._dicts = dicts
        self._lengths = [len(entries) for entries in dicts]
        entries = [(each, key, value) for each in dicts for key, value in each.items()]
        self._entry_dicts = [each for each, _, _ in entries]
        self._entry_keys = [key for _, key, _ in entries]
        self._entry_values = [value for _, _, value in entries]
        self._missing = [_MISSING] * len(entries)

    def _unchanged(self, module: torch.nn.Module) -> bool:
        if unwrap_module(module) is not self._root:
            return False
        if list(map(len, self._dicts)) != self._lengths:  # in C, as below
            return False
        # ``dict.get(entries, key, _MISSING) is value`` for every entry, mapped in C: a
        # Python generator over the entries was half the lister's cost (issue 28 item 9).
        found = map(dict.get, self._entry_dicts, self._entry_keys, self._missing)
        return all(map(operator.is_, found, self._entry_values))


_GRAD = operator.attrgetter("grad")
#: Not any entry's value (a parameter may be registered as ``None``).
_MISSING = object()


def collect_module(
    model: ParametersInput,
    *,
    prefix: str | None = None,
    group: ProcessGroup | None = None,
) -> PendingStats:
    """Queue the stats of the model's gradients on their devices; nothing is read back.

    Call between ``backward()`` and ``optimizer.step()`` (or ``zero_grad()``),
    then :meth:`PendingStats.materialize` whenever convenient for the one read.

    Distributed (a collective: every rank calls it with the same parameters in
    the same order): ``DTensor`` gradients are reduced on their local shard and
    combined over their device mesh, replicated mesh dimensions counted once;
    with ``group`` given, every plain gradient is taken to be a disjoint shard of
    the same-named parameter on each rank of ``group`` and combined over it.
    Either way every rank gets the stats of the whole parameter.
    """
    return collect_gradients(named_gradients(model, prefix=prefix), group=group)


def collect_gradients(
    gradients: Iterable[tuple[str, torch.Tensor]],
    *,
    group: ProcessGroup | None = None,
    collector: StatsCollector | None = None,
) -> PendingStats:
    """Collect named gradients, across ranks when needed; ``collector`` keeps scratch buffers.

    A training loop collects again and again: passing the same collector
    reuses its scratch buffers instead of allocating fresh ones every step.
    """
    named = list(gradients)
    return collect_columns(
        [str(name) for name, _ in named],
        [grad for _, grad in named],
        group=group,
        collector=collector,
    )


class HistogramCounts(Protocol):
    """Where a collection's exponent histograms are read: a :class:`PendingStats` of this
    process's tensors, or the :class:`~gradaudit.training.distributed.ShardHistograms`
    summed across ranks."""

    def histogram_counts(self) -> np.ndarray:
        """Every entry's exponent histogram, ``[entries, bins]`` int64."""
        ...


def collect_columns(
    names: list[str],
    gradients: list[torch.Tensor],
    *,
    group: ProcessGroup | None = None,
    collector: StatsCollector | None = None,
) -> PendingStats:
    """:func:`collect_gradients` of ``names[i]: gradients[i]`` (a
    :meth:`GradientLister.columns`)."""
    if _sharded(gradients, group):
        named = list(zip(names, gradients, strict=True))
        return collect_sharded(named, group=group, collector=collector)
    pending = PendingStats(collector=None if collector is None else collector.fresh())
    pending.add_tensors(names, gradients)
    return pending


def collect_with_histograms(
    names: list[str],
    gradients: list[torch.Tensor],
    *,
    group: ProcessGroup | None = None,
    collector: StatsCollector | None = None,
) -> tuple[PendingStats, HistogramCounts]:
    """:func:`collect_columns`, and each gradient's exponent histogram (a monitor's
    ``precision=``): of the whole parameters, across ranks as the stats rows are."""
    if _sharded(gradients, group):
        named = list(zip(names, gradients, strict=True))
        return collect_sharded_with_histograms(named, group=group, collector=collector)
    pending = PendingStats(
        collector=None if collector is None else collector.fresh(), histograms=True
    )
    pending.add_tensors(names, gradients)
    return pending, pending


def _sharded(gradients: list[torch.Tensor], group: ProcessGroup | None) -> bool:
    """Whether the gradients are shards combined across ranks (``group=`` or DTensors)."""
    return group is not None or any_dtensor(gradients)
