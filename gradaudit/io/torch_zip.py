"""Check a PyTorch zip checkpoint's container before torch reads a byte of it.

``torch.load`` trusts the zip: PyTorch builds its zip reader without CRC checks, and with
``mmap=True`` it maps tensor bytes straight from the file, so a flipped bit in a tensor
loads silently as a wrong value, and a storage that claims more bytes than its zip member
holds reads into the next member. Auditing those values would be auditing noise. So,
before anything is unpickled:

* the archive must parse, hold no duplicate member names, no compressed or encrypted
  member (torch reads tensor members raw: a compressed one would be garbage), and every
  member's local header must agree with the central directory and end inside the file;
* a TorchScript archive (``torch.jit.save``) is named as such: it is a program, not a
  state dict;
* every member's CRC-32 is verified, reading the file through a read-only memory map, in a
  few threads (``zlib.crc32`` releases the GIL), at about the speed of one read of the file;
* ``data.pkl`` must fit the pickle budget (:func:`data_pickle_problem`,
  :mod:`gradaudit.io.pickle_budget`);
* after loading, :func:`check_storages` verifies that each tensor storage lies exactly on
  its zip member.

The archive may be a whole file (a ``.pt``) or a byte range of one (a chunk of a DCP
``.distcp`` file, which holds one ``torch.save`` archive per chunk): the same checks
serve both.

Nothing here writes to the file, locks it or keeps it open, and only :func:`check_storages`
needs torch: the torch-free scan (:mod:`gradaudit.io.zip_checkpoint`) checks containers
with the same code.
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from io import BufferedReader
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from gradaudit.errors import InputError
from gradaudit.io.files import FileRange, describe_os_error, open_checked, read_at, show
from gradaudit.io.mapguard import CHANGED_SIZE, MapGuard
from gradaudit.io.pickle_budget import budget_problem

if TYPE_CHECKING:
    import torch

#: CRC-32 is computed over slices of this many bytes (a view into the map, never a copy).
CRC_CHUNK_BYTES = 64 << 20
#: Below this total size the CRCs are computed in the calling thread.
_THREADS_FROM_BYTES = 64 << 20
_MAX_THREADS = 8
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"
_UTF8_NAME_FLAG = 0x800
_METHODS = {
    zipfile.ZIP_DEFLATED: "deflate",
    zipfile.ZIP_BZIP2: "bzip2",
    zipfile.ZIP_LZMA: "lzma",
}


@dataclass(frozen=True)
class Member:
    """One zip member: where its bytes are in the file and what they should hash to."""

    name: str
    offset: int
    size: int
    crc: int


@dataclass(frozen=True)
class TorchZip:
    """A PyTorch zip checkpoint whose container passed every check."""

    path: str
    #: The archive folder every record lives in (``torch.save`` uses the file's stem).
    prefix: str
    #: Members by name relative to ``prefix`` (``"data.pkl"``, ``"data/0"``, ...); their
    #: offsets count from ``start``.
    records: dict[str, Member] = field(hash=False)
    #: Where the archive starts in the file (0 but for a DCP chunk).
    start: int = 0


def _describe_bad_zip(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text == "File is not a zip file":
        return "zip archive is truncated or corrupt (its central directory is missing)"
    return f"corrupt zip archive ({text})"


def _infos(path: str, handle: BinaryIO) -> list[zipfile.ZipInfo]:
    try:
        with zipfile.ZipFile(handle) as archive:
            return list(archive.infolist())
    except OSError as error:
        raise InputError(path, describe_os_error(error)) from None
    except Exception as error:  # noqa: BLE001 - zipfile's failures on hostile bytes are many
        raise InputError(path, _describe_bad_zip(error)) from None


def _prefix(path: str, infos: list[zipfile.ZipInfo]) -> str:
    """The archive folder, found the way PyTorch's reader finds it: the first member's."""
    if not infos:
        raise InputError(path, "zip archive is empty: not a PyTorch checkpoint")
    first = infos[0].filename
    if "/" not in first:
        raise InputError(path, "a zip archive, but not a PyTorch checkpoint (no data.pkl)")
    return first.split("/", 1)[0]


def _locate(path: str, view: memoryview, info: zipfile.ZipInfo) -> Member:
    """Find a member's data from its local header, checked against the central directory."""
    name = show(info.filename)
    start = info.header_offset
    if start < 0:  # zipfile adds a damaged directory's offsets up into a negative one
        raise InputError(path, f"corrupt zip archive: member {name} has a damaged offset")
    if start + _LOCAL_HEADER.size > len(view):
        raise InputError(path, f"zip member {name} runs past the end of the file (truncated?)")
    fields = _LOCAL_HEADER.unpack_from(view, start)
    signature, flags, name_length, extra_length = fields[0], fields[2], fields[9], fields[10]
    raw_name = bytes(view[start + 30 : start + 30 + name_length])
    encoding = "utf-8" if flags & _UTF8_NAME_FLAG else "cp437"
    try:
        local_name = raw_name.decode(encoding)
    except UnicodeDecodeError:
        local_name = None
    if signature != _LOCAL_SIGNATURE or local_name != info.orig_filename:
        raise InputError(path, f"corrupt zip archive: member {name} has a damaged local header")
    offset = start + 30 + name_length + extra_length
    if offset + info.compress_size > len(view):
        raise InputError(path, f"zip member {name} runs past the end of the file (truncated?)")
    return Member(info.filename, offset, info.file_size, info.CRC)


def _check_member_kinds(path: str, infos: list[zipfile.ZipInfo]) -> None:
    duplicates = [name for name, n in Counter(i.filename for i in infos).items() if n > 1]
    if duplicates:
        raise InputError(
            path,
            f"corrupt zip archive: member {show(duplicates[0])} appears more than once "
            "(readers disagree on which copy counts)",
        )
    for info in infos:
        if info.flag_bits & 0x1:
            raise InputError(path, f"zip member {show(info.filename)} is encrypted")
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            method = _METHODS.get(info.compress_type, f"method {info.compress_type}")
            raise InputError(
                path,
                f"zip member {show(info.filename)} is compressed ({method}): PyTorch reads "
                "checkpoint members raw, so its tensors would be garbage (re-zipped by a tool?)",
            )


def _crc(view: memoryview, member: Member) -> int:
    crc = 0
    end = member.offset + member.size
    for start in range(member.offset, end, CRC_CHUNK_BYTES):
        crc = zlib.crc32(view[start : min(end, start + CRC_CHUNK_BYTES)], crc)
    return crc


def _verify_crcs(path: str, view: memoryview, members: list[Member]) -> None:
    """Compare every member's CRC-32 with the archive's, biggest members first, in threads."""
    members = sorted(members, key=lambda m: m.size, reverse=True)
    total = sum(m.size for m in members)
    threads = min(_MAX_THREADS, os.cpu_count() or 1, len(members))
    with memoryview(view) as data:
        if total < _THREADS_FROM_BYTES or threads < 2:
            crcs = [_crc(data, m) for m in members]
        else:
            # Start-up: a small checkpoint (a torch-free `scan small.pt`) needs no threads.
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=threads) as pool:
                crcs = list(pool.map(lambda m: _crc(data, m), members))
    for member, crc in zip(members, crcs, strict=True):
        if crc != member.crc:
            raise InputError(
                path,
                f"zip member {show(member.name)} fails its CRC-32 check: the file is corrupt "
                "(PyTorch would load it without noticing, with wrong values)",
            )


def _address(view: mmap.mmap) -> int:
    """The address of a (read-only) map, without keeping a buffer export open."""
    if not len(view):
        return 0
    address: int = np.frombuffer(view, dtype=np.uint8, count=1).ctypes.data
    return address


def inspect_torch_zip(path: str, start: int = 0, length: int | None = None) -> TorchZip:
    """Validate a zip checkpoint's container and every member's CRC; see the module docstring.

    The archive is the file, or its bytes ``[start, start + length)`` when a length is
    given. Raises :class:`InputError` for a container PyTorch would misread, a TorchScript
    archive, a zip that is not a PyTorch checkpoint, or any CRC mismatch.
    """
    handle, size = open_checked(path)
    end = size if length is None else start + length
    if not 0 <= start <= end <= size:
        raise InputError(path, f"bytes {start}..{end} lie past the end of the file (truncated?)")
    with handle:
        whole = length is None
        infos = _infos(
            path, handle if whole else BufferedReader(FileRange(handle, start, end - start))
        )
        prefix = _prefix(path, infos)
        names = {info.filename for info in infos}
        if f"{prefix}/constants.pkl" in names:
            raise InputError(
                path,
                "is a TorchScript archive (torch.jit.save), not a state dict: save "
                "model.state_dict() with torch.save to audit it",
            )
        if f"{prefix}/data.pkl" not in names:
            raise InputError(
                path, f"a zip archive, but not a PyTorch checkpoint (no {show(prefix)}/data.pkl)"
            )
        _check_member_kinds(path, infos)
        try:
            view = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as error:
            reason = describe_os_error(error) if isinstance(error, OSError) else str(error)
            raise InputError(path, f"cannot map the file for reading ({reason})") from None
        with view:
            guard = MapGuard(_address(view), size, owner=view)
            try:
                with memoryview(view) as mapped, mapped[start:end] as archive:
                    members = [_locate(path, archive, info) for info in infos]
                    _verify_crcs(path, archive, members)
            finally:
                guard.release()
            if guard.changed():
                raise InputError(path, CHANGED_SIZE)
    records = {m.name[len(prefix) + 1 :]: m for m in members if m.name.startswith(prefix + "/")}
    return TorchZip(path=path, prefix=prefix, records=records, start=start)


def data_pickle_problem(archive: TorchZip) -> str | None:
    """Why the archive's ``data.pkl`` must not be unpickled (the pickle budget), or None."""
    member = archive.records["data.pkl"]
    return budget_problem(read_at(archive.path, archive.start + member.offset, member.size))


def check_storages(path: str, archive: TorchZip, tensors: Iterable[torch.Tensor]) -> None:
    """Require every tensor storage of a ``map_location="meta"`` load to match its member.

    A meta load reads only ``data.pkl`` and records, on each storage, the file offset torch
    would map it from (``_checkpoint_offset``) and the size ``data.pkl`` claims. With
    ``mmap=True`` torch does not compare that size with the member's, so a hostile
    ``data.pkl`` could make a tensor read the bytes of its neighbours. If this torch does
    not record offsets, there is nothing to compare and the check is skipped.
    """
    import torch  # start-up: the container checks above serve the torch-free scan too

    by_offset = {member.offset: member for member in archive.records.values()}
    seen: set[int] = set()
    for tensor in tensors:
        if tensor.layout is not torch.strided or tensor.is_quantized:
            continue  # their storages are not reachable as one untyped storage
        storage = tensor.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        if not isinstance(offset, int) or offset in seen:
            continue
        seen.add(offset)
        nbytes = storage.nbytes()
        member = by_offset.get(offset)
        if member is None:
            raise InputError(
                path,
                f"corrupt checkpoint: a tensor's data at byte {offset} is not the start of "
                "any zip member",
            )
        if member.size != nbytes:
            raise InputError(
                path,
                f"corrupt checkpoint: zip member {show(member.name)} holds {member.size} bytes "
                f"but data.pkl declares {nbytes} for its tensor",
            )
