"""Sharded safetensors checkpoints: a ``*.safetensors.index.json`` and the shards it maps.

The index (Hugging Face's format) is ``{"metadata": {...}, "weight_map": {tensor: shard}}``.
The whole index is validated before a single tensor is read, in the spirit of
``huggingface_hub``'s sharded loading:

* the index is a bounded, UTF-8 JSON object whose ``weight_map`` maps text to text, with no
  tensor listed twice (JSON parsers silently keep the last duplicate);
* every shard name is relative, stays inside the index's directory (no absolute path, no
  ``..`` component) and ends in ``.safetensors``; symlinked shards are followed, as in the
  Hugging Face cache, whose snapshot files link into ``blobs/``;
* every shard exists and passes the full safetensors header validation;
* the tensors each shard really holds are exactly those the map assigns to it.

Then shards are read one at a time through :class:`SafetensorsSource`. The index is one
input: its tensors keep their own names and are reported under the index's path.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from gradaudit.errors import InputError
from gradaudit.io.files import describe_os_error, open_checked, show
from gradaudit.io.safetensors_header import SafetensorsHeader, read_header

if TYPE_CHECKING:  # the readers of tensors need torch; the index and headers do not
    from gradaudit.io.base import RunItem, Select, SourceItem
    from gradaudit.io.safetensors_source import SafetensorsSource

#: File name ending of a sharded safetensors index (compared in lower case).
INDEX_SUFFIX = ".safetensors.index.json"

#: An index larger than this is refused: the index of a 400B-parameter model is ~200 KB.
MAX_INDEX_BYTES = 64 << 20


class _Pairs:
    """A JSON object kept as its key/value pairs, so a duplicate key stays visible."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs


def _refuse(path: str, cause: str) -> NoReturn:
    raise InputError(path, cause)


def _read_index(path: str) -> Any:
    handle, size = open_checked(path)
    with handle:
        if size > MAX_INDEX_BYTES:
            _refuse(path, f"index is {size} bytes, absurdly large (the limit is {MAX_INDEX_BYTES})")
        try:
            raw = handle.read(MAX_INDEX_BYTES + 1)
        except OSError as error:
            _refuse(path, describe_os_error(error))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        _refuse(path, f"index is not valid UTF-8 (at byte {error.start})")
    try:
        return json.loads(text, object_pairs_hook=_Pairs)
    except RecursionError:
        _refuse(path, "index is not valid JSON (nested too deeply)")
    except json.JSONDecodeError as error:
        _refuse(path, f"index is not valid JSON ({error.msg} at byte {error.pos})")
    except ValueError:
        _refuse(path, "index is not valid JSON (a number is far too long)")


def _check_shard_name(path: str, shard: str) -> str:
    """Refuse a shard name that is absolute, escapes the directory or is not ``.safetensors``."""
    shown = show(shard)
    if not shard or "\0" in shard:
        _refuse(path, f"index names an invalid shard {shown}")
    if (
        shard.startswith(("/", "\\"))
        or os.path.isabs(shard)
        or (len(shard) > 1 and shard[1] == ":")
    ):
        _refuse(path, f"index names shard {shown} by an absolute path; shards must be relative")
    if ".." in shard.replace("\\", "/").split("/"):
        _refuse(path, f"index names shard {shown}, which escapes the index's directory (..)")
    if not shard.lower().endswith(".safetensors"):
        _refuse(path, f"index names shard {shown}, which is not a .safetensors file")
    return shard


def parse_index(path: str) -> dict[str, list[str]]:
    """Validate an index's JSON and shard names; return tensor names by shard, in map order."""
    document = _read_index(path)
    if not isinstance(document, _Pairs):
        _refuse(path, "index is not a JSON object")
    top = dict(document.pairs)
    weight_map = top.get("weight_map")
    if not isinstance(weight_map, _Pairs):
        _refuse(path, 'index has no "weight_map" object')
    by_shard: dict[str, list[str]] = {}
    seen: set[str] = set()
    for name, shard in weight_map.pairs:
        if name in seen:
            _refuse(
                path,
                f"index lists tensor {show(name)} twice in its weight_map "
                "(a JSON reader would silently keep only the last)",
            )
        seen.add(name)
        if not isinstance(shard, str):
            _refuse(path, f"index maps tensor {show(name)} to a value that is not a file name")
        by_shard.setdefault(_check_shard_name(path, shard), []).append(name)
    if not by_shard:
        _refuse(path, "index lists no tensors (its weight_map is empty)")
    return by_shard


def referenced_shards(path: str) -> list[str]:
    """The shard paths an index names, or ``[]`` if it cannot be read (it is reported later).

    Used by directory expansion so that shards covered by an index are not audited twice.
    """
    try:
        by_shard = parse_index(path)
    except InputError:
        return []
    folder = os.path.dirname(path)
    return [os.path.normpath(os.path.join(folder, shard)) for shard in by_shard]


def _compare(
    path: str, shard: str, header: SafetensorsHeader, expected: list[str], owner: dict[str, str]
) -> None:
    held = set(header.tensors.names)
    for name in expected:
        if name not in held:
            _refuse(
                path,
                f"index maps tensor {show(name)} to shard {show(shard)}, which does not hold it",
            )
    wanted = set(expected)
    for name in header.tensors.names:
        if name in wanted:
            continue
        elsewhere = owner.get(name)
        where = (
            f"but the index maps it to {show(elsewhere)}"
            if elsewhere is not None
            else "which the index does not list"
        )
        _refuse(path, f"shard {show(shard)} holds tensor {show(name)}, {where}")


def validated_shards(path: str) -> list[tuple[str, str, SafetensorsHeader]]:
    """``(name in the index, path, validated header)`` of each shard of the index ``path``,
    in the order the map first names them; raises :class:`InputError` naming the index.

    The whole set is checked before a tensor is read: the index, every shard's header,
    and that each shard holds exactly the tensors the map assigns to it.
    """
    by_shard = parse_index(path)
    folder = os.path.dirname(path)
    owner = {name: shard for shard, names in by_shard.items() for name in names}
    shards = []
    for shard, names in by_shard.items():
        shard_path = os.path.join(folder, shard)
        try:
            header = read_header(shard_path)
        except InputError as error:
            if error.cause == "no such file":
                _refuse(path, f"index names shard {show(shard)}, which does not exist")
            _refuse(path, f"shard {show(shard)}: {error.cause}")
        _compare(path, shard, header, names, owner)
        shards.append((shard, shard_path, header))
    return shards


@contextlib.contextmanager
def in_shard(path: str, shard: str) -> Iterator[None]:
    """A shard's :class:`InputError` as the index's: ``shard NAME: cause``."""
    try:
        yield
    except InputError as error:
        _refuse(path, f"shard {show(shard)}: {error.cause}")


class ShardedSource:
    """A sharded safetensors checkpoint, validated as a whole, then read one shard at a time."""

    def __init__(self, path: str) -> None:
        from gradaudit.io.safetensors_source import SafetensorsSource  # torch: the index does not

        self.path = path
        #: ``(name in the index, reader)`` per shard, in the order the map first names them.
        self.shards: list[tuple[str, SafetensorsSource]] = [
            (shard, SafetensorsSource(shard_path, header))
            for shard, shard_path, header in validated_shards(path)
        ]

    @property
    def metadata(self) -> dict[str, str]:
        """The first shard's ``__metadata__`` (``transformers`` writes the same to each)."""
        return self.shards[0][1].metadata if self.shards else {}

    def items(self, select: Select | None = None) -> Iterator[SourceItem]:
        for shard, source in self.shards:
            with in_shard(self.path, shard):
                yield from source.items(select)

    def runs(self) -> Iterator[RunItem]:
        for shard, source in self.shards:
            with in_shard(self.path, shard):
                yield from source.runs()

    def check_unchanged(self) -> None:
        """Raise :class:`InputError` if a shard changed while it was read (see the shard reader)."""
        for shard, source in self.shards:
            with in_shard(self.path, shard):
                source.check_unchanged()
