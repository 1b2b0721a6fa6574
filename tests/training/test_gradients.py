"""collect_module: gradients by parameter name, collected without a host read."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gradaudit import audit, collect_module, named_gradients
from tests.ranks import single_rank_group
from tests.reference import reference_stats


def model_with_grads() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    return model


def test_module_gradients_by_name_match_the_reference() -> None:
    model = model_with_grads()
    model[0].weight.grad[1, 2] = math.nan  # type: ignore[index]
    report = collect_module(model).materialize()
    assert [t.name for t in report.tensors] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for stats, (_, param) in zip(report.tensors, model.named_parameters(), strict=True):
        assert param.grad is not None
        ref = reference_stats(param.grad)
        assert stats.nan == ref.nan
        assert stats.norm == pytest.approx(ref.norm, rel=1e-12)
        assert stats.shape == tuple(param.shape)
    assert report.tensors[0].nan == 1


def test_prefix_and_parameters_without_grad() -> None:
    model = model_with_grads()
    model[2].bias.grad = None
    model[0].bias.requires_grad_(False)
    model[0].bias.grad = None
    names = [t.name for t in collect_module(model, prefix="student").materialize().tensors]
    assert names == ["student.0.weight", "student.2.weight"]


def test_iterables_of_parameters_and_of_pairs() -> None:
    model = model_with_grads()
    bare = collect_module(model.parameters()).materialize()
    assert [t.name for t in bare.tensors] == ["param.0", "param.1", "param.2", "param.3"]
    prefixed = collect_module(list(model.parameters()), prefix="opt").materialize()
    assert [t.name for t in prefixed.tensors][:2] == ["opt.0", "opt.1"]
    pairs = collect_module(model.named_parameters()).materialize()
    assert [t.name for t in pairs.tensors] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    mapping = collect_module(dict(model.named_parameters())).materialize()
    assert [t.norm for t in mapping.tensors] == [t.norm for t in pairs.tensors]


def test_tied_parameter_is_counted_once() -> None:
    model = model_with_grads()
    params = [*model.parameters(), model[0].weight]
    report = collect_module(params).materialize()
    assert len(report.tensors) == 4
    grads = {n: g for n, g in named_gradients(model)}
    assert report.summary.global_norm == pytest.approx(audit(grads).summary.global_norm)


def test_bad_item_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="got an item of type int"):
        collect_module([1, 2])  # type: ignore[list-item]


def test_collection_never_reads_the_device() -> None:
    """On ``meta`` every host read raises, so collecting there proves there is none."""
    model = torch.nn.Linear(3, 2, device="meta")
    for param in model.parameters():
        param.grad = torch.empty_like(param)
    pending = collect_module(model)
    assert len(pending) == 2
    assert {row.device.type for row in pending.rows} == {"meta"}


def test_prefetch_off_cuda_changes_nothing() -> None:
    model = model_with_grads()
    pending = collect_module(model)
    pending.prefetch()  # CPU rows need no copy
    prefetched = pending.materialize()
    plain = collect_module(model).materialize()
    assert prefetched.tensors == plain.tensors
    assert prefetched.summary == plain.summary
    meta = torch.nn.Linear(2, 2, device="meta")
    for param in meta.parameters():
        param.grad = torch.empty_like(param)
    collect_module(meta).prefetch()  # nothing to copy from meta either


def test_ddp_dataparallel_and_compile_wrappers_add_no_prefix(tmp_path: Path) -> None:
    """``module.`` (DDP, DataParallel) and ``_orig_mod.`` (torch.compile) are not part of the
    names: dumps and reports match the wrapped module's checkpoint and the callbacks."""
    from gradaudit import GradientMonitor, named_gradients

    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    inner(torch.randn(4, 3)).sum().backward()
    expected = [name for name, _ in inner.named_parameters()]
    with single_rank_group(tmp_path):
        ddp = torch.nn.parallel.DistributedDataParallel(inner)
        wrappers = [ddp, torch.nn.DataParallel(inner), torch.compile(inner), torch.compile(ddp)]
        for wrapped in wrappers:
            assert next(n for n, _ in wrapped.named_parameters()) != expected[0]
            assert [name for name, _ in named_gradients(wrapped)] == expected
        record = GradientMonitor(ddp, every=1, sync=True, dump_dir=None).step()
    assert record is not None
    assert list(record.norms) == expected


def test_gradient_lister_follows_every_change_of_the_module() -> None:
    """The monitor's cached walk (issue 28 item 9) lists what named_gradients lists, after
    each way a module's parameters change between steps."""
    from torch.nn.utils import parametrize

    from gradaudit.training.gradients import GradientLister

    def same(lister: GradientLister, model: torch.nn.Module) -> None:
        listed, walked = lister(), named_gradients(model, prefix="m")
        assert [name for name, _ in listed] == [name for name, _ in walked]
        assert all(a is b for (_, a), (_, b) in zip(listed, walked, strict=True))

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    def backward(model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        model(torch.randn(5, 4)).sum().backward()

    model = model_with_grads()
    lister = GradientLister(model, prefix="m")
    same(lister, model)
    backward(model)  # fresh grad tensors
    same(lister, model)
    model[2].bias.grad = None  # type: ignore[union-attr]
    same(lister, model)
    model[0].weight = torch.nn.Parameter(torch.randn(3, 4))  # replaced: no grad yet
    same(lister, model)
    backward(model)
    same(lister, model)
    model[1].scale = torch.nn.Parameter(torch.ones(1))  # registered on a module that had none
    model[1].scale.grad = torch.ones(1)
    same(lister, model)
    del model[0].bias  # type: ignore[union-attr]
    model[0].register_parameter("bias", None)  # deleted, then None under the same name
    model[0].other = torch.nn.Parameter(torch.ones(3))
    model[0].other.grad = torch.ones(3)
    same(lister, model)
    model.append(torch.nn.Linear(2, 2))  # a submodule added
    backward(model)
    same(lister, model)
    model[3] = torch.nn.Linear(2, 2)  # a submodule swapped
    backward(model)
    same(lister, model)
    parametrize.register_parametrization(model[3], "weight", Double())
    backward(model)
    same(lister, model)
    tied = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    lister = GradientLister(tied, prefix="m")
    tied(torch.randn(3, 2)).sum().backward()
    same(lister, tied)  # a tied parameter once
    params = list(tied.parameters())
    assert GradientLister(params)() == named_gradients(params)
