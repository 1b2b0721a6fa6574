"""The native kernel's host side, without torch: loading it, its dtype codes, its batch,
its thread count, and rows written into numpy.

:mod:`gradaudit.engine.native` (torch tensors in) and the torch-free scan
(:mod:`gradaudit.scan.torch_free`: a memory-mapped file's addresses in) both hand the
kernel a :class:`NativeBatch` of addresses, and the batch decides when a call is made.
Where a tensor falls in a call decides which thread reads which of its bytes, and so
the order in which its sum of squares is added: the same batches and the same thread
count are what make both paths' numbers equal to the last bit.
"""

from __future__ import annotations

import array
import os
import re
import sys
from types import ModuleType

import numpy as np

from gradaudit.precision.formats import layout
from gradaudit.results.row import ROW_WIDTH

#: The ABI this module speaks; a stale build of the extension (an older
#: checkout's ``.so``) is ignored rather than trusted.
ABI = 6

#: Tensors handed to the native kernel in one call, at most (count, and bytes once
#: exceeded). One call splits its bytes between threads, so batching large tensors
#: too saves a thread launch per tensor; the batch only holds references.
NATIVE_BATCH_TENSORS = 2048
NATIVE_BATCH_BYTES = 64 * 1024 * 1024
#: Tensors up to this many elements are bucketed rather than reduced one by one; a strided
#: one is copied contiguous for the native kernel (the torch-free scan copies the same ones).
BUCKET_MAX_ELEMENTS = 1 << 16


def _load() -> ModuleType | None:
    try:
        from gradaudit.engine import _native  # type: ignore[attr-defined]  # optional build
    except ImportError:
        return None
    if getattr(_native, "ABI", None) != ABI:
        return None
    module: ModuleType = _native
    return module


_module = _load()

#: The kernel's dtypes by the name every output spells them with (torch's name less
#: ``torch.``), and the extension's attribute holding each one's code.
_CODE_ATTRIBUTES = {
    "float32": "F32",
    "float64": "F64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "E4M3",
    "float8_e5m2": "E5M2",
}


def module() -> ModuleType | None:
    """The loaded extension, or ``None`` (not built, or a stale build)."""
    return _module


def available() -> bool:
    """Whether the extension was built and loads."""
    return _module is not None


def codes_by_name() -> dict[str, int]:
    """Dtype name -> the extension's code, for every dtype it takes; empty when not built."""
    if _module is None:
        return {}
    return {name: int(getattr(_module, attribute)) for name, attribute in _CODE_ATTRIBUTES.items()}


def rows_of_pointers(
    pointers: array.array[int], counts: array.array[int], codes: array.array[int], threads: int
) -> np.ndarray:
    """Stats rows ``[len(pointers), 7]`` (float64) of the data at ``pointers``: one call.

    The caller keeps the bytes alive and unchanged until this returns.
    """
    if _module is None:
        raise ValueError("the native kernel is not built")
    rows = np.empty((len(pointers), ROW_WIDTH), dtype=np.float64)
    _module.stats_batch(pointers, counts, codes, rows.ctypes.data, threads)
    return rows


def histogram_bins() -> int:
    """Hand the exponent histogram's layout to the kernel (once); its number of bins.

    The layout has one definition, :func:`gradaudit.precision.layout`; the kernel builds
    its tables from it rather than keeping a copy that could drift.
    """
    if _module is None:
        raise ValueError("the native kernel is not built")
    bins: int = _module.set_layout(array.array("I", layout().boundaries).tobytes())
    return bins


def rows_and_histograms(
    pointers: array.array[int], counts: array.array[int], codes: array.array[int], threads: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`rows_of_pointers` and each tensor's exponent histogram, from the same read.

    The histograms are ``[len(pointers), bins]`` int64 counts per bin of
    :func:`gradaudit.precision.layout`, exact (the same as
    :func:`gradaudit.engine.histogram.exponent_histogram`).
    """
    bins = histogram_bins()
    rows = np.empty((len(pointers), ROW_WIDTH), dtype=np.float64)
    histograms = np.empty((len(pointers), bins), dtype=np.int64)
    assert _module is not None
    _module.stats_batch(pointers, counts, codes, rows.ctypes.data, threads, histograms.ctypes.data)
    return rows, histograms


class NativeBatch:
    """Data waiting for one native call, as columns: address, element count, dtype code.

    :meth:`add` says when the batch is full (:data:`NATIVE_BATCH_TENSORS` tensors, or
    :data:`NATIVE_BATCH_BYTES` once exceeded); the owner then calls :meth:`reduce`.
    ``keep`` holds whatever owns the bytes until then.
    """

    def __init__(self) -> None:
        self.keep: list[object] = []
        self.tickets: list[int] = []
        self.pointers = array.array("Q")
        self.counts = array.array("Q")
        self.codes = array.array("i")
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.tickets)

    def add(
        self,
        tickets: range | list[int],
        pointers: array.array[int],
        counts: array.array[int],
        codes: array.array[int],
        nbytes: int,
        keep: object,
    ) -> bool:
        """Join the batch; whether it is now full."""
        self.keep.append(keep)
        self.tickets += tickets
        self.pointers += pointers
        self.counts += counts
        self.codes += codes
        self.nbytes += nbytes
        return self.full()

    def add_one(
        self, ticket: int, pointer: int, count: int, code: int, nbytes: int, keep: object
    ) -> bool:
        """:meth:`add` for one tensor, without making columns for it."""
        self.keep.append(keep)
        self.tickets.append(ticket)
        self.pointers.append(pointer)
        self.counts.append(count)
        self.codes.append(code)
        self.nbytes += nbytes
        return self.full()

    def full(self) -> bool:
        return len(self.tickets) >= NATIVE_BATCH_TENSORS or self.nbytes >= NATIVE_BATCH_BYTES

    def reduce(self, threads: int) -> np.ndarray:
        """The rows of the batch, in one call (see :func:`rows_of_pointers`)."""
        return rows_of_pointers(self.pointers, self.counts, self.codes, threads)

    def reduce_with_histograms(self, threads: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows and the exponent histograms of the batch, in one call (one read)."""
        return rows_and_histograms(self.pointers, self.counts, self.codes, threads)


def native_threads() -> int:
    """Threads the native kernel splits a call's bytes between: torch's intra-op count.

    With torch imported, its ``get_num_threads()`` (which honours ``torch.set_num_threads``).
    Without torch, the count torch would start with (:func:`torch_default_threads`), so a
    torch-free scan splits its calls as ``gradaudit scan`` with torch would.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        return max(1, int(torch.get_num_threads()))
    return torch_default_threads()


#: ``OMP_NUM_THREADS`` as libgomp parses it: a positive number, or a list whose first entry
#: counts; anything else ("1x", "1e1", "0") is ignored, as torch's OpenMP ignores it.
_OMP_VALUE = re.compile(r"\s*\+?(\d+)\s*(?:,.*)?", re.S)
#: ``MKL_NUM_THREADS`` as MKL reads it: its leading digits ("1x" is 1).
_MKL_VALUE = re.compile(r"\s*\+?(\d+)")


def torch_default_threads() -> int:
    """The intra-op thread count torch starts with, worked out without importing it.

    As torch 2.13 does (measured on a 2-core machine, under ``taskset`` too):
    ``MKL_NUM_THREADS`` (its leading digits), else a valid ``OMP_NUM_THREADS``, each at most
    the machine's physical cores; without either (or with an invalid ``OMP_NUM_THREADS``,
    which OpenMP ignores), the CPUs this process may run on (``sched_getaffinity``: a
    ``taskset -c 0`` run gets 1), at most the physical cores (``cpuinfo``'s count: distinct
    package and core ids in ``/sys/devices/system/cpu``, else ``os.cpu_count()``).
    """
    cores = _physical_cores() or os.cpu_count() or 1
    for variable, pattern in (("MKL_NUM_THREADS", _MKL_VALUE), ("OMP_NUM_THREADS", _OMP_VALUE)):
        value = os.environ.get(variable, "")
        match = pattern.match(value) if pattern is _MKL_VALUE else pattern.fullmatch(value)
        if match is not None and int(match.group(1)) > 0:
            return min(int(match.group(1)), cores)
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux: no affinity to honour
        allowed = cores
    return max(1, min(allowed, cores))


def _physical_cores() -> int:
    root = "/sys/devices/system/cpu"
    cores: set[tuple[str, str]] = set()
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        if not re.fullmatch(r"cpu\d+", name):
            continue
        topology = os.path.join(root, name, "topology")
        try:
            with open(os.path.join(topology, "physical_package_id")) as package:
                package_id = package.read().strip()
            with open(os.path.join(topology, "core_id")) as core:
                core_id = core.read().strip()
        except OSError:
            continue  # offline, or no topology: not counted
        cores.add((package_id, core_id))
    return len(cores)
