"""A bounded, seeded fuzz of the checkpoint readers at the object level (issue 29).

The byte fuzz (``tests/io/test_fuzz.py``) mostly meets the container's checks: a flipped
byte breaks a CRC or an opcode long before a reader sees a strange *value*. This one
builds valid checkpoints of every layout the readers take — DCP ``.metadata``, DeepSpeed
model and optimizer states, a Trainer ``checkpoint-N/`` (``optimizer.pt``,
``trainer_state.json``), a Lightning ``.ckpt``, a plain ``torch.save`` state dict —
unpickles them, mutates the *objects* (a value replaced by another type, a negative, huge
or NaN number, a nested container, a tensor; a key removed; a key added), saves them
again, and scans each next to a healthy file (``tests/fuzz_worker.py``: one process, one
CLI run per case). For every case: exit code 0, 1 or 3 — never 4, no traceback, no hang,
no signal —, the healthy file reported, and for 3 one stderr line naming the mutated
input. The counts are printed (``pytest -s``) so a note can cite them.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import random
import subprocess
import sys
import warnings
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.io.test_deepspeed import write_zero2

#: Slow (not in the quick loop): 500 mutated checkpoints through a worker process.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SEED = 20260429
#: Cases per layout: 500 in all, about 20 s on one core.
COUNTS = {"dcp": 150, "deepspeed": 80, "trainer_optim": 60, "trainer_state": 60, "lightning": 80}
COUNTS["plain"] = 70


def _hostile_values(rng: random.Random, old: object, json_only: bool) -> object:
    """A value of another type or an absurd one, in place of ``old``."""
    values: list[Any] = [
        None,
        0,
        -1,
        -(2**63),
        2**64,
        10**400,
        float("nan"),
        float("inf"),
        -1e308,
        True,
        "abc",
        "",
        [],
        {},
        [old, old],
        {"x": old},
        [[[[[[[[1]]]]]]]],
    ]
    if not json_only:
        values += [
            b"\x00\xff",
            (old,),
            (0, 2**64),
            (-15,),
            torch.tensor([1.0, float("nan")]),
            torch.tensor(float("inf")),
            torch.tensor([1, 2]),
            torch.zeros(0),
            torch.float16,
            set(),
        ]
    return rng.choice(values)


def _slots(root: object) -> list[tuple[object, object]]:
    """Every ``(container, key)`` whose value can be replaced: dict keys, list indices, the
    attributes of plain objects (DCP records); tuples are replaced whole by their parent."""
    found: list[tuple[object, object]] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen or isinstance(node, str | bytes | torch.Tensor):
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            children = list(node.items())
        elif isinstance(node, list):
            children = list(enumerate(node))
        elif hasattr(node, "__dict__") and not isinstance(node, type):
            children = list(vars(node).items())
        else:
            continue
        for key, value in children:
            found.append((node, key))
            if isinstance(value, tuple):
                stack.extend(value)
            else:
                stack.append(value)
    return found


def _get(node: object, key: object) -> object:
    if isinstance(node, dict | list):
        return node[key]  # type: ignore[index]
    return getattr(node, str(key))


def _set(node: object, key: object, value: object) -> None:
    if isinstance(node, dict | list):
        node[key] = value  # type: ignore[index]
    else:
        object.__setattr__(node, str(key), value)


def mutate(rng: random.Random, root: object, json_only: bool = False) -> str:
    """Apply 1-3 object mutations to ``root`` in place; return what was done."""
    done = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        slots = _slots(root)
        if not slots:
            break
        node, key = rng.choice(slots)
        old = _get(node, key)
        kind = rng.random()
        if kind < 0.12 and isinstance(node, dict):
            del node[key]
            done.append(f"del {key!r}")
        elif kind < 0.2:
            extra = _hostile_values(rng, old, json_only)
            if isinstance(node, dict):
                node[f"extra{rng.randrange(9)}"] = extra
            elif isinstance(node, list):
                node.append(extra)
            else:
                object.__setattr__(node, "get" if rng.random() < 0.5 else "extra", extra)
            done.append(f"add to {type(node).__name__}")
        elif kind < 0.35 and isinstance(old, tuple) and old:
            items = list(old)
            items[rng.randrange(len(items))] = _hostile_values(rng, items[0], json_only)
            _set(node, key, tuple(items))
            done.append(f"{key!r}: tuple item")
        elif kind < 0.45 and isinstance(old, int | float) and not isinstance(old, bool):
            number = rng.choice([-old, old * 2**40, -1, 2**63, math.nan, math.inf, 0.5])
            _set(node, key, number)
            done.append(f"{key!r}: number")
        else:
            _set(node, key, _hostile_values(rng, old, json_only))
            done.append(f"{key!r}: replaced")
    return "; ".join(done)


# -- the valid layouts -------------------------------------------------------------------


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _dcp_base(folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    model, optimizer = _trained()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_sd, "optim": optim_sd, "step": 4}, checkpoint_id=str(folder))
    return folder


def _copy_dir(source: Path, to: Path) -> Path:
    to.mkdir()
    for path in source.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def _lightning(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "epoch": 1,
        "global_step": 10,
        "pytorch-lightning_version": "2.5.0",
        "state_dict": OrderedDict(("model." + k, v) for k, v in model.state_dict().items()),
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 2}}}},
        "callbacks": {},
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [],
        "hyper_parameters": {"lr": 1e-3},
    }


def build_cases(folder: Path) -> list[tuple[str, Path, str]]:
    """``(layout, input, what was mutated)`` for every case, the same on every run."""
    rng = random.Random(SEED)
    model, optimizer = _trained()
    dcp_base = _dcp_base(folder / "dcp_base")
    base_metadata = (dcp_base / ".metadata").read_bytes()
    ds_base = folder / "ds_base"
    write_zero2(ds_base)
    ds_files = {p.name: torch.load(p, weights_only=True) for p in ds_base.iterdir()}
    state_json = {
        "global_step": 20,
        "log_history": [
            {"step": s, "loss": 1.0 / s, "grad_norm": 0.5 + s / 10, "learning_rate": 1e-3}
            for s in range(1, 6)
        ],
        "best_metric": None,
    }
    cases: list[tuple[str, Path, str]] = []
    for layout, count in COUNTS.items():
        for index in range(count):
            name = f"{layout}{index:03d}"
            if layout == "dcp":
                directory = _copy_dir(dcp_base, folder / name)
                for _attempt in range(20):  # DCP's own __getstate__ refuses some values
                    metadata = pickle.loads(base_metadata)  # our own file, made just above
                    what = mutate(rng, metadata)
                    try:
                        data = pickle.dumps(metadata)
                    except Exception:  # noqa: BLE001 - not picklable: mutate again
                        continue
                    break
                (directory / ".metadata").write_bytes(data)
                cases.append((layout, directory, what))
            elif layout == "deepspeed":
                directory = folder / name
                directory.mkdir()
                target = rng.choice(sorted(ds_files))
                what = ""
                for file, value in ds_files.items():
                    if file == target:
                        value = copy.deepcopy(value)
                        what = f"{file}: {mutate(rng, value)}"
                    torch.save(value, directory / file)
                cases.append((layout, directory, what))
            elif layout in ("trainer_optim", "trainer_state"):
                directory = folder / name
                directory.mkdir()
                save_file(model.state_dict(), str(directory / "model.safetensors"))
                optim = copy.deepcopy(optimizer.state_dict())
                state = copy.deepcopy(state_json)
                if layout == "trainer_optim":
                    what = mutate(rng, optim)
                else:
                    what = mutate(rng, state, json_only=True)
                torch.save(optim, directory / "optimizer.pt")
                (directory / "trainer_state.json").write_text(json.dumps(state), "utf-8")
                cases.append((layout, directory, what))
            elif layout == "lightning":
                value = _lightning(copy.deepcopy(model), optimizer)
                value["optimizer_states"] = copy.deepcopy(value["optimizer_states"])
                what = mutate(rng, value)
                path = folder / f"{name}.ckpt"
                torch.save(value, path)
                cases.append((layout, path, what))
            else:
                value = {"model": copy.deepcopy(model.state_dict()), "step": 3, "extra": {}}
                what = mutate(rng, value)
                path = folder / f"{name}.pt"
                torch.save(value, path)
                cases.append((layout, path, what))
    return cases


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[tuple[str, Path, str]], Any]:
    folder = tmp_path_factory.mktemp("object_fuzz")
    good = folder / "good.safetensors"
    save_file({"good.weight": torch.tensor([3.0, 4.0])}, str(good))
    cases = build_cases(folder)
    manifest = folder / "manifest.txt"
    manifest.write_text("\n".join(str(path) for _, path, _ in cases) + "\n", encoding="utf-8")
    worker = subprocess.run(
        [sys.executable, "-m", "tests.fuzz_worker", str(manifest), str(good)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=os.environ.copy(),
        check=False,
    )
    return cases, worker


def test_the_worker_ends_normally(fuzzed: tuple[list[tuple[str, Path, str]], Any]) -> None:
    _, worker = fuzzed
    starts = [line for line in worker.stdout.splitlines() if line.startswith("start ")]
    in_flight = starts[-1] if starts else "before the first case"
    assert worker.returncode == 0, (worker.returncode, in_flight, worker.stderr[-2000:])


def test_every_mutated_object_is_audited_or_refused_as_its_inputs_error(
    fuzzed: tuple[list[tuple[str, Path, str]], Any],
) -> None:
    cases, worker = fuzzed
    outcomes = [json.loads(line) for line in worker.stdout.splitlines() if line.startswith("{")]
    assert [o["path"] for o in outcomes] == [str(path) for _, path, _ in cases]
    codes: Counter[tuple[str, int]] = Counter()
    failures = []
    for (layout, path, what), outcome in zip(cases, outcomes, strict=True):
        problem = _problem(path, outcome)
        if problem is not None:
            failures.append(f"{layout} {path.name} ({what}): {problem}")
            continue
        codes[(layout, outcome["exit_code"])] += 1
    by_code = Counter(code for (_, code), n in codes.items() for _ in range(n))
    print(f"\nobject fuzz: {len(cases)} cases; by exit code {dict(sorted(by_code.items()))}")
    for layout in COUNTS:
        row = {code: n for (lay, code), n in sorted(codes.items()) if lay == layout}
        print(f"  {layout:14s} {row}")
    assert not failures, "\n".join(failures[:20])
    assert by_code[3] > 0  # the mutations reach the readers' checks ...
    assert by_code[0] + by_code[1] > 0  # ... and some leave a file that still audits


def _problem(path: Path, outcome: dict[str, Any]) -> str | None:
    if outcome.get("hang"):
        return "still running after 20 s"
    if outcome["exception"] is not None:
        return f"escaped: {outcome['exception']}"
    code = outcome["exit_code"]
    text = outcome["stdout"] + outcome["stderr"]
    if code not in (0, 1, 3):
        return f"exit {code}: {outcome['stderr'][:300]}"
    if "Traceback" in text:
        return "traceback"
    errors = [line for line in outcome["stderr"].splitlines() if line.startswith("gradaudit: ")]
    if code == 3 and (len(errors) != 1 or not errors[0].startswith(f"gradaudit: error: {path}")):
        return f"exit 3 without one line naming the input: {outcome['stderr'][:300]}"
    if code != 3 and errors:
        return f"exit {code} with {errors[0][:200]}"
    names = [t["name"] for t in json.loads(outcome["stdout"])["tensors"]]
    if "good.weight" not in names:
        return "the healthy file is not reported"
    return None


def test_the_cases_are_the_same_on_every_run(tmp_path: Path) -> None:
    """Seeded: the same mutations each time (the mutated objects, not their bytes: torch
    pickles carry storage keys that may differ)."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first = [(lay, what) for lay, _, what in build_cases(tmp_path / "one")]
    second = [(lay, what) for lay, _, what in build_cases(tmp_path / "two")]
    assert first == second
