"""``torch.distributed.checkpoint`` directories (``.metadata`` + ``*.distcp``), read alone.

FSDP2, torchtitan and ``dcp.save`` write a directory: one pickled ``.metadata`` that
lists every tensor of the state dict by its fully qualified name (``model.layers.0.w``,
``optim.state.layers.0.w.exp_avg``), its global shape and the *chunks* it was saved in
(one per rank holding a shard), and ``__R_K.distcp`` files holding each chunk as a
``torch.save`` record at a byte offset. This reader needs no process group and never
assembles a tensor: each chunk is loaded on its own, reduced to a stats row, and the rows
merge with the engine's rule (:meth:`gradaudit.scan.pending.PendingStats.add_pieces`). Memory is
bounded by the largest chunk, not the largest tensor or the state dict.

Safety, in the order it is checked:

* ``.metadata`` is a plain pickle (torch itself reads it with ``pickle.load``). It is read
  here by an unpickler that knows an explicit list of globals, the metadata classes of
  ``torch.distributed.checkpoint`` and a few values (dtypes, ``torch.Size``, paths), and
  maps each to an inert stand-in defined here: nothing from torch's checkpoint classes,
  and nothing the file names, is imported or called. Any other global is refused, named
  (:mod:`gradaudit.io.dcp_metadata`).
* every storage entry is validated before a byte of data is read: a relative file name
  inside the directory (no absolute path, no ``..``), a regular file, and a byte range
  inside it; each tensor's chunks lie inside its shape and their volumes add up to it.
* each chunk is a ``torch.save`` archive at a byte range; it passes the guards of a ``.pt``
  file (:func:`load_chunk`: container and CRCs, the pickle budget, no expanded view), is
  loaded with ``torch.load(weights_only=True)`` and must be a plain tensor of the recorded
  dtype and chunk shape.

Values saved as bytes (``step``, ``param_groups`` entries) are listed as skipped, and so
is an optimizer's per-parameter ``step`` counter, as for nested ``torch.save`` checkpoints.
Chunks written through storage extensions (compression: ``transform_descriptors``) are
skipped with that reason rather than decoded.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gradaudit.errors import InputError
from gradaudit.io.base import Excluded, Pieces, Select, SourceItem
from gradaudit.io.dcp_metadata import Record, read_metadata
from gradaudit.io.files import FileRange, describe_os_error, open_checked, show
from gradaudit.io.layouts import DATA_SUFFIX as DATA_SUFFIX
from gradaudit.io.layouts import METADATA_NAME as METADATA_NAME
from gradaudit.io.layouts import is_dcp_directory as is_dcp_directory
from gradaudit.io.nested import expanded_view
from gradaudit.io.torch_zip import data_pickle_problem, inspect_torch_zip
from gradaudit.policy import Role
from gradaudit.results import Skipped
from gradaudit.results.roles import TensorHint
from gradaudit.roles import OPTIMIZER_STATE_ROLES, container_hint

#: No tensor holds this many elements (torch's sizes are signed 64-bit).
_MAX_ELEMENTS = 2**63


def _refuse(path: str, cause: str) -> InputError:
    return InputError(path, cause)


@dataclass(frozen=True)
class Chunk:
    """Where one saved chunk of a tensor lies: in the tensor, and in its data file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class DcpTensor:
    """One tensor of the checkpoint, by FQN, with its chunks (already validated)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]
    #: The state-dict path the planner recorded (``("optim", "state", "w", "exp_avg")``),
    #: so roles can be told from the structure; ``()`` when the checkpoint has none.
    path: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _ints(value: object) -> tuple[int, ...] | None:
    if isinstance(value, list | tuple) and all(type(v) is int for v in value):
        return tuple(value)
    return None


def _check_file_name(directory: str, name: object) -> str:
    if not isinstance(name, str) or not name or "\0" in name:
        raise _refuse(directory, f"metadata names an invalid data file {show(str(name))}")
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        raise _refuse(directory, f"metadata names data file {show(name)} by an absolute path")
    if ".." in name.replace("\\", "/").split("/"):
        raise _refuse(directory, f"metadata names data file {show(name)}, outside the directory")
    return name


def _tiles(shape: tuple[int, ...], chunks: list[Chunk]) -> bool:
    """Whether the chunks lie inside ``shape`` and cover it without overlap."""
    for chunk in chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
            return False
        if any(
            o < 0 or s < 0 or o + s > n
            for o, s, n in zip(chunk.offsets, chunk.sizes, shape, strict=True)
        ):
            return False
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(shape):
        return False
    if len(chunks) > 512:  # pairwise check too costly; volumes and bounds already agree
        return True
    for i, a in enumerate(chunks):
        for b in chunks[i + 1 :]:
            if (
                math.prod(a.sizes)
                and math.prod(b.sizes)
                and all(
                    ao < bo + bs and bo < ao + as_
                    for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
                )
            ):
                return False
    return True


def _storage_map(directory: str, metadata: Any) -> dict[tuple[str, tuple[int, ...]], Chunk]:
    storage = metadata.get("storage_data")
    if not isinstance(storage, dict):
        raise _refuse(directory, "metadata has no storage map (not written by FileSystemWriter?)")
    sizes: dict[str, int] = {}
    found: dict[tuple[str, tuple[int, ...]], Chunk] = {}
    for index, info in storage.items():
        if not isinstance(index, Record) or not isinstance(info, Record):
            raise _refuse(directory, "metadata's storage map is malformed")
        fqn, offset = index.get("fqn"), index.get("offset")
        key_offset = () if offset is None else _ints(offset)
        name = _check_file_name(directory, info.get("relative_path"))
        start, length = info.get("offset"), info.get("length")
        if not isinstance(fqn, str) or key_offset is None:
            raise _refuse(directory, "metadata's storage map has a malformed entry")
        if type(start) is not int or type(length) is not int or start < 0 or length < 0:
            raise _refuse(directory, f"metadata gives {show(fqn)} an invalid byte range")
        if name not in sizes:
            sizes[name] = _data_file_size(directory, name)
        if start + length > sizes[name]:
            raise _refuse(
                directory,
                f"metadata places {show(fqn)} at bytes {start}..{start + length} of "
                f"{show(name)}, which has {sizes[name]} bytes (truncated?)",
            )
        transforms = info.get("transform_descriptors") or ()
        if not isinstance(transforms, list | tuple) or not all(
            isinstance(t, str) for t in transforms
        ):
            raise _refuse(
                directory, f"metadata gives {show(fqn)} transform_descriptors that are not names"
            )
        found[(fqn, key_offset)] = Chunk((), (), name, start, length, tuple(transforms))
    return found


def _data_file_size(directory: str, name: str) -> int:
    path = os.path.join(directory, name)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise _refuse(directory, f"data file {show(name)} is missing") from None
    except OSError as error:
        raise _refuse(directory, f"data file {show(name)}: {describe_os_error(error)}") from None
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(directory, f"data file {show(name)} is not a regular file")
    return info.st_size


def plan_checkpoint(directory: str) -> tuple[list[DcpTensor | Skipped], dict[str, str]]:
    """Every entry of the checkpoint, validated, in the metadata's order; nothing loaded.

    Returns the tensors (and the non-tensor entries as :class:`Skipped`) and the data files
    by name with their paths.
    """
    metadata = read_metadata(directory)
    entries = metadata.get("state_dict_metadata")
    if not isinstance(entries, dict):
        raise _refuse(directory, "metadata lists no state dict")
    storage = _storage_map(directory, metadata)
    planner = metadata.get("planner_data")
    paths = planner if isinstance(planner, dict) else {}
    plan: list[DcpTensor | Skipped] = []
    for fqn, entry in entries.items():
        if not isinstance(fqn, str) or not isinstance(entry, Record):
            raise _refuse(directory, "metadata's state dict is malformed")
        kind = type(entry).__name__
        if kind == "BytesStorageMetadata":
            plan.append(Skipped(fqn, "saved as bytes (not a tensor); not audited", directory))
            continue
        if kind != "TensorStorageMetadata":
            raise _refuse(directory, f"metadata entry {show(fqn)} is of unknown kind {kind}")
        plan.append(_tensor(directory, fqn, entry, storage, paths.get(fqn)))
    files = {c.file: os.path.join(directory, c.file) for c in storage.values()}
    return plan, files


def _tensor(
    directory: str,
    fqn: str,
    entry: Record,
    storage: dict[tuple[str, tuple[int, ...]], Chunk],
    path: object,
) -> DcpTensor:
    properties = entry.get("properties")
    dtype = properties.get("dtype") if isinstance(properties, Record) else None
    if dtype is None and isinstance(properties, Record):  # pickled by TensorProperties' state
        state = properties.get("_state")
        dtype = state[0] if isinstance(state, tuple) and state else None
    shape = _ints(entry.get("size"))
    raw_chunks = entry.get("chunks")
    if not isinstance(dtype, torch.dtype) or shape is None or not isinstance(raw_chunks, list):
        raise _refuse(directory, f"metadata entry {show(fqn)} is malformed")
    if any(not 0 <= n < _MAX_ELEMENTS for n in shape) or math.prod(shape) >= _MAX_ELEMENTS:
        raise _refuse(
            directory,
            f"metadata gives {show(fqn)} the shape {show(str(list(shape)), limit=60)}: "
            "dimensions must be >= 0 and hold fewer than 2**63 elements",
        )
    chunks = []
    for raw in raw_chunks:
        offsets = _ints(raw.get("offsets")) if isinstance(raw, Record) else None
        sizes = _ints(raw.get("sizes")) if isinstance(raw, Record) else None
        if offsets is None or sizes is None:
            raise _refuse(directory, f"metadata entry {show(fqn)} has a malformed chunk")
        where = storage.get((fqn, offsets))
        if where is None:
            raise _refuse(directory, f"no data stored for {show(fqn)} at offset {list(offsets)}")
        chunks.append(
            Chunk(offsets, sizes, where.file, where.start, where.length, where.transforms)
        )
    if not _tiles(shape, chunks):
        raise _refuse(
            directory, f"the chunks of {show(fqn)} do not tile its shape {list(shape)} exactly"
        )
    structure = tuple(str(p) for p in path) if isinstance(path, list | tuple) else ()
    return DcpTensor(fqn, shape, dtype, tuple(chunks), structure)


def _is_step_counter(tensor: DcpTensor) -> bool:
    """An optimizer's per-parameter ``step`` (``optim.state.<param>.step``, 0-d)."""
    parts = tensor.path or tuple(tensor.name.split("."))
    return tensor.shape == () and parts[-1] == "step" and "state" in parts[:-1]


def load_chunk(directory: str, tensor: DcpTensor, chunk: Chunk) -> torch.Tensor:
    """One chunk's values on the CPU, checked against the metadata; raises InputError.

    A chunk is a ``torch.save`` archive inside a ``.distcp`` file, so it passes the
    guards a ``.pt`` file does, in the same order: the container and its CRCs, the
    pickle budget of its ``data.pkl`` (a memory bomb is refused unread), the weights-only
    load, and no expanded view. The storage-size check of a ``.pt`` needs no second
    implementation here: loading from a stream (not a map), torch itself refuses a
    storage whose record holds other than the bytes ``data.pkl`` declares.
    """
    path = os.path.join(directory, chunk.file)
    where = f"{show(tensor.name)} (chunk at {list(chunk.offsets)} in {show(chunk.file)})"
    try:
        problem = data_pickle_problem(inspect_torch_zip(path, chunk.start, chunk.length))
    except InputError as error:
        raise _refuse(directory, f"{where}: {error.cause}") from None
    if problem is not None:
        raise _refuse(directory, f"{where}: {problem}")
    handle, _ = open_checked(path)
    with handle:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                value = torch.load(
                    io.BufferedReader(FileRange(handle, chunk.start, chunk.length)),
                    map_location="cpu",
                    weights_only=True,
                )
        except pickle.UnpicklingError:
            raise _refuse(directory, f"{where}: refused by the weights-only loader") from None
        except Exception as error:  # noqa: BLE001 - torch.load's failures on corrupt bytes are many
            detail = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
            raise _refuse(
                directory, f"{where} cannot be loaded ({type(error).__name__}: {detail})"
            ) from None
    if type(value) is not torch.Tensor:
        raise _refuse(directory, f"{where} holds a {type(value).__name__}, not a plain tensor")
    if value.dtype != tensor.dtype or tuple(value.shape) != chunk.sizes:
        raise _refuse(
            directory,
            f"{where} holds {str(value.dtype).removeprefix('torch.')} {list(value.shape)}, "
            f"the metadata says {str(tensor.dtype).removeprefix('torch.')} {list(chunk.sizes)}",
        )
    expanded = expanded_view(value)
    if expanded is not None:
        raise _refuse(directory, f"{where} holds {expanded}; refused unread")
    return value


#: Containers ``torch.distributed.checkpoint.state_dict.get_state_dict`` and the common
#: training loops put an optimizer's state dict under.
OPTIMIZER_CONTAINERS = frozenset({"optim", "optimizer", "optimizers", "optim_state", "opt"})


def dcp_role_hints(names: list[str]) -> dict[str, TensorHint]:
    """What the tensor paths of a DCP checkpoint say each tensor is.

    ``get_state_dict`` saves ``{"model": …, "optim": {"state": {fqn: {"exp_avg": …}}}}``,
    flattened to ``optim.state.<fqn>.exp_avg``: the moments are optimizer state of the
    parameter ``<fqn>``, and the rest (``model.…``, or anything beside optimizer state) the
    model's weights. Without this the moments were judged as weights.
    """
    hints: dict[str, TensorHint] = {}
    optimizer = False
    for name in names:
        parts = name.split(".")
        key = parts[-1]
        if (
            len(parts) >= 4
            and parts[0].lower() in OPTIMIZER_CONTAINERS
            and parts[1] == "state"
            and key in OPTIMIZER_STATE_ROLES
        ):
            param = ".".join(parts[2:-1])
            evidence = f"optimizer state in a DCP checkpoint, key {key!r}"
            hints[name] = TensorHint(OPTIMIZER_STATE_ROLES[key], evidence, param)
            optimizer = True
    for name in names:
        if name in hints:
            continue
        hint = container_hint(name)
        if hint is None and optimizer:
            hint = TensorHint(Role.WEIGHT, "beside optimizer state (a training checkpoint's model)")
        if hint is not None:
            hints[name] = hint
    return hints


class DcpSource:
    """A ``torch.distributed.checkpoint`` directory, validated whole, read chunk by chunk."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.plan, self.files = plan_checkpoint(path)
        #: What each tensor is, from its path (:func:`dcp_role_hints`).
        self.role_hints = dcp_role_hints([entry.name for entry in self.tensors])

    @property
    def tensors(self) -> list[DcpTensor]:
        return [entry for entry in self.plan if isinstance(entry, DcpTensor)]

    def check_unchanged(self) -> None:
        """Nothing to compare: chunks are read through bounded reads, not memory maps.

        A file that shrinks makes a read come up short, which is already an input
        error; the plan was validated against each file's size up front.
        """

    def items(self, select: Select | None = None) -> Iterator[SourceItem]:
        for entry in self.plan:
            if select is not None and not select(entry.name):
                yield Excluded(entry.name)
            elif isinstance(entry, Skipped):
                yield entry
            else:
                yield from self.tensor_items(entry)

    def skipped(self, tensor: DcpTensor) -> Skipped | None:
        """``tensor`` as skipped instead of read, or None (its dtype is left to the engine).

        Chunks behind storage extensions are floating-point values nobody read, so they
        are ``unaudited`` (a NaN there would go unseen); a step counter is a count.
        """
        if _is_step_counter(tensor):
            return Skipped(tensor.name, "optimizer step counter; not audited", self.path)
        transformed = next((c for c in tensor.chunks if c.transforms), None)
        if transformed is not None:
            reason = f"stored through storage extensions {list(transformed.transforms)}; not read"
            unaudited = tensor.dtype.is_floating_point or tensor.dtype.is_complex
            return Skipped(tensor.name, reason, self.path, unaudited)
        return None

    def tensor_items(self, tensor: DcpTensor) -> Iterator[SourceItem]:
        """What one tensor yields: skipped, one whole tensor, or its chunks as pieces."""
        skipped = self.skipped(tensor)
        if skipped is not None:
            yield skipped
            return
        if len(tensor.chunks) == 1:
            yield tensor.name, load_chunk(self.path, tensor, tensor.chunks[0])
            return

        def load(chunks: tuple[Chunk, ...] = tensor.chunks) -> Iterator[torch.Tensor]:
            for chunk in chunks:
                yield load_chunk(self.path, tensor, chunk)

        yield Pieces(tensor.name, tensor.shape, tensor.dtype, load)
