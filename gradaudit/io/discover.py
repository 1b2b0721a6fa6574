"""Turn the paths a user gives (files and directories) into the files to audit.

A directory is searched for the file types gradaudit reads; ``recursive`` descends into
subdirectories. Choices, each so that a run over a checkpoint folder says everything and
never loops or audits a tensor twice:

* every entry is accounted for: a file of another type, a subdirectory not searched, a
  hidden directory (``.git``, ``.cache``: never searched) is listed as skipped with the
  reason; a directory with no checkpoint file at all is an input error, as a missing file
  would be;
* a ``*.safetensors.index.json`` is one input, and the shards it names are audited through
  it rather than a second time on their own;
* symlinks are followed (the Hugging Face cache is made of them), but a directory is
  searched once however many links lead to it, so a symlink loop ends; a file reached
  twice (two links, or given twice) is audited once;
* only ``stat`` is used: nothing is opened here, so a FIFO cannot block the walk. A FIFO or
  dangling link with a checkpoint extension is handed on and refused by the reader, with
  its reason; one with another name is listed as skipped.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from gradaudit.io.files import describe_os_error, show
from gradaudit.io.layouts import (
    DATA_SUFFIX,
    METADATA_NAME,
    PICKLE_EXTENSIONS,
    TRAINER_STATE,
    is_dcp_directory,
    is_deepspeed_checkpoint,
    is_trainer_checkpoint,
)
from gradaudit.io.sharded import INDEX_SUFFIX, referenced_shards

#: Every name ending gradaudit reads, most specific first (compared in lower case).
KNOWN_SUFFIXES: tuple[str, ...] = (INDEX_SUFFIX, ".safetensors", *PICKLE_EXTENSIONS)


def input_kind(path: str) -> str | None:
    """``"index"``, ``"safetensors"``, ``"pickle"``, ``"trainer_state"`` (a Trainer's logged
    history) or None, from the file name alone."""
    name = path.lower()
    if os.path.basename(name) == TRAINER_STATE:
        return "trainer_state"
    if name.endswith(INDEX_SUFFIX):
        return "index"
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(PICKLE_EXTENSIONS):
        return "pickle"
    return None


@dataclass(frozen=True)
class FileInput:
    """A file to hand to a reader."""

    path: str


@dataclass(frozen=True)
class SkippedPath:
    """Something found in a directory (or given twice) that is not audited, and why."""

    path: str
    reason: str
    #: The input it was found under (the directory the user gave).
    within: str


@dataclass(frozen=True)
class BadInput:
    """An input that cannot be audited at all (an unreadable or empty directory)."""

    path: str
    cause: str


Expanded = FileInput | SkippedPath | BadInput


@dataclass
class _Seen:
    files: dict[tuple[int, int], str] = field(default_factory=dict)
    dirs: set[tuple[int, int]] = field(default_factory=set)

    def first_path(self, path: str) -> str | None:
        """The path under which this file was already taken, or None (and remember it)."""
        try:
            info = os.stat(path)
        except (OSError, ValueError):
            return None  # the reader reports it
        key = (info.st_dev, info.st_ino)
        if key in self.files:
            return self.files[key]
        self.files[key] = path
        return None


def _is_dcp_part(name: str) -> bool:
    return name == METADATA_NAME or name.endswith(DATA_SUFFIX)


def _is_directory(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


#: Why a known companion file of a model directory is skipped. Renderers count these in one
#: line instead of one line each: a Hugging Face model directory always has them.
COMPANION_REASON = "model companion file (config, tokenizer, docs); not audited"

#: Files that sit next to the weights in a model directory (Hugging Face Hub layouts).
_COMPANION_NAMES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "preprocessor_config.json",
        "processor_config.json",
        "chat_template.json",
        "chat_template.jinja",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "readme.md",
        "license",
        "license.txt",
        ".gitattributes",
        "trainer_state.json",
        "adapter_config.json",
    }
)


def is_companion(path: str) -> bool:
    """Whether ``path`` names a known non-weight file of a model directory."""
    return os.path.basename(path).lower() in _COMPANION_NAMES


def _not_a_checkpoint(path: str) -> str:
    """Why a file found in a directory, with a name gradaudit does not read, is skipped."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return "dangling symlink; not audited"
    except OSError as error:
        return f"{describe_os_error(error)}; not audited"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file; not audited"
    if path.lower().endswith(".index.json"):
        return "index of non-safetensors shards: the shards themselves are audited as files"
    if is_companion(path):
        return COMPANION_REASON
    return "not a checkpoint file (unknown extension); not audited"


def _duplicate(path: str, first: str) -> str:
    if os.path.normpath(path) == os.path.normpath(first):
        return "given more than once; audited once"
    return f"same file as {show(first, limit=400)}; audited once"


def _inside(path: str, root: str) -> bool:
    """Whether ``path``, its links resolved, lies within ``root`` (its links resolved)."""
    try:
        real, top = os.path.realpath(path), os.path.realpath(root)
        return os.path.commonpath([real, top]) == top
    except (OSError, ValueError):
        return False


def _walk(root: str, recursive: bool, seen: _Seen) -> Iterator[Expanded]:
    found = 0
    unsearched = 0
    distributed = False
    pending = [root]
    while pending:
        folder = pending.pop()
        try:
            info = os.stat(folder)
            if (info.st_dev, info.st_ino) in seen.dirs:
                if folder != root:
                    yield SkippedPath(
                        folder, "directory already searched (a symlink loop?); skipped", root
                    )
                continue
            seen.dirs.add((info.st_dev, info.st_ino))
            with os.scandir(folder) as scan:
                entries = sorted(scan, key=lambda e: e.name)
        except OSError as error:
            yield BadInput(folder, f"cannot list the directory: {describe_os_error(error)}")
            continue
        covered: set[str] = set()
        if is_dcp_directory(folder):
            # One checkpoint: its .metadata and *.distcp files are read through it.
            found += 1
            first = seen.first_path(folder)
            if first is None:
                yield FileInput(folder)
            else:
                yield SkippedPath(folder, _duplicate(folder, first), root)
            covered.update(os.path.normpath(e.path) for e in entries if _is_dcp_part(e.name))
        elif is_trainer_checkpoint(folder) or is_deepspeed_checkpoint(folder):
            # One checkpoint: its reader accounts for the model, optimizer and bookkeeping.
            found += 1
            first = seen.first_path(folder)
            if first is None:
                yield FileInput(folder)
            else:
                yield SkippedPath(folder, _duplicate(folder, first), root)
            covered.update(os.path.normpath(e.path) for e in entries if not _is_directory(e.path))
        distributed = distributed or any(e.name.endswith(".distcp") for e in entries)
        for entry in entries:
            if entry.name.lower().endswith(INDEX_SUFFIX):
                covered.update(referenced_shards(entry.path))
        subfolders: list[str] = []
        for entry in entries:
            path = entry.path
            if _is_directory(path):
                if entry.name.startswith("."):
                    yield SkippedPath(path, "hidden directory; not searched", root)
                elif recursive and not _inside(path, root):
                    # A planted link to / or /proc would crawl the machine: -r stays in
                    # the tree it was given (links within it are followed).
                    yield SkippedPath(
                        path, "symbolic link out of the input directory; not searched", root
                    )
                elif recursive:
                    subfolders.append(path)
                else:
                    unsearched += 1
                    yield SkippedPath(path, "directory; not searched (use --recursive)", root)
            elif os.path.normpath(path) in covered:
                continue
            elif input_kind(entry.name) is None:
                yield SkippedPath(path, _not_a_checkpoint(path), root)
            elif os.path.normpath(path) not in covered:
                found += 1
                first = seen.first_path(path)
                if first is None:
                    yield FileInput(path)
                else:
                    yield SkippedPath(path, _duplicate(path, first), root)
        pending.extend(reversed(subfolders))
    if not found:
        hint = f"; {unsearched} subdirectories not searched (use --recursive)" if unsearched else ""
        if distributed:
            hint = (
                "; it holds torch.distributed.checkpoint data (.distcp) but no .metadata "
                "file, which is what names the tensors: was the save interrupted?"
            )
        yield BadInput(
            root,
            f"no checkpoint file in this directory (looked for {', '.join(KNOWN_SUFFIXES)}){hint}",
        )


def expand_inputs(
    paths: Sequence[str | os.PathLike[str]], *, recursive: bool = False
) -> Iterator[Expanded]:
    """The files to audit for ``paths``, in order, with everything left out accounted for."""
    seen = _Seen()
    for raw in paths:
        path = os.fspath(raw)
        if _is_directory(path):
            yield from _walk(path, recursive, seen)
            continue
        first = seen.first_path(path)
        if first is None:
            yield FileInput(path)
        else:
            yield SkippedPath(path, _duplicate(path, first), path)


def files_read(paths: Sequence[str | os.PathLike[str]], *, recursive: bool = False) -> list[str]:
    """Every file a run over ``paths`` would open: inputs after expansion, and the shards
    each sharded index names.

    For refusing an output path that would replace one of them (``--output``, ``--plot``):
    a report written over a checkpoint found in a directory, over a file inside a checkpoint
    directory (DCP ``.metadata``, a Trainer's ``optimizer.pt``), or over a shard reached
    through its index, destroys data the user asked to have read. Paths that do not
    exist are listed too (as given), so an output cannot take their place either.
    """
    found: list[str] = []
    for entry in expand_inputs(paths, recursive=recursive):
        if not isinstance(entry, FileInput):
            continue
        found.append(entry.path)
        if _is_directory(entry.path):
            # A checkpoint directory (DCP, DeepSpeed, a Trainer's) is one input whose reader
            # opens the files inside it: each of them is read, so none may be replaced.
            found += _files_inside(entry.path)
        elif input_kind(entry.path) == "index":
            found += referenced_shards(entry.path)
    return found


def _files_inside(folder: str) -> list[str]:
    """Every entry of a checkpoint directory (not its subdirectories), and the shards its
    sharded indexes name."""
    try:
        with os.scandir(folder) as scan:
            names = sorted(entry.path for entry in scan if not _is_directory(entry.path))
    except OSError:
        return []
    shards = [s for n in names if n.lower().endswith(INDEX_SUFFIX) for s in referenced_shards(n)]
    return names + shards
