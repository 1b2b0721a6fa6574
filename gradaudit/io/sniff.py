"""Say what a file really is from its first bytes, whatever its name claims.

Extensions lie: a PyTorch zip renamed ``.safetensors``, a git-lfs pointer checked out as
``pytorch_model.bin``, a gzip or an HDF5 file handed to the wrong tool. The readers are
chosen by extension (so a file is never parsed as something more dangerous than its name
says), and this module supplies the "it looks like ..." part of the message when the
content does not match. Only the first bytes are read, through the same FIFO-safe open as
every reader.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from dataclasses import dataclass

from gradaudit.errors import InputError
from gradaudit.io.files import describe_os_error, open_checked
from gradaudit.io.pickle_scan import pickle_globals

#: The little-endian header length that starts a safetensors file.
SAFETENSORS_LENGTH_BYTES = 8
#: Bytes read to identify a file: enough for every signature below (tar's is at 257).
HEAD_BYTES = 512

#: A legacy (pre-zip) ``torch.save`` file starts with the pickled magic number
#: 0x1950a86a20f9469cfc6c, stored as this LONG1 argument.
_TORCH_MAGIC = b"\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"

#: Formats that are recognisable and never auditable here, by their signature.
_OTHER_FORMATS: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "a gzip-compressed file (decompress it first)"),
    (b"\x93NUMPY", "a NumPy .npy array"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras or TensorFlow weights?)"),
    (b"GGUF", "a GGUF model file (llama.cpp)"),
    (b"PK\x05\x06", "an empty zip archive"),
)

#: What each kind is called in a message ("it looks like ...").
DESCRIPTIONS = {
    "safetensors": "a safetensors file",
    "zip": "a zip archive (a PyTorch checkpoint?)",
    "torch-legacy": "a legacy PyTorch checkpoint (torch.save before the zip format)",
    "pickle": "a Python pickle",
    "git-lfs": "a git-lfs pointer",
}


@dataclass(frozen=True)
class Sniffed:
    """What a file's first bytes say it is."""

    #: ``"safetensors"``, ``"zip"``, ``"torch-legacy"``, ``"pickle"``, ``"git-lfs"``,
    #: ``"other"`` (a known non-checkpoint format, see ``description``) or ``None``.
    kind: str | None
    #: For a message: "a gzip-compressed file", "a Python pickle", ...; "" when unknown.
    description: str
    size: int


def classify_head(head: bytes, file_size: int) -> str | None:
    """Say what the first bytes of a file look like (:func:`sniff` names it; the safetensors
    validator words its refusal by it).

    A plausible safetensors prefix wins over the other signatures: a valid header length
    such as 640 starts with ``0x80 0x02``, which is also the start of a protocol-2 pickle.
    """
    if len(head) >= SAFETENSORS_LENGTH_BYTES:
        (length,) = struct.unpack("<Q", head[:SAFETENSORS_LENGTH_BYTES])
        rest = head[SAFETENSORS_LENGTH_BYTES:].lstrip(b" \t\r\n")
        if 0 < length <= file_size - SAFETENSORS_LENGTH_BYTES and rest.startswith(b"{"):
            return "safetensors-ish"
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if head.startswith(b"version https://git-lfs"):
        return "git-lfs"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    return None


def _is_text_pickle(head: bytes) -> bool:
    """Whether ``head`` parses as a protocol 0/1 pickle (no ``0x80`` marker to spot it by)."""
    if not head or head[0] not in b"(cdl}]SVINFGKJMX":
        return False
    stream = io.BytesIO(head)
    pickle_globals(stream)
    # pickle_globals stops quietly on damage; a whole pickle ends on STOP (".").
    return head[: stream.tell()].endswith(b".")


def identify(head: bytes, size: int) -> Sniffed:
    """Identify a file from its first :data:`HEAD_BYTES` bytes and its size."""
    kind = classify_head(head, size)
    if kind == "safetensors-ish":
        return Sniffed("safetensors", DESCRIPTIONS["safetensors"], size)
    if kind == "pickle":
        legacy = _TORCH_MAGIC in head[:32]
        kind = "torch-legacy" if legacy else "pickle"
    if kind is not None:
        return Sniffed(kind, DESCRIPTIONS[kind], size)
    for signature, description in _OTHER_FORMATS:
        if head.startswith(signature):
            return Sniffed("other", description, size)
    if head[257:262] == b"ustar":
        return Sniffed("other", "a tar archive", size)
    if _is_text_pickle(head):
        return Sniffed("pickle", "a Python pickle (protocol 0 or 1)", size)
    return Sniffed(None, "", size)


def describe_zip(path: str) -> str:
    """What a zip archive with an unsupported name holds, for the message that refuses it.

    "A PyTorch checkpoint?" invited renaming a TorchScript program or a zipped model
    directory to ``.pt``. The central directory (names only, nothing decompressed) says
    which it is; anything unreadable there keeps the plain description.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        return DESCRIPTIONS["zip"]
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return (
            "a TorchScript archive (torch.jit.save): a program, not a state dict; save "
            "model.state_dict() with torch.save to audit it"
        )
    if any(n.endswith("/data.pkl") for n in names):
        return "a PyTorch checkpoint (torch.save's zip format): name it .pt to audit it"
    return (
        "a zip archive that is not a PyTorch checkpoint (no data.pkl): unzip it and scan "
        "what it holds"
    )


def sniff(path: str | os.PathLike[str]) -> Sniffed:
    """Read the first bytes of ``path`` (a regular file, opened without blocking) and identify it.

    Raises :class:`InputError` when the path is not a readable, non-empty regular file.
    """
    path = os.fspath(path)
    handle, size = open_checked(path)
    with handle:
        try:
            head = handle.read(HEAD_BYTES)
        except OSError as error:
            raise InputError(path, describe_os_error(error)) from None
    return identify(head, size)
