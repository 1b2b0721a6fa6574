"""``gradaudit scan`` of safetensors files on the CPU, without importing torch.

``import torch`` costs about 1.2 s of CPU, a hundred times what scanning a 90 MiB dump
takes. The commonest run - safetensors files, the CPU, the native kernel - needs none of
it: the header reader is numpy, the file is memory-mapped, and the native kernel takes
addresses. So this module reads such files with the torch-free half of the safetensors
reader (:class:`~gradaudit.io.safetensors_map.MappedSafetensors`), hands the addresses to
the native kernel in the same batches as the torch path (:class:`NativeBatch`, with
torch's thread count), and judges the rows with the same code
(:class:`~gradaudit.scan.collected.Collected`). It is the same engine without torch, not a
second one: the rows, the merge rule, the judging and the renderers are shared, and
``tests/scan/test_torch_free.py`` checks that both paths give identical reports.

Zip ``torch.save`` checkpoints (``.pt``, ``.pth``, ``.bin``, ``.ckpt``) are read the same
way when their pickle holds only tensors, containers and plain values
(:mod:`gradaudit.io.zip_checkpoint`): their storages are zip members stored raw, so a
tensor's address is the map's plus its member's offset, and the walk that names the
tensors and skips the rest is the torch path's (:func:`gradaudit.io.nested.walk_checkpoint`).
``compare`` and ``trend`` read their files through the same :class:`NativeScan`
(:func:`~gradaudit.comparison.files.compare_paths_torch_free`,
:func:`~gradaudit.trend.builder.trend_paths_torch_free`), ``.pt`` files included.

``--precision`` needs no torch either: the kernel counts each tensor's exponent histogram
in the same call as its row (:meth:`NativeBatch.reduce_with_histograms`, the call the torch
path's collector makes), and the headroom is judged from them by the same code.

When it applies (:func:`applies`, then :func:`takes`) is decided conservatively; anything
else takes the torch path unchanged. A file holding a dtype this path cannot report as
torch would (complex, the fp8 "fnuz" and e8m0 formats, or one this torch may not know),
or a checkpoint the torch-free unpickler declines (a legacy file, another global, optimizer
state whose gradient estimates need torch's reductions, a large strided view), raises
:class:`NeedsTorch`, and the caller scans everything again with torch.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import SimpleNamespace

import numpy as np

from gradaudit.engine import native_rows
from gradaudit.engine.native_rows import BUCKET_MAX_ELEMENTS
from gradaudit.engine.options import Engine
from gradaudit.errors import OutputError, UsageError
from gradaudit.io.base import Excluded, SourceItem
from gradaudit.io.discover import Expanded, FileInput, input_kind
from gradaudit.io.files import FileIdentity, check_regular_file
from gradaudit.io.layouts import is_dcp_directory, is_deepspeed_checkpoint, is_trainer_checkpoint
from gradaudit.io.nested import walk_checkpoint
from gradaudit.io.safetensors_map import TORCH_NAMES, MappedSafetensors, ReadAhead
from gradaudit.io.safetensors_table import DTYPE_NAMES, SIZES_BY_CODE
from gradaudit.io.sharded import in_shard, validated_shards
from gradaudit.io.sniff import sniff
from gradaudit.io.torch_zip import TorchZip, inspect_torch_zip
from gradaudit.io.zip_checkpoint import MappedZipCheckpoint, NotTorchFree, StoredTensor
from gradaudit.policy import Role, Thresholds
from gradaudit.results import InputProblem, Report, Skipped
from gradaudit.results.roles import TensorHint
from gradaudit.results.row import skip_reason
from gradaudit.scan.boundary import problem_of, reading
from gradaudit.scan.collected import Collected, Routing
from gradaudit.scan.host_rows import HostRows
from gradaudit.selection import NameFilter

__all__ = [
    "NativeScan",
    "NeedsTorch",
    "applies",
    "check_checkpoint",
    "gpu_may_exist",
    "scan_torch_free",
    "takes",
]

#: Device files and driver directories whose presence means torch might find a GPU
#: (NVIDIA's driver, AMD's ROCm, WSL's GPU bridge). ``--device auto`` takes the torch
#: path when any exists: only torch can say whether it is usable.
GPU_MARKERS = (
    "/dev/nvidiactl",
    "/dev/nvidia0",
    "/proc/driver/nvidia",
    "/dev/kfd",
    "/dev/dxg",
)

#: safetensors dtypes the engine does not audit and torch skips as not floating-point:
#: reported here with torch's wording, so they need no torch either.
_NOT_FLOATING = frozenset({"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"})


class NeedsTorch(Exception):
    """The inputs hold something only the torch path reports as it should: scan with torch."""


def gpu_may_exist() -> bool:
    """Whether this machine may have a GPU torch could use (see :data:`GPU_MARKERS`)."""
    if any(os.path.exists(marker) for marker in GPU_MARKERS):
        return True
    try:
        names = os.listdir("/dev")
    except OSError:
        return True  # cannot tell: assume one
    return any(name.startswith("nvidia") and name[6:].isdigit() for name in names)


def applies(*, device: str, engine: Engine | str, distributed: bool = False) -> bool:
    """Whether a scan with these options may run without torch (the inputs aside: :func:`takes`).

    The native kernel must be built and chosen (``auto`` or ``native``); the device
    ``cpu``, or ``auto`` on a machine where no GPU can exist; no ``torchrun`` job.
    ``--precision`` needs nothing more: the kernel counts the exponent histograms in the
    same read as the rows, as it does for the torch path.
    """
    if distributed or not native_rows.available():
        return False
    if Engine(engine) not in (Engine.AUTO, Engine.NATIVE):
        return False
    text = device.strip().lower()
    return text == "cpu" or (text == "auto" and not gpu_may_exist())


def takes(entries: Iterable[Expanded]) -> bool:
    """Whether every expanded input is a safetensors file or index, or a file with a
    ``torch.save`` ending (or skipped, or bad); not a DCP, Trainer or DeepSpeed directory.
    A checkpoint the torch-free reader declines raises :class:`NeedsTorch` when it is read."""
    for entry in entries:
        if not isinstance(entry, FileInput):
            continue
        path = entry.path
        if is_dcp_directory(path) or is_trainer_checkpoint(path) or is_deepspeed_checkpoint(path):
            return False
        if input_kind(path) not in ("safetensors", "index", "pickle"):
            return False
    return True


class NativeScan(Collected):
    """Safetensors files read into native stats rows in host memory; no torch.

    The torch path's :class:`~gradaudit.scan.pending.PendingStats` with its reading
    (:func:`gradaudit.scan.reading.read_file`) for the one case it covers: the same
    columns, the same batches, the same report.
    """

    def __init__(self, rows: HostRows | None = None, *, histograms: bool = False) -> None:
        super().__init__()
        self._rows = rows or HostRows(histograms=histograms)
        self._tickets: list[int] = []
        codes = self._codes_by_name = native_rows.codes_by_name()
        #: Per safetensors dtype code: the kernel's code, -1 if skipped, -2 if torch is needed.
        self._kernel_codes = np.array(
            [
                codes.get(TORCH_NAMES.get(name, ""), -1 if name in _NOT_FLOATING else -2)
                for name in DTYPE_NAMES
            ],
            dtype=np.int64,
        )

    def child(self) -> NativeScan:
        """An empty collection sharing this one's batch (see ``PendingStats.child``)."""
        return NativeScan(self._rows)

    def absorb(self, other: NativeScan) -> None:
        self.absorb_facts(other, ("_tickets",))

    def read_file(
        self,
        path: str,
        select: Callable[[str], bool] | None = None,
        progress: Callable[[int], None] | None = None,
        routing: Routing | None = None,
    ) -> InputProblem | None:
        """Collect one safetensors file or index, all or nothing (as the torch path does),
        each tensor under ``routing``'s label (default: the path), as
        :func:`gradaudit.scan.reading.read_file` routes them."""
        if input_kind(path) == "pickle":
            return self._read_checkpoint(path, select, progress, routing)
        part = self.child()
        try:
            with reading(path):  # the reader's calls: see gradaudit.scan.boundary
                check_regular_file(path)
                if input_kind(path) == "index":
                    shards: list[tuple[str | None, MappedSafetensors]] = [
                        (shard, MappedSafetensors(shard_path, header))
                        for shard, shard_path, header in validated_shards(path)
                    ]
                    metadata = shards[0][1].metadata if shards else {}
                else:
                    shards = [(None, MappedSafetensors(path))]
                    metadata = shards[0][1].metadata
                for label in (path,) if routing is None else routing.labels:
                    part.read_hints(SimpleNamespace(metadata=metadata), label)
            for _, source in shards:
                self._check_dtypes(source)
            for shard, source in shards:
                with _in_shard(path, shard):
                    part._read(source, path, select, progress, routing)
            part._rows.settle()
            # Only now has every byte been read: a file that changed meanwhile is an error.
            with reading(path):
                for shard, source in shards:
                    with _in_shard(path, shard):
                        source.check_unchanged()
        except (NeedsTorch, UsageError, OutputError):
            raise  # the run's, not this input's: the caller scans again with torch
        except Exception as error:  # noqa: BLE001 - the per-input boundary (scan.boundary)
            return problem_of(path, error)
        self.absorb(part)
        return None

    def _read_checkpoint(
        self,
        path: str,
        select: Callable[[str], bool] | None,
        progress: Callable[[int], None] | None,
        routing: Routing | None,
    ) -> InputProblem | None:
        """Collect one zip ``torch.save`` checkpoint as ``reading.read_file`` collects a
        ``TorchPickleSource``'s items: the same walk, names, skips, hints and routes, each
        tensor one native ticket (a small strided view copied, as the collector copies it)."""
        part = self.child()
        declined: NotTorchFree | None = None
        try:
            with reading(path):  # the reader's calls: see gradaudit.scan.boundary
                try:
                    check_regular_file(path)
                    source = _open_checkpoint(path)
                    hints: dict[str, TensorHint] = {}
                    items = list(walk_checkpoint(source.root, path, select, hints))
                    for item in items:
                        part._checkpoint_item(source, item, hints, path, progress, routing)
                except NotTorchFree as error:
                    declined = error
            if declined is None:
                part._rows.settle()
                with reading(path):
                    source.check_unchanged()
        except (NeedsTorch, UsageError, OutputError):
            raise
        except Exception as error:  # noqa: BLE001 - the per-input boundary (scan.boundary)
            return problem_of(path, error)
        if declined is not None:
            raise NeedsTorch(path) from declined
        self.absorb(part)
        return None

    def _checkpoint_item(
        self,
        source: MappedZipCheckpoint,
        item: SourceItem,
        hints: dict[str, TensorHint],
        path: str,
        progress: Callable[[int], None] | None,
        routing: Routing | None,
    ) -> None:
        """One item of the walk, as ``reading.read_file`` and ``PendingStats.queue`` take it."""
        name = item[0] if isinstance(item, tuple) else item.name
        label = self._route(name, path, routing)
        if label is None:
            return
        if isinstance(item, Excluded):
            self.exclude(label)
            return
        if isinstance(item, Skipped):
            self.skip(dataclasses.replace(item, source=label))
            return
        assert isinstance(item, tuple)
        name, tensor = item[0], item[1]
        assert isinstance(tensor, StoredTensor)
        hint = hints.get(name)
        if hint is not None and (
            hint.basis is not None or hint.role is Role.OPTIMIZER_SECOND_MOMENT
        ):
            # Its gradient estimate and checks take extra rows from torch's reductions.
            raise NotTorchFree("optimizer state with a gradient estimate")
        kernel = self._codes_by_name.get(tensor.dtype)
        if kernel is None:
            if tensor.is_floating_point:
                raise NotTorchFree(f"dtype {tensor.dtype} is not the native kernel's")
            self.skip(Skipped(name, skip_reason(tensor.dtype, floating=False), label, False))
            return
        pointer, keep = source.data(tensor, BUCKET_MAX_ELEMENTS)
        count = tensor.numel()
        nbytes = count * tensor.itemsize
        self._tickets.append(self._rows.add_one(pointer, count, kernel, nbytes, keep))
        self.add_columns([name], [tensor.dim()], tensor.shape, tensor.dtype, label, hint)
        if progress is not None:
            progress(nbytes)

    def _check_dtypes(self, source: MappedSafetensors) -> None:
        codes = np.frombuffer(source.header.tensors.codes, dtype=np.uint8)
        if len(codes) and (self._kernel_codes[np.unique(codes)] == -2).any():
            raise NeedsTorch(source.path)

    def _read(
        self,
        source: MappedSafetensors,
        label: str,
        select: Callable[[str], bool] | None,
        progress: Callable[[int], None] | None,
        routing: Routing | None = None,
    ) -> None:
        """Queue one file's tensors in file order: runs of small ones, the others one by one
        (as ``SafetensorsSource.runs``, or ``items`` when ``select`` is given), each under
        its route's label; a run whose tensors go to different labels is queued a stretch
        of one label at a time (as ``reading._queue_routed``)."""
        mapping = source.map()
        table = source.header.tensors
        if mapping is None or not len(table):
            return
        numel = source.element_counts()
        ahead = ReadAhead(mapping, source.data_start, table)
        whole = label if routing is None else routing.whole
        if select is not None:
            for index, name in enumerate(table.names):
                routed = self._route(name, label, routing)
                if routed is None:
                    continue
                if select(name):
                    self._one(source, mapping, index, numel, routed, progress, ahead)
                else:
                    self.exclude(routed)
            return
        for first, stop, code in source.run_bounds(self._kernel_codes >= 0):
            if code < 0:
                for index in range(first, stop):
                    routed = self._route(table.names[index], label, routing)
                    if routed is not None:
                        self._one(source, mapping, index, numel, routed, progress, ahead)
                continue
            if whole is not None:
                self._run(source, mapping, first, stop, code, numel, whole, progress)
                continue
            start = first
            routes = [self._route(name, label, routing) for name in table.names[first:stop]]
            for routed, stretch in itertools.groupby(routes):
                end = start + sum(1 for _ in stretch)
                if routed is not None:
                    self._run(source, mapping, start, end, code, numel, routed, progress)
                start = end

    def _route(self, name: str, path: str, routing: Routing | None) -> str | None:
        """The label of ``name``, or ``None`` once it is skipped as its route says."""
        if routing is None:
            return path
        routed = routing.route(name)
        if isinstance(routed, Skipped):
            self.skip(routed)
            return None
        return routed

    def _run(
        self,
        source: MappedSafetensors,
        mapping: object,
        first: int,
        stop: int,
        code: int,
        numel: np.ndarray,
        label: str,
        progress: Callable[[int], None] | None,
    ) -> None:
        """Queue the tensors ``first:stop`` of one dtype the kernel takes, as one run."""
        table = source.header.tensors
        pointers, counts, ranks, dims = source.run_columns(first, stop, numel)
        nbytes = int(numel[first:stop].sum()) * int(SIZES_BY_CODE[code])
        kernel = int(self._kernel_codes[code])
        kinds = array.array("i", [kernel]) * (stop - first)
        self._tickets += self._rows.add(pointers, counts, kinds, nbytes, mapping)
        dtype = TORCH_NAMES[DTYPE_NAMES[code]]
        self.add_columns(table.names[first:stop], ranks, dims, dtype, label)
        if progress is not None:
            progress(int(table.ends[stop - 1] - table.begins[first]))

    def _one(
        self,
        source: MappedSafetensors,
        mapping: object,
        index: int,
        numel: np.ndarray,
        label: str,
        progress: Callable[[int], None] | None,
        ahead: ReadAhead,
    ) -> None:
        """Queue one tensor, or skip it as torch would (an integer or boolean dtype)."""
        table = source.header.tensors
        name = table.names[index]
        code = table.codes[index]
        kernel = int(self._kernel_codes[code])
        dtype = TORCH_NAMES[DTYPE_NAMES[code]]
        if kernel < 0:
            self.skip(Skipped(name, skip_reason(dtype, floating=False), label, False))
            return
        ahead.next_after(index)
        begin = int(table.begins[index])
        nbytes = int(table.ends[index]) - begin
        offset = source.data_start + begin
        count = int(numel[index])
        keep: object = mapping
        if nbytes == 0:
            pointer = 0
        elif offset % int(SIZES_BY_CODE[code]):
            # The format does not promise aligned tensors; a copy of this one is.
            copy = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset).copy()  # type: ignore[call-overload]
            pointer, keep = int(copy.ctypes.data), copy
        else:
            pointer = source.address + offset
        self._tickets.append(self._rows.add_one(pointer, count, kernel, nbytes, keep))
        start, stop = int(table.starts[index]), int(table.starts[index + 1])
        self.add_columns([name], [stop - start], table.dims[start:stop].tolist(), dtype, label)
        if progress is not None:
            progress(nbytes)

    def materialize(self, thresholds: Thresholds | None = None) -> Report:
        """The report of the rows collected (they are on the host already), with each
        tensor's exponent histogram when the scan counts them."""
        histograms = self._rows.exponent_histograms(self._tickets) if self._rows.histograms else ()
        return self.report(
            self._rows.rows(self._tickets),
            thresholds,
            device="cpu",
            engine=Engine.NATIVE.value,
            histograms=histograms,
        )


def _open_checkpoint(path: str) -> MappedZipCheckpoint:
    """The reader of one zip checkpoint, after the checks ``TorchPickleSource`` makes."""
    archive, identity = _checkpoint_container(path)
    return MappedZipCheckpoint(path, archive, identity)


def _checkpoint_container(path: str) -> tuple[TorchZip, FileIdentity | None]:
    """The checks ``TorchPickleSource`` makes before torch reads anything, in its order
    (the same functions: the same refusals); a file that is not a zip checkpoint is left
    to it (:class:`NotTorchFree`)."""
    try:
        identity: FileIdentity | None = FileIdentity.of(os.stat(path))
    except OSError:
        identity = None  # sniff() says why it cannot be read
    if sniff(path).kind != "zip":
        raise NotTorchFree("not a zip checkpoint")
    return inspect_torch_zip(path), identity


def check_checkpoint(path: str) -> None:
    """What opening a ``torch.save`` file's reader checks (``open_source``), without
    reading its pickle: ``trend`` orders its dumps by name after these checks, as the
    torch path does. Raises :class:`NeedsTorch` for a file that is not a zip checkpoint
    (a legacy one, or not a checkpoint at all: the torch path says what it is)."""
    try:
        _checkpoint_container(path)
    except NotTorchFree as error:
        raise NeedsTorch(path) from error


def _in_shard(path: str, shard: str | None) -> AbstractContextManager[None]:
    return nullcontext() if shard is None else in_shard(path, shard)


def scan_torch_free(
    entries: Iterable[Expanded],
    *,
    thresholds: Thresholds | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    progress: Callable[[int], None] | None = None,
    histograms: bool = False,
) -> Report:
    """:func:`~gradaudit.scan.paths.scan_paths` of expanded inputs that :func:`takes`, without
    torch; raises :class:`NeedsTorch` when a file needs the torch path after all.
    ``histograms`` (``--precision``) also collects each tensor's exponent histogram, counted
    by the native kernel in the same read as its row (``scan_paths``' ``histograms``)."""
    selection = NameFilter(tuple(include), tuple(exclude))
    scan = NativeScan(histograms=histograms)
    for entry in entries:
        scan.add_input(entry, selection if selection.active else None, progress)
    return scan.materialize(thresholds)
