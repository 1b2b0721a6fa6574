"""The column-by-column header check agrees with the entry-by-entry one, and is the one used.

The fast path (:func:`gradaudit.io.safetensors_table.fast_table`) only ever says "valid,
here are the columns" or "not sure"; whatever it accepts, the entry-by-entry path must
accept with the same result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradaudit.errors import InputError
from gradaudit.io import header_columns
from gradaudit.io import safetensors_header as module
from gradaudit.io.safetensors_header import read_header
from gradaudit.io.safetensors_json import Refused, parse_json
from gradaudit.io.safetensors_table import (
    DTYPE_NAMES,
    SAFETENSORS_DTYPE_SIZES,
    TensorEntry,
    fast_table,
    from_columns,
)
from tests.hostile import pairs_json
from tests.hostile import raw_safetensors as raw_file

DTYPES = ["F32", "BF16", "F64", "U8", "I16"]
ODD_VALUES = st.one_of(
    st.integers(-3, 40), st.just(2**63), st.booleans(), st.floats(-2, 2), st.none(), st.text()
)


@st.composite
def headers(draw: st.DrawFn) -> tuple[str, int]:
    """A header (JSON text) of a few entries that tile their data, maybe with one flaw."""
    count = draw(st.integers(1, 5))
    specs = []
    for i in range(count):
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        specs.append((f"t{i}", draw(st.sampled_from(DTYPES)), shape))
    order = draw(st.permutations(range(count)))
    offsets: dict[int, list[Any]] = {}
    position = 0
    for index in order:
        _, dtype, shape = specs[index]
        size = SAFETENSORS_DTYPE_SIZES[dtype]
        for dim in shape:
            size *= dim
        offsets[index] = [position, position + size]
        position += size
    pairs: list[tuple[str, Any]] = []
    for index, (name, dtype, shape) in enumerate(specs):
        entry: list[tuple[str, Any]] = [
            ("dtype", dtype),
            ("shape", shape),
            ("data_offsets", offsets[index]),
        ]
        pairs.append((name, dict(draw(st.permutations(entry)))))
    flaw = draw(st.sampled_from(["none", "value", "offset", "dim", "name", "key", "extra"]))
    target = draw(st.integers(0, count - 1))
    name, entry_dict = pairs[target]
    if flaw == "value":
        entry_dict[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(ODD_VALUES)
    elif flaw == "offset":
        entry_dict["data_offsets"] = [draw(ODD_VALUES), draw(ODD_VALUES)]
    elif flaw == "dim":
        entry_dict["shape"] = [draw(ODD_VALUES)]
    elif flaw == "name":
        pairs.append((name, entry_dict))
    elif flaw == "key":
        del entry_dict[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
    elif flaw == "extra":
        entry_dict["extra"] = 1
    data_length = position + draw(st.sampled_from([0, 0, 0, 1, -1]))
    return pairs_json(pairs), max(data_length, 0)


@settings(
    derandomize=True, max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(headers())
def test_the_fast_path_accepts_only_what_the_entry_path_accepts(case: tuple[str, int]) -> None:
    text, data_length = case
    document = parse_json(text)
    fast = fast_table(document, data_length)
    try:
        _, slow = module._parse_entries(document, data_length)
    except Refused:
        assert fast is None
        return
    if fast is not None:
        assert fast == slow
        assert fast.names == slow.names


def test_a_valid_header_takes_the_fast_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = {
        f"layer.{i}": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16 * j, 16 * j + 16]}
        for i, j in zip(range(50), reversed(range(50)), strict=True)
    }
    path = raw_file(tmp_path / "many.safetensors", json.dumps(entries), b"\0" * 16 * 50)

    def refuse(*args: object) -> object:
        raise AssertionError("the entry-by-entry path ran")

    monkeypatch.setattr(module, "_parse_entries", refuse)
    header = read_header(path)
    assert header.tensors[0] == TensorEntry("layer.49", "F32", (2, 2), 0, 16)
    assert header.tensors.names[-1] == "layer.0"
    assert len(header.tensors) == 50


def test_a_flawed_header_is_still_named_by_the_entry_path(tmp_path: Path) -> None:
    entries = {
        f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
        for i in range(9)
    }
    entries["t5"]["shape"] = [2]
    path = raw_file(tmp_path / "bad.safetensors", json.dumps(entries), b"\0" * 36)
    with pytest.raises(InputError, match='tensor "t5": shape/size mismatch'):
        read_header(path)


# -- the header read straight into columns (gradaudit.io.header_columns) ------------------

READERS = [
    "python",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not header_columns.native_available(), reason="the native extension is not built"
        ),
    ),
]


def canonical(entries: list[tuple[str, str, list[int], int, int]], metadata: str = "") -> bytes:
    """A header as the safetensors library writes it: no whitespace, keys in its order."""
    parts = [f'"__metadata__":{metadata}'] if metadata else []
    parts += [
        f"{json.dumps(name, ensure_ascii=False)}:"
        f'{{"dtype":"{dtype}","shape":{json.dumps(shape, separators=(",", ":"))},'
        f'"data_offsets":[{begin},{end}]}}'
        for name, dtype, shape, begin, end in entries
    ]
    return ("{" + ",".join(parts) + "}").encode()


def as_tuple(columns: header_columns.HeaderColumns | None) -> object:
    if columns is None:
        return None
    return (
        columns.names,
        columns.codes,
        columns.ranks.tolist(),
        columns.dims.tolist(),
        columns.begins.tolist(),
        columns.ends.tolist(),
        columns.metadata,
    )


SAMPLE = canonical(
    [("a.weight", "F32", [2, 3], 0, 24), ("b", "BF16", [], 24, 26), ("é", "U8", [0, 4], 26, 26)],
    metadata='{"format":"pt","k\\"ey":"v"}',
)


@pytest.mark.parametrize("reader", READERS)
def test_the_common_form_is_read_into_columns(reader: str) -> None:
    found = header_columns.read_columns(SAMPLE + b"   ", DTYPE_NAMES, native=reader == "native")
    assert found is not None
    assert found.names == ["a.weight", "b", "é"]
    assert [DTYPE_NAMES[c] for c in found.codes] == ["F32", "BF16", "U8"]
    assert found.ranks.tolist() == [2, 0, 2]
    assert found.dims.tolist() == [2, 3, 0, 4]
    assert found.begins.tolist() == [0, 24, 26]
    assert found.ends.tolist() == [24, 26, 26]
    assert found.metadata is not None
    assert json.loads(SAMPLE[slice(*found.metadata)]) == {"format": "pt", 'k"ey': "v"}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(
    "text",
    [
        b"{}",
        b"[]",
        b'{"__metadata__":{"a":"b"}}',
        b'{"__metadata__":null,"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        b'{"t":{"shape":[1],"dtype":"F32","data_offsets":[0,4]}}',  # another key order
        b'{"t\\u0041":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',  # an escape
        b'{"t":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}}',
        b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[-0,4]}}',
        b'{"t":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}',
        b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4e0]}}',
        b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,9223372036854775808]}}',
        b'{"t":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}',
        b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}',
        b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},}',
        b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x',
        b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}',
        b'{"t\xff":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',  # not UTF-8
        b'{"t\n":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',  # a raw control character
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        b'"__metadata__":{"a":"b"}}',  # metadata after a tensor
    ],
)
def test_anything_else_is_left_to_the_json_parser(reader: str, text: bytes) -> None:
    assert header_columns.read_columns(text, DTYPE_NAMES, native=reader == "native") is None


def mutate(text: bytearray, mutations: list[tuple[int, int, int]]) -> None:
    """Replace (0), insert (1) or delete (2) one byte at each place, in order."""
    for where, how, byte in mutations:
        where %= len(text) + 1
        if how == 0 and where < len(text):
            text[where] = byte
        elif how == 1:
            text.insert(where, byte)
        elif where < len(text):
            del text[where]


_MUTATION_ALPHABET = b'{}[]":,. 0123456789-eE\\\nFU8_a'


@settings(derandomize=True, max_examples=600, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b.c", "é", "x y", "__metadata__"]),
            st.sampled_from(DTYPE_NAMES[:6]),
            st.lists(st.integers(0, 5), max_size=3),
            st.integers(0, 99),
            st.integers(0, 99),
        ),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from(["", "{}", '{"format":"pt"}', '{"a":"b","c":"d\\\\"}']),
    st.lists(
        st.tuples(st.integers(0, 400), st.integers(0, 2), st.sampled_from(_MUTATION_ALPHABET)),
        max_size=3,
    ),
    st.booleans(),
)
def test_both_readers_accept_the_same_texts_with_the_same_columns(
    entries: list[tuple[str, str, list[int], int, int]],
    metadata: str,
    mutations: list[tuple[int, int, int]],
    spaced: bool,
) -> None:
    text = bytearray(canonical(entries, metadata))
    if spaced:  # JSON whitespace between tokens, as json.dumps writes by default
        text = bytearray(text.replace(b",", b", ").replace(b":", b": "))
    mutate(text, mutations)
    python = header_columns.python_columns(bytes(text), DTYPE_NAMES)
    if header_columns.native_available():
        assert as_tuple(header_columns.native_columns(bytes(text), DTYPE_NAMES)) == as_tuple(python)
    if python is not None:  # whatever is read is what JSON says
        pairs = json.loads(bytes(text), object_pairs_hook=list)
        tensors = [dict(value) for _, value in pairs[1 if python.metadata else 0 :]]
        assert python.names == [name for name, _ in pairs[1 if python.metadata else 0 :]]
        assert python.dims.tolist() == [d for value in tensors for d in value["shape"]]
        assert python.begins.tolist() == [value["data_offsets"][0] for value in tensors]


@settings(derandomize=True, max_examples=500, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b.c", "é", "a", "__metadata__"]),
            st.sampled_from(["F32", "BF16", "U8", "F64"]),
            st.lists(st.integers(0, 4), max_size=3),
        ),
        min_size=1,
        max_size=5,
    ),
    st.sampled_from(["", "{}", '{"format":"pt"}', '{"a":"b","a":"c"}', '{"a":1}']),
    st.lists(
        st.tuples(st.integers(0, 300), st.integers(0, 2), st.sampled_from(_MUTATION_ALPHABET)),
        max_size=2,
    ),
    st.sampled_from([0, 0, 0, 1, -1]),
    st.permutations(range(5)),
)
def test_a_header_read_as_columns_is_the_header_the_json_path_reads(
    specs: list[tuple[str, str, list[int]]],
    metadata: str,
    mutations: list[tuple[int, int, int]],
    slack: int,
    order: list[int],
) -> None:
    """Same tensors and metadata, or ``None`` (the JSON path decides and names the problem)."""
    entries = []
    position = 0
    for index in [i for i in order if i < len(specs)]:  # data in another order than the header
        name, dtype, shape = specs[index]
        size = SAFETENSORS_DTYPE_SIZES[dtype]
        for dim in shape:
            size *= dim
        entries.append((index, (name, dtype, shape, position, position + size)))
        position += size
    text = bytearray(canonical([entry for _, entry in sorted(entries)], metadata))
    mutate(text, mutations)
    data_length = max(0, position + slack)
    fast = from_columns(bytes(text), data_length)
    try:
        slow = module._parse_document(bytes(text), data_length)
    except Refused:
        assert fast is None
        return
    if fast is not None:
        assert fast == slow
        assert fast[1].names == slow[1].names


@pytest.mark.parametrize("reader", READERS)
def test_a_large_common_header_takes_the_column_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    if reader == "python":  # as on an install without the native extension
        monkeypatch.setattr(header_columns, "_NATIVE", None)
    entries = [(f"layer.{i}.w", "F32", [2, 2], 16 * i, 16 * i + 16) for i in range(2000)]
    path = raw_file(
        tmp_path / "many.safetensors",
        canonical(entries, '{"format":"pt"}').decode(),
        b"\0" * 16 * 2000,
    )

    def refuse(*args: object) -> object:
        raise AssertionError("the JSON path ran")

    monkeypatch.setattr(module, "_parse_document", refuse)
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    assert header.tensors[1999] == TensorEntry("layer.1999.w", "F32", (2, 2), 31984, 32000)


@pytest.mark.parametrize("reader", READERS)
def test_a_flaw_in_a_common_header_is_named_whichever_reader_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    if reader == "python":
        monkeypatch.setattr(header_columns, "_NATIVE", None)
    entries = [(f"t{i}", "F32", [1], 4 * i, 4 * i + 4) for i in range(9)]
    entries[5] = ("t5", "F32", [2], 20, 24)
    path = raw_file(tmp_path / "bad.safetensors", canonical(entries).decode(), b"\0" * 36)
    with pytest.raises(InputError, match='tensor "t5": shape/size mismatch'):
        read_header(path)
    duplicate = [*entries[:5], ("t5", "F32", [1], 20, 24), ("t5", "F32", [1], 24, 28)]
    path = raw_file(tmp_path / "dup.safetensors", canonical(duplicate).decode(), b"\0" * 28)
    with pytest.raises(InputError, match='duplicate tensor name "t5"'):
        read_header(path)
