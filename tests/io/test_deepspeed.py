"""DeepSpeed ZeRO stage 1/2 checkpoints, built from DeepSpeed's documented layout.

``deepspeed`` itself is not installed here (PyPI ships it as a source distribution that
compiles against torch, and its CPU path needs oneCCL): the files are written the way
DeepSpeed's ``zero_to_fp32.py`` reads them. Each group's parameters are flattened back to
back, zero-padded, and cut into one equal partition per rank; the moments likewise. The
reader must give every parameter's stats by name, equal to the float64 reference of the
parameter itself, whichever partitions it straddles.
"""

from __future__ import annotations

import math
import sys
import types
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from gradaudit import scan_paths
from gradaudit.errors import InputError
from gradaudit.io import open_source
from gradaudit.io.base import Pieces
from tests.reference import reference_stats

WORLD = 3


def _params() -> list[OrderedDict[str, torch.Tensor]]:
    """Two param groups; sizes chosen so parameters straddle the rank partitions."""
    gen = torch.Generator().manual_seed(4)
    first = OrderedDict(
        [
            ("encoder.weight", torch.randn(7, 5, generator=gen)),
            ("encoder.bias", torch.randn(7, generator=gen) * 1e20),
            ("head.weight", torch.randn(3, 7, generator=gen)),
        ]
    )
    first["encoder.bias"][2] = math.nan
    first["head.weight"][1, 1] = -math.inf
    second = OrderedDict([("norm.weight", torch.ones(7)), ("norm.bias", torch.zeros(7))])
    return [first, second]


def _partitions(group: OrderedDict[str, torch.Tensor], scale: float) -> list[torch.Tensor]:
    flat = torch.cat([t.reshape(-1) * scale for t in group.values()])
    per_rank = -(-flat.numel() // (2 * WORLD)) * 2  # DeepSpeed aligns, then pads with zeros
    padded = torch.cat([flat, torch.zeros(per_rank * WORLD - flat.numel())])
    return [padded[r * per_rank : (r + 1) * per_rank].clone() for r in range(WORLD)]


def write_zero2(directory: Path, extra: object = None) -> list[OrderedDict[str, torch.Tensor]]:
    groups = _params()
    directory.mkdir()
    torch.save(
        {
            "module": OrderedDict((n, t.to(torch.bfloat16)) for g in groups for n, t in g.items()),
            "param_shapes": [OrderedDict((n, t.shape) for n, t in g.items()) for g in groups],
            "buffer_names": [],
            "frozen_param_shapes": None,
            "shared_params": {},
            "ds_version": "0.19.8",
            "global_steps": 10,
            "ds_config": {"zero_optimization": {"stage": 2}},
        },
        directory / "mp_rank_00_model_states.pt",
    )
    masters = [_partitions(g, 1.0) for g in groups]
    averages = [_partitions(g, 0.1) for g in groups]
    squares = [_partitions(g, 0.01) for g in groups]
    for rank in range(WORLD):
        optimizer = {
            "zero_stage": 2,
            "partition_count": [WORLD, WORLD],
            "single_partition_of_fp32_groups": [m[rank] for m in masters],
            "base_optimizer_state": {
                "state": {
                    g: {
                        "step": torch.tensor(10.0),
                        "exp_avg": averages[g][rank],
                        "exp_avg_sq": squares[g][rank],
                    }
                    for g in range(len(groups))
                },
                "param_groups": [{"lr": 1e-3, "params": [g]} for g in range(len(groups))],
            },
        }
        if extra is not None:
            optimizer["loss_scaler"] = extra
        torch.save(
            {"optimizer_state_dict": optimizer, "ds_version": "0.19.8"},
            directory / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        )
    return groups


def test_every_parameter_by_name_equals_its_reference(tmp_path: Path) -> None:
    groups = write_zero2(tmp_path / "global_step10")
    report = scan_paths([tmp_path], device="cpu", recursive=True)
    assert not report.errors
    assert [f.path for f in report.files] == [str(tmp_path / "global_step10")]
    stats = {t.name: t for t in report.tensors}
    for group in groups:
        for name, value in group.items():
            for label, scale in (
                ("fp32_master.", 1.0),
                ("optim.state.", 0.1),
                ("optim.state.", 0.01),
            ):
                key = (
                    f"{label}{name}"
                    if label == "fp32_master."
                    else (f"{label}{name}.{'exp_avg' if scale == 0.1 else 'exp_avg_sq'}")
                )
                got, ref = stats[key], reference_stats(value * scale)
                assert got.shape == tuple(value.shape)
                assert (got.nan, got.pos_inf, got.neg_inf, got.zeros) == (
                    ref.nan,
                    ref.pos_inf,
                    ref.neg_inf,
                    ref.zeros,
                ), key
                assert got.max_abs == ref.max_abs, key
                assert got.norm == pytest.approx(ref.norm, rel=1e-6), key
            assert stats[f"module.{name}"].dtype == "bfloat16"


def test_a_parameter_straddling_partitions_is_read_in_pieces(tmp_path: Path) -> None:
    write_zero2(tmp_path / "ckpt")
    items = list(open_source(tmp_path / "ckpt").items())
    pieces = {i.name: i for i in items if isinstance(i, Pieces)}
    straddling = [p for p in pieces.values() if len(list(p.load())) > 1]
    assert straddling  # 35 + 7 + 21 values over 3 partitions of 22
    assert sum(math.prod(p.shape) for p in pieces.values()) == 3 * (35 + 7 + 21 + 7 + 7)


def test_a_class_the_weights_only_loader_refuses_is_an_input_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = types.ModuleType("deepspeed_fake_loss_scaler")

    class LossScaler:
        def __init__(self) -> None:
            self.cur_scale = 65536.0

    LossScaler.__module__ = module.__name__
    LossScaler.__qualname__ = "LossScaler"
    module.LossScaler = LossScaler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    write_zero2(tmp_path / "ckpt", extra=LossScaler())
    with pytest.raises(InputError) as error:
        list(open_source(tmp_path / "ckpt").items())
    assert "deepspeed_fake_loss_scaler.LossScaler" in error.value.cause
    assert "refused as unsafe" in error.value.cause


def test_a_missing_rank_partition_is_refused(tmp_path: Path) -> None:
    write_zero2(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(InputError, match=r"ranks \[0, 2\]: some are missing"):
        open_source(tmp_path / "ckpt")


@pytest.mark.parametrize("bad", [(-15,), ("abc",), (math.nan,), (torch.tensor([2, 3]),), (True,)])
def test_a_hostile_dimension_in_param_shapes_is_an_input_error(
    tmp_path: Path, bad: tuple[object, ...]
) -> None:
    """A negative dimension shifted every later slot so that no real value was read: the
    honest layout fails on its NaN/Inf, the hostile one exited 0. Now it is refused."""
    directory = tmp_path / "global_step10"
    write_zero2(directory)
    states_path = directory / "mp_rank_00_model_states.pt"
    states = torch.load(states_path, weights_only=False)
    shapes = states["param_shapes"][0]
    shapes[next(iter(shapes))] = bad
    torch.save(states, states_path)
    report = scan_paths([directory], device="cpu")
    (problem,) = report.errors
    assert "dimensions must be integers >= 0" in problem.message
    assert not report.tensors


def test_a_zero_stage_that_is_not_an_integer_is_the_inputs_error(tmp_path: Path) -> None:
    """``zero_stage=[2]`` raised TypeError (unhashable) and ended the run (issue 29 item 4)."""
    write_zero2(tmp_path / "ckpt")
    for path in (tmp_path / "ckpt").glob("*optim_states.pt"):
        state = torch.load(path, weights_only=True)
        state["optimizer_state_dict"]["zero_stage"] = [2]
        torch.save(state, path)
    with pytest.raises(InputError, match=r"zero_stage is .* not an integer"):
        list(open_source(tmp_path / "ckpt").items())
