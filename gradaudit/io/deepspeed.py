"""DeepSpeed ZeRO stage 1/2 checkpoints (``global_step*/``), read as one checkpoint.

A DeepSpeed checkpoint directory holds ``mp_rank_00_model_states.pt`` (the module's state
dict and ``param_shapes``: one ``{name: shape}`` per optimizer parameter group, in the
order the parameters were flattened) and one ``*zero_pp_rank_R_mp_rank_00_optim_states.pt``
per data-parallel rank. Each of those holds rank R's *partition* of every group's flat fp32
master weights (``single_partition_of_fp32_groups``) and of the optimizer's flat moments
(``base_optimizer_state.state[g].exp_avg``…). The layout is the one DeepSpeed's own
``zero_to_fp32.py`` reverses: a group's flat buffer is the rank partitions concatenated in
rank order (equal lengths, zero padding at the end), and the group's parameters lie in it
back to back in ``param_shapes`` order.

Every tensor is named after its parameter: ``module.<name>`` for the module's (often
bf16/fp16) weights, ``fp32_master.<name>`` for the master weights, and
``optim.state.<name>.<key>`` for the moments, the same FQN form as a
``torch.distributed.checkpoint``'s optimizer state, so roles apply alike. A parameter that
straddles two ranks' partitions is read as :class:`~gradaudit.io.base.Pieces`, its rows
merged; nothing is concatenated. The files are memory-mapped (``torch.load(...,
weights_only=True, mmap=True)``) through :class:`~gradaudit.io.torch_pickle.TorchPickleSource`:
a file that needs a class the weights-only loader refuses (DeepSpeed pickles its
``LossScaler`` object in fp16 runs) is an input error naming the class, never loaded another
way. ZeRO stage 3 (each parameter partitioned separately) is not read: refused, named.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gradaudit.errors import InputError
from gradaudit.io.base import Excluded, Pieces, Select, SourceItem
from gradaudit.io.files import show
from gradaudit.io.layouts import MODEL_STATES as MODEL_STATES
from gradaudit.io.layouts import is_deepspeed_checkpoint as is_deepspeed_checkpoint
from gradaudit.io.layouts import optim_files as optim_files
from gradaudit.io.nested import walk_checkpoint
from gradaudit.io.torch_pickle import TorchPickleSource


@dataclass(frozen=True)
class _Slot:
    """Where one parameter lies in its group's flat buffer."""

    name: str
    shape: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class DeepSpeedSource:
    """A DeepSpeed ZeRO 1/2 checkpoint directory: module, fp32 master weights, moments."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files = optim_files(path)
        #: The files loaded so far, by name (for :meth:`check_unchanged`).
        self._opened: list[tuple[str, TorchPickleSource]] = []
        ranks = [rank for rank, _ in self.files]
        if ranks != list(range(len(ranks))):
            raise InputError(path, f"ZeRO optimizer partitions for ranks {ranks}: some are missing")

    def _load(self, name: str) -> Any:
        try:
            source = TorchPickleSource(os.path.join(self.path, name))
            loaded = source._load("cpu")
            if source.archive is not None:
                source._guard_storages(loaded)  # torch maps zip files: see mapguard
            self._opened.append((name, source))
            return loaded
        except InputError as error:
            raise InputError(self.path, f"{show(name)}: {error.cause}") from None

    def check_unchanged(self) -> None:
        """Raise :class:`InputError` if a file of the checkpoint changed while it was read."""
        for name, source in self._opened:
            try:
                source.check_unchanged()
            except InputError as error:
                raise InputError(self.path, f"{show(name)}: {error.cause}") from None

    def items(self, select: Select | None = None) -> Iterator[SourceItem]:
        states = self._load(MODEL_STATES)
        if not isinstance(states, dict):
            raise InputError(self.path, f"{MODEL_STATES} does not hold a dict")
        groups = self._groups(states)
        module = states.get("module")
        if isinstance(module, dict):
            yield from walk_checkpoint({"module": module}, self.path, select)
        optims = [self._optimizer(name, rank) for rank, name in self.files]
        stages = [o.get("zero_stage") for o in optims]
        if not all(type(s) is int for s in stages):
            raise InputError(
                self.path, f"zero_stage is {show(repr(stages), limit=60)}, not an integer"
            )
        stage = set(stages)
        if stage - {1, 2}:
            raise InputError(
                self.path, f"ZeRO stage {sorted(map(str, stage))} is not read (stages 1 and 2 are)"
            )
        masters = [o.get("single_partition_of_fp32_groups") for o in optims]
        flats = [_tensors(m, len(groups)) for m in masters]
        yield from self._flat("fp32_master.{}", groups, flats, select)
        states_by_rank = [_moments(o, len(groups)) for o in optims]
        keys = sorted({key for rank in states_by_rank for group in rank for key in group})
        for key in keys:
            partitions = [[group.get(key) for group in rank] for rank in states_by_rank]
            yield from self._flat("optim.state.{}." + key, groups, partitions, select)

    def _groups(self, states: Mapping[str, Any]) -> list[list[_Slot]]:
        shapes = states.get("param_shapes")
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise InputError(self.path, f"{MODEL_STATES} has no param_shapes list")
        groups = []
        for group in shapes:
            slots, start = [], 0
            for name, shape in group.items():
                if not isinstance(name, str) or not isinstance(shape, tuple | list):
                    raise InputError(self.path, f"{MODEL_STATES} has a malformed param_shapes")
                if not all(type(n) is int and n >= 0 for n in shape):
                    # A negative dimension would shift every later slot so that no real
                    # value is read (a false OK); text, NaN or a tensor is no dimension.
                    raise InputError(
                        self.path,
                        f"{MODEL_STATES} gives {show(name)} the shape "
                        f"{show(repr(shape), limit=60)}: dimensions must be integers >= 0",
                    )
                size = tuple(shape)
                slots.append(_Slot(name, size, start))
                start += math.prod(size)
            groups.append(slots)
        return groups

    def _optimizer(self, name: str, rank: int) -> dict[str, Any]:
        loaded = self._load(name)
        state = loaded.get("optimizer_state_dict") if isinstance(loaded, dict) else None
        if not isinstance(state, dict):
            raise InputError(self.path, f"{show(name)} has no optimizer_state_dict")
        return state

    def _flat(
        self,
        pattern: str,
        groups: list[list[_Slot]],
        partitions: list[list[torch.Tensor | None]],
        select: Select | None = None,
    ) -> Iterator[SourceItem]:
        """Each parameter's values out of the rank partitions of its group's flat buffer."""
        for index, slots in enumerate(groups):
            parts = [rank[index] for rank in partitions]
            if any(p is None for p in parts):
                continue  # this buffer is not saved for this group (e.g. no moments yet)
            flat = [p for p in parts if p is not None]
            lengths = {p.numel() for p in flat}
            if len(lengths) != 1 or any(p.dim() != 1 for p in flat):
                raise InputError(
                    self.path, f"{pattern.format('*')}: group {index} partitions differ"
                )
            length = lengths.pop()
            needed = sum(s.numel for s in slots)
            if needed > length * len(flat):
                raise InputError(
                    self.path,
                    f"param_shapes of group {index} need {needed} values, the "
                    f"{len(flat)} partitions hold {length * len(flat)}",
                )
            for slot in slots:
                name = pattern.format(slot.name)
                if select is not None and not select(name):
                    yield Excluded(name)
                    continue
                yield Pieces(name, slot.shape, flat[0].dtype, _slicer(flat, length, slot))


def _slicer(
    flat: list[torch.Tensor], length: int, slot: _Slot
) -> Callable[[], Iterator[torch.Tensor]]:
    def load() -> Iterator[torch.Tensor]:
        begin, end = slot.start, slot.start + slot.numel
        for rank, part in enumerate(flat):
            low, high = max(begin, rank * length), min(end, (rank + 1) * length)
            if low < high:
                yield part[low - rank * length : high - rank * length]

    return load


def _tensors(value: object, count: int) -> list[torch.Tensor | None]:
    if not isinstance(value, list | tuple):
        return [None] * count
    items = [v if isinstance(v, torch.Tensor) else None for v in value]
    return (items + [None] * count)[:count]


def _moments(optimizer: Mapping[str, Any], count: int) -> list[dict[str, torch.Tensor]]:
    """Per group, the flat moment partitions (``exp_avg``…), without the ``step`` counter."""
    base = optimizer.get("base_optimizer_state")
    state = base.get("state") if isinstance(base, dict) else None
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
    if not isinstance(state, dict):
        return groups
    for index, entry in state.items():
        if isinstance(index, int) and 0 <= index < count and isinstance(entry, dict):
            groups[index] = {
                k: v
                for k, v in entry.items()
                if isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() == 1
            }
    return groups
