"""Walking loaded checkpoints: path names, skipped values, optimizer state -> parameter."""

from __future__ import annotations

import math
from typing import Any

import torch

from gradaudit.io.base import Excluded
from gradaudit.io.checkpoint_tree import MAX_DEPTH
from gradaudit.io.nested import ROOT_NAME, iter_tensors, walk_checkpoint
from gradaudit.results import Skipped
from tests.torch_features import requires_named_optimizers


def walk(obj: object, select: Any = None) -> tuple[list[str], dict[str, str], list[str]]:
    """(audited names, skipped name -> reason, excluded names)."""
    tensors: list[str] = []
    skipped: dict[str, str] = {}
    excluded: list[str] = []
    for item in walk_checkpoint(obj, "ckpt.pt", select):
        if isinstance(item, Skipped):
            assert item.source == "ckpt.pt"
            skipped[item.name] = item.reason
        elif isinstance(item, Excluded):
            excluded.append(item.name)
        else:
            tensors.append(item[0])
    return tensors, skipped, excluded


def trained(named: bool = False, groups: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model after one AdamW step (so every parameter has optimizer state)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    params: Any
    if groups == 2:
        params = [
            {"params": [model[2].weight, model[2].bias]},
            {"params": [model[0].weight, model[0].bias], "lr": 0.1},
        ]
    else:
        params = model.named_parameters() if named else model.parameters()
    optimizer = torch.optim.AdamW(params)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_nested_training_checkpoint_is_named_by_path() -> None:
    model, optimizer = trained()
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7}
    tensors, skipped, _ = walk(checkpoint)
    assert tensors[:4] == ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"]
    assert "optimizer.state.0.exp_avg_sq (model.0.weight)" in tensors
    assert "optimizer.state.3.exp_avg (model.2.bias)" in tensors
    assert len(tensors) == 4 + 4 * 2
    assert skipped["step"] == "int value, not a tensor; not audited"
    assert skipped["optimizer.param_groups"] == "list of 1 value, no tensor; not audited"
    assert skipped["optimizer.state.0.step (model.0.weight)"] == (
        "optimizer step counter; not audited"
    )


@requires_named_optimizers
def test_param_names_in_the_param_groups_are_used_exactly() -> None:
    model, optimizer = trained(named=True)
    # Two state dicts (an EMA copy) would make a positional guess ambiguous; names are exact.
    ema = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint = {
        "model": model.state_dict(),
        "ema": ema,
        "optimizer_states": [optimizer.state_dict()],
    }
    tensors, _, _ = walk(checkpoint)
    assert "optimizer_states.0.state.2.exp_avg (2.weight)" in tensors
    assert "ema.2.weight" in tensors


def test_no_annotation_when_two_state_dicts_make_position_ambiguous() -> None:
    model, optimizer = trained()
    ema = {k: v.clone() for k, v in model.state_dict().items()}
    tensors, _, _ = walk({"model": model.state_dict(), "ema": ema, "opt": optimizer.state_dict()})
    assert "opt.state.0.exp_avg" in tensors
    assert not any("(" in name for name in tensors)


def test_no_annotation_with_several_param_groups() -> None:
    # Group order need not follow the model's order: here the second layer comes first.
    model, optimizer = trained(groups=2)
    tensors, _, _ = walk({"model": model.state_dict(), "opt": optimizer.state_dict()})
    assert "opt.state.0.exp_avg" in tensors
    assert not any("(" in name for name in tensors)


def test_no_annotation_when_a_shape_disagrees() -> None:
    model, optimizer = trained()
    state = optimizer.state_dict()
    state["state"][1]["exp_avg"] = torch.zeros(7)
    state["state"][1]["exp_avg_sq"] = torch.zeros(7)
    tensors, _, _ = walk({"model": model.state_dict(), "opt": state})
    assert not any("(" in name for name in tensors)


def test_no_annotation_when_counts_disagree() -> None:
    model, optimizer = trained()
    weights = model.state_dict()
    weights["extra_buffer"] = torch.zeros(3)  # a float buffer the optimizer does not know
    tensors, _, _ = walk({"model": weights, "opt": optimizer.state_dict()})
    assert not any("(" in name for name in tensors)


def test_step_is_only_skipped_inside_optimizer_state() -> None:
    _, skipped_none, _ = walk({"step": torch.tensor(5.0)})
    assert skipped_none == {}
    tensors, _, _ = walk({"step": torch.tensor(5.0)})
    assert tensors == ["step"]


def test_tied_and_repeated_tensors_are_audited_once() -> None:
    weight = torch.randn(4, 4)
    checkpoint = {"embed.weight": weight, "head.weight": weight, "view": weight[1:]}
    tensors, skipped, _ = walk(checkpoint)
    assert tensors == ["embed.weight", "view"]
    assert skipped == {"head.weight": 'same data as "embed.weight" (tied or shared); audited once'}


def test_same_container_reached_twice_is_listed_once() -> None:
    shared = {"w": torch.ones(2)}
    tensors, skipped, _ = walk({"a": shared, "b": shared})
    assert tensors == ["a.w"]
    assert skipped == {"b": 'the same object as "a"; listed once'}


def test_cycles_and_deep_nesting_terminate() -> None:
    cyclic: list[object] = [torch.ones(1)]
    cyclic.append(cyclic)
    deep: list[object] = []
    cursor = deep
    for _ in range(100_000):  # far beyond Python's recursion limit
        inner: list[object] = []
        cursor.append(inner)
        cursor = inner
    cursor.append(torch.ones(1))
    tensors, skipped, _ = walk({"cyclic": cyclic, "deep": deep})
    assert tensors == ["cyclic.0"]
    assert skipped["cyclic.1"] == 'the same object as "cyclic"; listed once'
    (deep_name,) = [name for name in skipped if name.startswith("deep")]
    assert deep_name.count(".") == MAX_DEPTH - 1  # "deep" is at depth 1
    assert "nested deeper than" in skipped[deep_name]


def test_keys_that_are_not_text_and_colliding_names() -> None:
    checkpoint = {
        "a.b": torch.ones(1),
        "a": {"b": torch.zeros(1)},
        3: torch.ones(1),
        (1, 2): torch.ones(1),
        None: torch.ones(1),
    }
    tensors, _, _ = walk(checkpoint)
    assert tensors == ["a.b", "a.b#2", "3", "<tuple>", "None"]


def test_a_lone_tensor_and_a_tensor_free_file() -> None:
    assert walk(torch.ones(2)) == ([ROOT_NAME], {}, [])
    tensors, skipped, _ = walk(
        {"lr": 0.1, "milestones": [1, 2], "name": "x", "size": torch.Size([2, 3])}
    )
    assert tensors == []
    assert skipped == {
        "lr": "float value, not a tensor; not audited",
        "milestones": "list of 2 values, no tensor; not audited",
        "name": "str value, not a tensor; not audited",
        "size": "Size of 2 values, not a tensor; not audited",
    }


def test_meta_tensors_and_subclasses_are_skipped_with_a_reason() -> None:
    class Tagged(torch.Tensor):
        pass

    tagged = torch.ones(2).as_subclass(Tagged)
    tensors, skipped, _ = walk(
        {"m": torch.empty(2, device="meta"), "t": tagged, "p": torch.nn.Parameter(torch.ones(1))}
    )
    assert tensors == ["p"]
    assert skipped == {
        "m": "meta tensor (it holds no data); not audited",
        "t": "tensor subclass Tagged; not audited",
    }


def test_select_sees_the_plain_path_and_excludes_before_anything_else() -> None:
    model, optimizer = trained()
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7}
    tensors, skipped, excluded = walk(checkpoint, lambda name: name.startswith("optimizer."))
    assert "model.0.weight" in excluded
    assert "step" in excluded
    assert "optimizer.state.0.exp_avg (model.0.weight)" in tensors
    assert all(name.startswith("optimizer.") for name in [*tensors, *skipped])
    only_exp_avg, _, _ = walk(checkpoint, lambda name: name.endswith(".exp_avg"))
    assert len(only_exp_avg) == 4  # the pattern ignores the "(param)" annotation


def test_iter_tensors_yields_every_tensor_object_including_meta() -> None:
    meta = torch.empty(3, device="meta")
    found = list(iter_tensors({"a": [meta, torch.ones(1)], "b": 3}))
    assert len(found) == 2
    assert found[0] is meta


def test_lightning_bookkeeping_is_listed_once_and_never_walked() -> None:
    """A Lightning checkpoint's callbacks, loops and schedulers are trainer bookkeeping:
    ``ModelCheckpoint``'s ``kth_value`` is ``inf`` before any top-k exists."""
    weight = torch.ones(2, 2)
    callback = {"kth_value": torch.tensor(float("inf")), "best_k_models": {}}
    lightning = {
        "epoch": 0,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {"net.weight": weight},
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": callback},
        "lr_schedulers": [],
    }
    tensors, skipped, _ = walk(lightning)
    assert tensors == ["state_dict.net.weight"]
    assert "Lightning callback state" in skipped["callbacks"]
    assert "Lightning loop progress" in skipped["loops"]
    assert not any(name.startswith("callbacks.") for name in skipped)
    # The same keys in a checkpoint that is not Lightning's are walked as usual.
    plain = {"model": {"net.weight": weight}, "callbacks": {"kth": callback["kth_value"]}}
    assert walk(plain)[0] == ["model.net.weight", "callbacks.kth"]


def test_an_expanded_view_is_skipped_unread_not_reduced() -> None:
    """``torch.zeros(1).expand(2**40)`` is 1.5 KB in a file; reducing it would read 2**40
    elements. It is skipped as unread (a ``skipped`` finding), a plain view is audited."""
    bomb = torch.zeros(1).expand(2**40)
    items = list(walk_checkpoint({"bomb": bomb, "view": torch.ones(4, 4)[1:]}, "ckpt.pt"))
    (skipped,) = [item for item in items if isinstance(item, Skipped)]
    assert skipped.name == "bomb"
    assert skipped.unaudited
    assert "expanded view: 1,099,511,627,776 elements over 1 stored" in skipped.reason
    assert [item[0] for item in items if isinstance(item, tuple)] == ["view"]


def test_a_quantized_tensor_is_judged_as_the_values_it_stands_for() -> None:
    """A NaN scale dequantizes to all-NaN; as int8 codes it read as 'not floating-point'."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized creation is deprecated
        codes = torch.randn(3, 4)
        bad = torch.quantize_per_tensor(codes, scale=math.nan, zero_point=0, dtype=torch.qint8)
        good = torch.quantize_per_tensor(codes, scale=0.1, zero_point=0, dtype=torch.qint8)
    items = dict(
        item
        for item in walk_checkpoint({"bad": bad, "good": good}, "q.pt")
        if isinstance(item, tuple)
    )
    assert items["bad"].dtype == torch.float32
    assert bool(items["bad"].isnan().all())
    assert torch.equal(items["good"], good.dequantize())


def test_a_lightning_callback_holding_model_weights_is_walked() -> None:
    """An EMA / weight-averaging callback keeps a copy of the model under ``callbacks``:
    that is model state, audited; ModelCheckpoint's scalars beside it are bookkeeping."""
    lightning = {
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {"net.weight": torch.ones(2, 2)},
        "callbacks": {
            "ModelCheckpoint{'monitor': None}": {"kth_value": torch.tensor(float("inf"))},
            "EMA": {"ema_state_dict": {"net.weight": torch.ones(2, 2)}},
        },
    }
    tensors, skipped, _ = walk(lightning)
    assert tensors == ["state_dict.net.weight", "callbacks.EMA.ema_state_dict.net.weight"]
    assert "Lightning callback state" in skipped["callbacks.ModelCheckpoint{'monitor': None}"]


def test_an_optimizer_step_too_large_for_a_float_is_not_read_as_a_number() -> None:
    """``step=10**400`` in an optimizer state ended the whole run in exit 4 (OverflowError)."""
    model, optimizer = trained()
    state = optimizer.state_dict()
    state["state"][0]["step"] = 10**400
    hints: dict[str, Any] = {}
    items = list(
        walk_checkpoint({"model": model.state_dict(), "optimizer": state}, "c", None, hints)
    )
    assert any(
        isinstance(item, tuple) and item[0].startswith("optimizer.state.0.") for item in items
    )
