"""``EngineOptions``: the four engine keywords as one value, accepted wherever the keywords are."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradaudit import EngineOptions, audit, collect_async, compare, scan_paths
from tests.conftest import WriteDump


def tensors() -> dict[str, torch.Tensor]:
    values = torch.linspace(-3.0, 5.0, 10_000)
    values[7] = float("nan")
    return {"layer.weight": values, "layer.bias": torch.ones(3)}


def test_options_select_the_engine_like_the_keywords() -> None:
    by_keywords = audit(tensors(), engine="eager", chunk_elements=4096)
    by_options = audit(tensors(), options=EngineOptions(engine="eager", chunk_elements=4096))
    assert by_options.engine == by_keywords.engine == "eager"
    assert by_options.tensors == by_keywords.tensors
    assert by_options.tensors[0].nan == 1


def test_collect_async_and_compare_take_options_too() -> None:
    options = EngineOptions(device="cpu", engine="eager")
    report = collect_async(tensors(), options=options).materialize()
    assert (report.device, report.engine) == ("cpu", "eager")
    both = compare(tensors(), tensors(), options=options)
    assert both.report.engine == "eager"
    assert both.dual == compare(tensors(), tensors(), device="cpu", engine="eager").dual


def test_scan_paths_takes_options_and_the_memory_budget(write_dump: WriteDump) -> None:
    path = str(write_dump(tensors()))
    options = EngineOptions(device="cpu", engine="eager", memory_budget=1 << 20)
    by_options = scan_paths([path], options=options)
    by_keywords = scan_paths([path], device="cpu", engine="eager", memory_budget=1 << 20)
    assert (by_options.device, by_options.engine) == ("cpu", "eager")
    assert by_options.tensors == by_keywords.tensors


@pytest.mark.parametrize(
    "call",
    [
        lambda o: audit(tensors(), engine="eager", options=o),
        lambda o: collect_async(tensors(), device="cpu", options=o),
        lambda o: compare(tensors(), tensors(), chunk_elements=4096, options=o),
        lambda o: scan_paths(["unused"], memory_budget=1 << 20, options=o),
    ],
)
def test_options_and_keywords_together_are_refused(call: object) -> None:
    """One of them would be silently ignored."""
    with pytest.raises(TypeError, match="not both"):
        call(EngineOptions(engine="eager"))  # type: ignore[operator]


def test_options_are_a_frozen_value() -> None:
    options = EngineOptions(engine="eager")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.engine = "native"  # type: ignore[misc]
    assert options == EngineOptions(engine="eager") != EngineOptions()
