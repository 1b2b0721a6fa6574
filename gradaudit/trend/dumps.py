"""The dumps of a series: which files a trend's inputs stand for, and each one's step.

Ordering reads headers only (a safetensors ``__metadata__``, or a file name), never a
tensor: :func:`order_dumps` runs before the first dump is audited, so a series whose
steps cannot be told apart fails before any work. The torch path and the torch-free
path differ only in how a header is read (:data:`MetadataReader`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gradaudit.errors import InputError
from gradaudit.io import open_source
from gradaudit.io.discover import BadInput, FileInput, expand_inputs, input_kind
from gradaudit.io.files import check_regular_file
from gradaudit.io.safetensors_map import MappedSafetensors
from gradaudit.results import InputProblem
from gradaudit.results.trend import NONFINITE_STEP_KEY
from gradaudit.scan import torch_free

#: ``__metadata__`` keys read as the dump's step, in order of preference.
STEP_METADATA_KEYS = ("step", "global_step")

_INTEGER = re.compile(r"\s*[+-]?\d+\s*")
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")


@dataclass(frozen=True)
class Dump:
    """One input of the series and the step it was taken at."""

    step: int
    path: str
    #: The earlier step a monitor's stats showed NaN/Inf at, per the dump's metadata.
    nonfinite_step: int | None = None


def reported_nonfinite_step(step: int, metadata: dict[str, str]) -> int | None:
    """The ``nonfinite_step`` a monitor wrote, when it is an integer below ``step``."""
    value = metadata.get(NONFINITE_STEP_KEY, "")
    if not _INTEGER.fullmatch(value):
        return None
    earlier = int(value)
    return earlier if earlier < step else None


def step_from_name(path: str) -> int | None:
    """The last number in the file name (``step_001200.safetensors`` -> 1200), if any."""
    name = Path(path).name.removesuffix(".safetensors")
    match = _LAST_NUMBER.search(name)
    return int(match.group(1)) if match else None


def dump_step(path: str, metadata: dict[str, str]) -> int:
    """The step of a dump: its ``step`` metadata, else the last number in its file name."""
    for key in STEP_METADATA_KEYS:
        if key in metadata:
            value = metadata[key]
            if not _INTEGER.fullmatch(value):
                raise InputError(path, f"metadata {key} {value[:40]!r} is not an integer")
            return int(value)
    step = step_from_name(path)
    if step is None:
        raise InputError(
            path,
            "cannot tell the step of this dump: no 'step' in its metadata and no number "
            "in its file name",
        )
    return step


def dump_files(
    paths: Sequence[str | Path], *, recursive: bool = False
) -> tuple[list[str], list[InputProblem]]:
    """The dump files ``paths`` stand for, found as ``scan`` finds its inputs.

    Discovery is :func:`gradaudit.io.discover.expand_inputs`: a directory stands for
    the checkpoint files in it (subdirectories only with ``recursive``, hidden ones
    never), companion files are passed over, a file reached twice (given twice, or
    through a link) is read once, and a directory without any dump is a problem.
    """
    files: list[str] = []
    problems: list[InputProblem] = []
    for entry in expand_inputs(paths, recursive=recursive):
        if isinstance(entry, FileInput):
            files.append(entry.path)
        elif isinstance(entry, BadInput):
            problems.append(InputProblem(entry.path, entry.cause))
        # A SkippedPath (a companion file, a hidden directory, a second name of a
        # file) is no dump of the series: scan lists them, a trend has no row for them.
    return files, problems


#: The ``__metadata__`` of a dump, or ``None`` when it is no safetensors file (then only its
#: name can say its step); raises :class:`InputError` when the file cannot be opened.
MetadataReader = Callable[[str], "dict[str, str] | None"]


def opened_metadata(path: str) -> dict[str, str] | None:
    """The dump's metadata as its reader (:func:`gradaudit.io.open_source`) sees it."""
    # The readers import torch; a safetensors reader is a MappedSafetensors.
    source = open_source(path)
    if input_kind(path) == "safetensors" and isinstance(source, MappedSafetensors):
        return source.header.metadata
    return None


def mapped_metadata(path: str) -> dict[str, str] | None:
    """:func:`opened_metadata` without torch: what ``open_source`` checks and reads of a
    safetensors file (:class:`MappedSafetensors` is its reader's header half), or checks of
    a ``torch.save`` file (:func:`~gradaudit.scan.torch_free.check_checkpoint`: ``None``,
    its step is in its name; :class:`~gradaudit.scan.torch_free.NeedsTorch` for one only
    the torch path reads)."""
    check_regular_file(path)
    if input_kind(path) == "pickle":
        torch_free.check_checkpoint(path)
        return None
    return MappedSafetensors(path).header.metadata


def order_dumps(
    paths: Sequence[str | Path],
    *,
    recursive: bool = False,
    metadata_of: MetadataReader = opened_metadata,
) -> tuple[list[Dump], list[InputProblem]]:
    """Expand (:func:`dump_files`) and order the inputs by step, reading headers only.

    An input that cannot be opened, or whose step is unknown or already taken by
    another dump, is a problem; the others are still ordered.
    """
    files, problems = dump_files(paths, recursive=recursive)
    by_step: dict[int, str] = {}
    earlier: dict[int, int | None] = {}
    for path in files:
        try:
            found = metadata_of(path)
            if found is None and step_from_name(path) is None:
                # Only safetensors headers carry metadata; a 'step' entry inside a torch.save
                # dict is data, and trend orders dumps before reading any data.
                raise InputError(
                    path,
                    "cannot tell the step of this dump: trend reads the step from .safetensors "
                    "metadata or from a number in the file name, and this torch.save file's "
                    "name has none (rename it, e.g. step_100.pt, or dump with "
                    "gradaudit.save_gradients)",
                )
            metadata = found or {}
            step = dump_step(path, metadata)
        except InputError as error:
            problems.append(InputProblem(path, error.cause))
            continue
        if step in by_step:
            problems.append(
                InputProblem(
                    path, f"step {step} is already taken by {by_step[step]}; one dump per step"
                )
            )
            continue
        by_step[step] = path
        earlier[step] = reported_nonfinite_step(step, metadata)
    dumps = [Dump(step, by_step[step], earlier[step]) for step in sorted(by_step)]
    return dumps, problems
