"""The column-by-column header check agrees with the entry-by-entry one, and is the one used.

The fast path (:func:`_fast_table`) only ever says "valid, here are the columns" or "not
sure"; whatever it accepts, the entry-by-entry path must accept with the same result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradaudit.errors import InputError
from gradaudit.io import safetensors_header as module
from gradaudit.io.safetensors_header import SAFETENSORS_DTYPE_SIZES, TensorEntry, read_header
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
    document = module._parse_json(text)
    fast = module._fast_table(document, data_length)
    try:
        _, slow = module._parse_entries(document, data_length)
    except module._Refused:
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
