"""PyTorch checkpoints (``.pt``, ``.pth``, ``.bin``, ``.ckpt``), loaded only the safe way.

Every load is ``torch.load(path, map_location=..., weights_only=True, mmap=...)`` with
``weights_only`` passed explicitly: ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` only flips the
default when a caller leaves it out. There is no fallback to ``weights_only=False``, and
the advice torch prints to use it is never shown: a refusal is explained by naming the
global the pickle needed (see :mod:`gradaudit.io.pickle_scan`).

Before torch reads anything:

* the first bytes must say the file is a zip checkpoint or a legacy ``torch.save`` pickle;
  anything else (a git-lfs pointer, a safetensors file, a plain pickle, gzip, HDF5 ...) is
  refused with what it looks like, and a plain pickle is never handed to torch at all;
* a zip checkpoint's container and CRCs are verified (:mod:`gradaudit.io.torch_zip`), and a
  ``map_location="meta"`` load (no tensor data) checks each storage against its member.

A zip checkpoint is then loaded with ``mmap=True`` on the CPU: tensors are views of the
file's pages, loaded lazily and moved to the audit device one at a time. The legacy
format cannot be memory-mapped and is read into memory whole. Warnings torch raises while
loading are dropped: stderr belongs to the CLI's one-line messages.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from gradaudit.errors import InputError
from gradaudit.io.base import Select, SourceItem
from gradaudit.io.files import FileIdentity, describe_os_error, open_checked, read_at, show
from gradaudit.io.layouts import PICKLE_EXTENSIONS as PICKLE_EXTENSIONS
from gradaudit.io.mapguard import MapGuard, release_and_check
from gradaudit.io.nested import iter_tensors, walk_checkpoint
from gradaudit.io.pickle_budget import budget_problem
from gradaudit.io.pickle_scan import allowed_globals, explain_refusal, pickle_globals
from gradaudit.io.sniff import Sniffed, sniff
from gradaudit.io.torch_zip import (
    TorchZip,
    check_storages,
    data_pickle_problem,
    inspect_torch_zip,
)
from gradaudit.results.roles import TensorHint

#: File name endings read by this module (compared in lower case).

#: At most this much of a pickle is re-read to name the globals in a refusal.
_SCAN_BYTES = 64 << 20
#: A legacy file is a row of pickles: magic number, protocol, system info, the object
#: (then the storage keys, and the storages' raw bytes).
_LEGACY_PICKLES = 4


def _wrong_content(path: str, sniffed: Sniffed) -> str:
    """The message for a pickle-extension file whose bytes are not a PyTorch checkpoint."""
    if sniffed.kind == "safetensors":
        return (
            "looks like a safetensors file, not a PyTorch pickle: rename it to .safetensors "
            "to audit it"
        )
    if sniffed.kind == "git-lfs":
        return "is a git-lfs pointer, not the file's content: run `git lfs pull`"
    if sniffed.kind == "pickle":
        unsafe = [g for g in _globals_of(path, _LEGACY_PICKLES) if g not in allowed_globals()]
        if unsafe:
            more = f" (and {len(unsafe) - 1} more)" if len(unsafe) > 1 else ""
            return (
                f"refused as unsafe: a plain Python pickle (not written by torch.save) that "
                f"references {show(unsafe[0])}{more}; nothing from the file was run"
            )
        return "is a plain Python pickle, not a checkpoint written by torch.save"
    if sniffed.kind == "other":
        return f"not a PyTorch checkpoint: it looks like {sniffed.description}"
    return "not a PyTorch checkpoint (neither a zip archive nor a pickle)"


def _globals_of(path: str, max_pickles: int) -> list[str]:
    return pickle_globals(io.BytesIO(read_at(path, 0, _SCAN_BYTES)), max_pickles)


def _without_advice(text: str) -> str:
    """Drop the sentences of a torch message that recommend ``weights_only=False``."""
    sentences = [s for s in text.replace("\n", " ").split(". ") if "weights_only" not in s]
    return ". ".join(s.strip() for s in sentences if s.strip()).strip()


#: printf placeholders torch leaves unformatted in some messages ("expected %ld got %ld"):
#: they say nothing to a reader, so they are dropped with the words that frame them.
_unformatted = re.compile(r"[:,]?\s*(expected|got)?\s*%l?[dus]\b(\s*got\s*%l?[dus]\b)?")


def _load_failure(error: Exception) -> str:
    """One line for a ``torch.load`` failure that is not a weights-only refusal."""
    if isinstance(error, MemoryError):
        return "not enough memory to load it"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = _unformatted.sub("", lines[0]) if lines else ""
    if isinstance(error, UnicodeDecodeError):
        return "corrupt pickle data (a string in it is not valid UTF-8)"
    ends_early = ("truncated", "Ran out of input", "unexpected EOF")
    if isinstance(error, EOFError) or any(words in text for words in ends_early):
        return "file is truncated or corrupt (the pickle ends early)"
    if "Invalid magic number" in text:
        return "corrupt legacy PyTorch checkpoint (invalid magic number)"
    if "storage has wrong byte size" in text:
        return "corrupt checkpoint: a tensor's storage holds fewer or more bytes than declared"
    if "legacy .tar format" in text:
        return "is in PyTorch's pre-1.6 .tar format, which cannot be loaded safely"
    if "PytorchStreamReader" in text:
        return f"corrupt zip checkpoint ({_without_advice(text.split(':', 1)[-1])[:200]})"
    detail = _without_advice(text)[:200] or "no detail"
    return f"cannot load this PyTorch checkpoint ({type(error).__name__}: {detail})"


def trainer_bookkeeping(path: str) -> str | None:
    """What a ``transformers.Trainer`` checkpoint file that holds no tensors is, by its name."""
    name = os.path.basename(path).lower()
    if name.startswith("rng_state") and name.endswith(".pth"):
        return "a Trainer's random-number-generator state (numpy arrays)"
    if name == "training_args.bin":
        return "a Trainer's pickled TrainingArguments object"
    return None


class TorchPickleSource:
    """One ``torch.save`` file: a zip checkpoint (memory-mapped) or the legacy pickle format."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Taken before anything is read: check_unchanged() compares the end state with it.
        try:
            self._identity: FileIdentity | None = FileIdentity.of(os.stat(path))
        except OSError:
            self._identity = None  # sniff() says why it cannot be read
        self._guard: MapGuard | None = None
        self._budget_checked = False
        sniffed = sniff(path)
        self.archive: TorchZip | None = None
        #: What the checkpoint's structure says about each tensor (filled by :meth:`items`).
        self.role_hints: dict[str, TensorHint] = {}
        if sniffed.kind == "zip":
            self.archive = inspect_torch_zip(path)
        elif sniffed.kind != "torch-legacy":
            raise InputError(path, _wrong_content(path, sniffed))

    def items(self, select: Select | None = None) -> Iterator[SourceItem]:
        """Yield the checkpoint's tensors on the CPU; the collector moves each to the device."""
        if self.archive is not None:
            structure = self._load("meta")
            if structure is not None:
                check_storages(self.path, self.archive, iter_tensors(structure))
        loaded = self._load("cpu")
        if self.archive is not None:
            self._guard_storages(loaded)
        yield from walk_checkpoint(loaded, self.path, select, self.role_hints)

    def _guard_storages(self, loaded: Any) -> None:
        """Guard the pages torch mapped (``mmap=True``): one map of the whole file.

        Every storage is a slice of that map, so the span from the lowest storage
        to the end of the highest lies inside it.
        """
        low, high = None, None
        for tensor in iter_tensors(loaded):
            if tensor.layout is not torch.strided or tensor.is_quantized:
                continue
            storage = tensor.untyped_storage()
            if not storage.nbytes():
                continue
            start = storage.data_ptr()
            low = start if low is None else min(low, start)
            high = start + storage.nbytes() if high is None else max(high, start + storage.nbytes())
        if low is not None and high is not None:
            self._guard = MapGuard(low, high - low, owner=self)

    def check_unchanged(self) -> None:
        """Raise :class:`InputError` if the file changed while it was read.

        A page of torch's map read past a new end (the guard's flag), or a
        different size, modification time or inode behind the path than before
        the container was checked.
        """
        guard, self._guard = self._guard, None
        release_and_check(self.path, guard, self._identity)

    def _load(self, map_location: str) -> Any:
        """``torch.load`` the weights-only way; every failure becomes an :class:`InputError`.

        A ``"meta"`` load only serves the storage check: when it fails for a reason other
        than a weights-only refusal (quantized tensors cannot be rebuilt on ``meta``), it
        returns None and the check is skipped; the real load reports its own errors.
        """
        memory_map = self.archive is not None and map_location != "meta"
        if not self._budget_checked:
            self._check_budget()
            self._budget_checked = True
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return torch.load(
                    self.path, map_location=map_location, weights_only=True, mmap=memory_map
                )
        except pickle.UnpicklingError as error:
            raise InputError(self.path, self._refusal(str(error))) from None
        except Exception as error:  # noqa: BLE001 - torch.load's failures on hostile files are many
            if map_location == "meta":
                return None
            raise InputError(self.path, _load_failure(error)) from None

    def _check_budget(self) -> None:
        """Refuse a pickle that would build more objects than a checkpoint needs, before
        torch unpickles it (:mod:`gradaudit.io.pickle_budget`): ``data.pkl`` of a zip
        checkpoint, or the pickles at the head of a legacy file (its storages follow)."""
        if self.archive is not None:
            problem = data_pickle_problem(self.archive)
        else:
            with open_checked(self.path)[0] as handle:
                try:
                    problem = budget_problem(handle, _LEGACY_PICKLES + 1)
                except OSError as error:
                    raise InputError(self.path, describe_os_error(error)) from None
        if problem is not None:
            raise InputError(self.path, problem)

    def _refusal(self, message: str) -> str:
        trainer_file = trainer_bookkeeping(self.path)
        if trainer_file is not None:
            # Every Trainer checkpoint has these: say what they are, not "unsafe".
            return (
                f"{trainer_file}, not tensors to audit; not unpickled (nothing from the file "
                "was run): scan its checkpoint directory to audit the model and optimizer"
            )
        if self.archive is None:
            data = read_at(self.path, 0, _SCAN_BYTES)
            return explain_refusal(message, io.BytesIO(data), _LEGACY_PICKLES)
        member = self.archive.records["data.pkl"]
        data = read_at(self.path, member.offset, min(member.size, _SCAN_BYTES))
        return explain_refusal(message, io.BytesIO(data))
