"""The GPU check's own logic, on plain data: spec lookup, deadline, summary, steps, $OUT's limits.

The whole check end to end (a dry run through Triton's interpreter) is in
``tests/test_benchmarks.py``, marked slow.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import (
    Command,
    Context,
    Deadline,
    Outcome,
    Plan,
    Step,
    Summary,
    figure_of,
    install_commands,
    run_step,
    spec_hbm,
)


@pytest.mark.parametrize(
    ("name", "bandwidth"),
    [
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA H100 NVL", 3.9e12),
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA H200 NVL", 4.8e12),
        ("NVIDIA GH200 480GB", None),  # not an H200: its memory decides
        ("NVIDIA A100-SXM4-80GB", None),
        ("cpu (dry run)", None),
    ],
)
def test_spec_bandwidth_is_looked_up_by_name(name: str, bandwidth: float | None) -> None:
    assert spec_hbm(name) == bandwidth


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_step_gets_what_it_asks_or_what_is_left() -> None:
    clock = FakeClock()
    deadline = Deadline(300, clock)
    assert deadline.timeout_for(120) == 120
    clock.now += 200  # 100 s left, less the margin
    assert deadline.left() == 100
    assert deadline.timeout_for(120) == 100 - gpu_check.MARGIN_S
    clock.now += 100 - gpu_check.MARGIN_S - gpu_check.MIN_STEP_S + 1
    assert deadline.timeout_for(120) is None  # too little left to start a step
    clock.now += 1000
    assert deadline.timeout_for(1) is None


def test_the_summary_has_a_header_a_line_per_step_and_the_counts(tmp_path: Path) -> None:
    summary = Summary(tmp_path / "summary.txt", ["gradaudit GPU check", "budget 450s"])
    summary.record(Outcome("env", "PASS", 2.4, "NVIDIA H200 cc9.0\n132 SMs", "env.txt"))
    summary.record(Outcome("bandwidth", "TIMEOUT", 150, "x" * 300, "bench.txt"))
    summary.record(Outcome("sanitizer", "SKIP", 0, "not on PATH", "sanitizer.txt"))
    assert summary.close(152.6) == "total 153s: 1 pass, 0 fail, 1 timeout, 1 skip"
    lines = (tmp_path / "summary.txt").read_text(encoding="utf-8").splitlines()
    assert lines[:2] == ["# gradaudit GPU check", "# budget 450s"]
    assert lines[2].split() == [
        "PASS",
        "env",
        "2s",
        "NVIDIA",
        "H200",
        "cc9.0",
        "132",
        "SMs",
        "[env.txt]",
    ]
    assert lines[3].startswith("TIMEOUT bandwidth")
    assert lines[3].endswith("...  [bench.txt]")
    assert len(lines[3]) < 260  # one line, the figure cut
    assert lines[4].startswith("SKIP    sanitizer")
    assert lines[5].startswith("total ")


def test_the_figure_is_the_probes_line_and_pytests_count() -> None:
    text = "\n".join(
        [
            "$ python -m pytest",
            "figure: auto -> triton in 37 tests, 120 Triton flushes",
            "=========== 39 passed, 2 skipped in 12.30s ===========",
        ]
    )
    assert figure_of(text) == (
        "auto -> triton in 37 tests, 120 Triton flushes; 39 passed, 2 skipped in 12.30s"
    )
    assert figure_of("39/58 tests collected (19 deselected) in 0.8s") == (
        "39/58 tests collected (19 deselected) in 0.8s"
    )
    assert figure_of("$ nvidia-smi\nsomething broke\n") == "something broke"
    assert figure_of("") == ""


def test_a_cpu_build_of_torch_is_replaced_by_the_pinned_cuda_wheel() -> None:
    first, then = install_commands("py", "2.13.0+cpu")
    assert "--force-reinstall" in first.argv
    assert "torch==2.13.0" in first.argv
    assert "triton==3.8.0" in then.argv
    assert "pytest" in then.argv
    (only,) = install_commands("py", "")
    assert "--force-reinstall" not in only.argv


def test_the_cuda_tests_are_every_marked_module_and_the_two_by_name() -> None:
    files = gpu_check.cuda_test_files()
    assert {"tests/engine/test_cuda.py", "tests/training/test_locate_cuda.py"} <= set(files)
    assert any(name.startswith("tests/integrations/") for name in files)
    assert all((gpu_check.ROOT / name).is_file() for name in files)


def test_out_holds_at_most_eight_flat_plainly_named_files() -> None:
    logs = {step.log for step in gpu_check.STEPS} | {"summary.txt", "console.txt"}
    assert len(logs) <= 8
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in logs)
    names = [step.name for step in gpu_check.STEPS]
    assert len(set(names)) == len(names)


def _context(tmp_path: Path) -> Context:
    return Context(sys.executable, tmp_path, tmp_path / "scratch", dry_run=True)


def _step(*commands: Command, want_s: float = 30) -> Step:
    return Step("demo", "demo.txt", want_s, lambda context: Plan(commands))


def _python(code: str) -> Command:
    return Command((sys.executable, "-c", code))


def test_a_step_passes_fails_or_times_out_and_its_log_keeps_the_output(tmp_path: Path) -> None:
    context, deadline = _context(tmp_path), Deadline(300)
    passed = run_step(_step(_python("print('figure: 3 probes, 0 wrong')")), context, deadline, {})
    assert (passed.status, passed.figure, passed.log) == ("PASS", "3 probes, 0 wrong", "demo.txt")
    failed = run_step(
        _step(_python("import sys; print('broken'); sys.exit(3)"), _python("print('next')")),
        context,
        deadline,
        {},
    )
    assert failed.status == "FAIL"  # and the next command of the step still ran
    slow = _step(_python("print('started', flush=True); import time; time.sleep(60)"), want_s=1)
    timed_out = run_step(slow, context, deadline, {})
    assert timed_out.status == "TIMEOUT"
    assert timed_out.seconds < 20
    log = (tmp_path / "demo.txt").read_text(encoding="utf-8")
    assert "broken" in log
    assert "exit status 3" in log
    assert "next" in log
    assert "started" in log
    assert "timed out" in log


def test_a_missing_optional_program_is_noted_not_failed(tmp_path: Path) -> None:
    missing = Command(("no-such-program-here",), optional=True)
    outcome = run_step(_step(missing), _context(tmp_path), Deadline(300), {})
    assert outcome.status == "PASS"
    required = Command(("no-such-program-here",))
    assert run_step(_step(required), _context(tmp_path), Deadline(300), {}).status == "FAIL"


def test_no_step_starts_past_the_deadline_and_a_skip_says_why(tmp_path: Path) -> None:
    clock = FakeClock()
    deadline = Deadline(10, clock)
    outcome = run_step(_step(_python("print(1)")), _context(tmp_path), deadline, {})
    assert (outcome.status, outcome.figure) == ("SKIP", "no time left before the deadline")
    skipped = Step("s", "s.txt", 30, lambda context: Plan(skip="compute-sanitizer not on PATH"))
    outcome = run_step(skipped, _context(tmp_path), Deadline(300), {})
    assert (outcome.status, outcome.figure) == ("SKIP", "compute-sanitizer not on PATH")


def test_a_broken_plan_is_that_steps_failure(tmp_path: Path) -> None:
    def broken(context: Context) -> Plan:
        raise RuntimeError("no such engine attribute")

    outcome = run_step(Step("b", "b.txt", 30, broken), _context(tmp_path), Deadline(300), {})
    assert outcome.status == "FAIL"
    assert "no such engine attribute" in outcome.figure
