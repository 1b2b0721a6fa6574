"""Naming the globals of a pickle without running it, and explaining torch's refusals."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
from pathlib import Path
from typing import Any

import pytest

from gradaudit.io.pickle_scan import allowed_globals, explain_refusal, pickle_globals
from tests.hostile import OpenMarker, TouchMarker


class System:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("true",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_globals_of_every_protocol(protocol: int, tmp_path: Path) -> None:
    data = pickle.dumps({"a": OpenMarker(tmp_path / "m"), "b": System()}, protocol=protocol)
    assert pickle_globals(io.BytesIO(data)) == ["io.open", f"{os.name}.system"]


def test_stack_global_through_the_memo(tmp_path: Path) -> None:
    # The same global twice: the second STACK_GLOBAL reuses memoised strings (BINGET).
    data = pickletools.optimize(
        pickle.dumps([OpenMarker(tmp_path / "m"), OpenMarker(tmp_path / "n")], protocol=4)
    )
    assert pickle_globals(io.BytesIO(data)) == ["io.open"]
    bound = pickle.dumps(TouchMarker(tmp_path / "m"), protocol=4)
    assert "builtins.getattr" in pickle_globals(io.BytesIO(bound))


def test_python2_names_are_mapped_like_torch_does() -> None:
    assert pickle_globals(io.BytesIO(b"c__builtin__\nset\n)\x85R.")) == ["builtins.set"]


def test_damaged_pickles_end_the_listing_quietly() -> None:
    assert pickle_globals(io.BytesIO(b"cos\nsystem\n\xff\xff")) == ["os.system"]
    assert pickle_globals(io.BytesIO(b"")) == []
    assert pickle_globals(io.BytesIO(b"\x80\x02\x8c")) == []


def test_the_allowlist_is_torchs() -> None:
    allowed = allowed_globals()
    assert "torch._utils._rebuild_tensor_v2" in allowed
    assert "collections.OrderedDict" in allowed
    assert "posix.system" not in allowed
    assert "builtins.open" not in allowed


UNSAFE = (
    "Weights only load failed. This file can still be loaded, to do so you have two options, "
    "\x1b[1mdo those steps only if you trust the source of the checkpoint\x1b[0m.\n\t(1) "
    "Re-running `torch.load` with `weights_only` set to `False` will likely succeed, but it "
    "can result in arbitrary code execution.\n\tWeightsUnpickler error: Unsupported global: "
    "GLOBAL __main__.Evil was not an allowed global by default. Please use "
    "`torch.serialization.add_safe_globals([Evil])` ...\n\nCheck the documentation of "
    "torch.load to learn more"
)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (UNSAFE, 'refused as unsafe: the pickle references "__main__.Evil"'),
        (
            "WeightsUnpickler error: Trying to load unsupported GLOBAL posix.system whose "
            "module posix is blocked.",
            'the pickle references "posix.system"',
        ),
        (
            "Weights only load failed. ...\n\nUnsupported operand 149\n\nCheck the documentation",
            "uses pickle opcode FRAME (pickle protocol 4), which PyTorch's weights-only loader "
            "does not support",
        ),
        ("WeightsUnpickler error: Unsupported operand 252", "byte 0xfc is not a pickle opcode"),
        (
            "``torch.distributed.tensor`` must be imported to load DTensors",
            "need torch.distributed.tensor (DTensor or nested tensors)",
        ),
        (
            "Weights only load failed. In PyTorch 2.6 ... weights_only ... Please file an issue "
            "with the following so that we can make `weights_only=True` compatible with your "
            "use case: WeightsUnpickler error: \n\nCan only build Tensor, Parameter, OrderedDict "
            "or types allowlisted via `add_safe_globals`, but got <class 'x.Y'>\n\nCheck the "
            "documentation of torch.load",
            "refused as unsafe: Can only build Tensor, Parameter, OrderedDict or types "
            "allowlisted via `add_safe_globals`, but got <class 'x.Y'> (nothing from the file "
            "was run)",
        ),
    ],
)
def test_torch_refusals_are_explained_without_its_advice(message: str, expected: str) -> None:
    text = explain_refusal(message, None)
    assert expected in text
    assert "weights_only" not in text
    assert "\n" not in text
    assert "\x1b" not in text


def test_the_pickle_itself_names_the_global_when_torch_does_not(tmp_path: Path) -> None:
    data = pickle.dumps({"x": OpenMarker(tmp_path / "m")}, protocol=4)
    text = explain_refusal("WeightsUnpickler error: Unsupported operand 149", io.BytesIO(data))
    assert text.startswith('refused as unsafe: the pickle references "io.open"')
    assert not (tmp_path / "m").exists()
