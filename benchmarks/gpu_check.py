"""The project's own GPU check: every CUDA-only check and figure, in one run of <= 8 minutes.

    bash benchmarks/gpu_check.sh                # on a machine with an H100/H200: results in $OUT
    GA_DRY_RUN=1 bash benchmarks/gpu_check.sh   # the same logic on a CPU, tiny sizes

A GPU may be lent for minutes only (``docs/gpu.md``, "Running the GPU check"), so the
steps run most valuable first, each under its own timeout and all under one deadline
(``--budget``); a step that fails or times out is recorded and the next one runs.
Each step writes one line into ``summary.txt`` (status, seconds, a one-line figure, the
log it wrote) and appends its output to one of a few logs, so ``$OUT`` holds at most
eight flat files with plain names (what the lending machine sends back).

This module only orchestrates, with the standard library: it must run before torch is
installed. The measurements are ``benchmarks/gpu_probes.py``'s subcommands, the CUDA
tests run under ``benchmarks/force_engine.py``, which pins what ``auto`` picks.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TextIO

ROOT = Path(__file__).resolve().parent.parent

#: The README's pins. On Linux x86-64, PyPI's torch wheel is the CUDA build.
PINS = ("torch==2.13.0", "triton==3.8.0")
#: What the tests import besides torch (the project's dependencies and pytest's).
TEST_DEPS = ("numpy", "safetensors", "typer", "rich", "pytest", "hypothesis")
#: Fail fast where no package registry can be reached (lent machines have none).
PIP = ("-m", "pip", "install", "--quiet", "--retries", "1", "--timeout", "20")

#: Spec HBM bandwidth (bytes/s) by a part of the device's name, most specific first.
SPEC_HBM: tuple[tuple[str, float | None], ...] = (
    ("GH200", None),  # 4.0 or 4.9 TB/s by its memory: the name does not tell which
    ("H200", 4.8e12),  # H200 SXM and NVL: "NVIDIA H200"
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM: "NVIDIA H100 80GB HBM3"
)

#: Seconds kept back from the deadline for the summary; a step gets at least this many.
MARGIN_S = 5.0
MIN_STEP_S = 15.0

Status = Literal["PASS", "FAIL", "TIMEOUT", "SKIP"]


def spec_hbm(device_name: str) -> float | None:
    """The vendor's HBM bandwidth of a device, by its name; ``None`` when not known."""
    for part, bandwidth in SPEC_HBM:
        if part in device_name:
            return bandwidth
    return None


@dataclass
class Deadline:
    """One budget for the whole check; each step's timeout is what it asks, or what is left."""

    budget_s: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def timeout_for(self, want_s: float) -> float | None:
        """The step's timeout: ``want_s`` or what is left less the margin; ``None`` when
        too little is left to start one."""
        left = self.left() - MARGIN_S
        if left < MIN_STEP_S:
            return None
        return min(want_s, left)


@dataclass(frozen=True)
class Outcome:
    """What one step did, as its line in ``summary.txt``."""

    name: str
    status: Status
    seconds: float
    figure: str
    log: str

    def line(self) -> str:
        figure = " ".join(self.figure.split())  # one line, whatever the logs held
        if len(figure) > 200:
            figure = figure[:197] + "..."
        return f"{self.status:<8}{self.name:<22}{self.seconds:5.0f}s  {figure}  [{self.log}]"


class Summary:
    """``summary.txt``: a header, one line per step as it ends (flushed, so a run killed
    from outside keeps what it did), and a count of the statuses."""

    def __init__(self, path: Path, header: Iterable[str]) -> None:
        self.path = path
        self.outcomes: list[Outcome] = []
        path.write_text("".join(f"# {line}\n" for line in header), encoding="utf-8")

    def record(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        self._append(outcome.line())

    def close(self, total_s: float) -> str:
        counts = {status: 0 for status in ("PASS", "FAIL", "TIMEOUT", "SKIP")}
        for outcome in self.outcomes:
            counts[outcome.status] += 1
        text = ", ".join(f"{n} {status.lower()}" for status, n in counts.items())
        line = f"total {total_s:.0f}s: {text}"
        self._append(line)
        return line

    def _append(self, line: str) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")
        print(line, flush=True)


@dataclass(frozen=True)
class Command:
    """One program a step runs. ``optional``: its absence or failure is noted in the log,
    and the step goes on as passed (``nvidia-smi`` on a dry run, the native build)."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    optional: bool = False


@dataclass(frozen=True)
class Plan:
    """What a step will do, decided when it starts: commands, or a skip with its reason."""

    commands: tuple[Command, ...] = ()
    skip: str | None = None
    #: The figure when the plan itself is the result (nothing to install).
    figure: str = ""


@dataclass(frozen=True)
class Context:
    """What every step's plan may depend on."""

    python: str
    out: Path
    scratch: Path
    dry_run: bool

    def probe(self, what: str, *extra: str) -> tuple[str, ...]:
        dry = ("--dry-run",) if self.dry_run else ()
        return (self.python, "-m", "benchmarks.gpu_probes", what, *dry, *extra)

    @property
    def warm_cache(self) -> Path:
        return self.scratch / "triton-warm"

    @property
    def cold_cache(self) -> Path:
        return self.scratch / "triton-cold"


@dataclass(frozen=True)
class Step:
    name: str
    log: str
    want_s: float
    plan: Callable[[Context], Plan]


def run_command(
    command: Command, log: TextIO, timeout_s: float, env: Mapping[str, str]
) -> int | None:
    """Run ``command`` into ``log``; its exit status, or ``None`` when it timed out (then
    its whole process group, which this function started, is ended)."""
    log.write(f"\n$ {' '.join(command.argv)}\n")
    log.flush()
    try:
        process = subprocess.Popen(
            command.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**env, **command.env},
            start_new_session=True,  # a group of its own: a timeout ends its children too
        )
    except FileNotFoundError:
        log.write(f"{command.argv[0]}: not found\n")
        return 0 if command.optional else 127
    try:
        rc = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_group(process)
        log.write(f"\n!! timed out after {timeout_s:.0f}s\n")
        return None
    except BaseException:  # stopped from outside (SIGTERM, Ctrl-C): its group goes too
        end_group(process)
        raise
    if rc and command.optional:
        log.write(f"(optional: exit status {rc} noted, not a failure)\n")
        return 0
    return rc


def end_group(process: subprocess.Popen[bytes]) -> None:
    """End the process group ``run_command`` started (politely first)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=5.0)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


class Stopped(Exception):
    """SIGTERM reached the check (the wrapper's hard stop): the running step is ended."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped(f"signal {signum}")


#: Lines of a step's output its summary quotes: the probes' ``figure:`` lines and
#: pytest's final count (``39 passed, 2 skipped in 12.3s``, ``39/58 tests collected``).
_FIGURE = re.compile(r"^figure: (.*)$")
_PYTEST = re.compile(
    r"^=*\s*(\d+(?:/\d+)? (?:tests? collected|passed|failed|errors?|skipped|deselected)"
    r"|no tests ran).*?=*$"
)


def figure_of(text: str) -> str:
    """The one-line figure of a step's output (see ``_FIGURE``); its last line otherwise."""
    found: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        match = _FIGURE.match(line)
        if match:
            found.append(match.group(1))
        elif _PYTEST.match(line):
            found.append(line.strip("= "))
    if found:
        return "; ".join(found)
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("$ ")]
    return lines[-1].strip() if lines else ""


def run_step(step: Step, context: Context, deadline: Deadline, env: Mapping[str, str]) -> Outcome:
    """Plan and run one step under its timeout; never raises for the step's own failure."""
    started = deadline.elapsed()
    timeout_s = deadline.timeout_for(step.want_s)
    if timeout_s is None:
        return Outcome(step.name, "SKIP", 0.0, "no time left before the deadline", step.log)
    path = context.out / step.log
    with path.open("a", encoding="utf-8") as log:
        log.write(f"\n===== {step.name} (timeout {timeout_s:.0f}s) =====\n")
        log.flush()
        offset = path.stat().st_size  # this step's output starts here (bytes)
        try:
            plan = step.plan(context)
        except Exception as error:  # noqa: BLE001 (a broken plan is this step's failure)
            log.write(f"plan failed: {error!r}\n")
            return Outcome(step.name, "FAIL", deadline.elapsed() - started, repr(error), step.log)
        status: Status = "PASS"
        if plan.skip is not None:
            log.write(f"skipped: {plan.skip}\n")
            status = "SKIP"
        for command in plan.commands:
            left = timeout_s - (deadline.elapsed() - started)
            rc = run_command(command, log, max(left, 1.0), env) if left > 0 else None
            if rc is None:
                status = "TIMEOUT"
                break
            if rc != 0:
                log.write(f"!! exit status {rc}\n")
                status = "FAIL"
    text = path.read_bytes()[offset:].decode("utf-8", errors="replace")
    figure = plan.skip or plan.figure or figure_of(text)
    return Outcome(step.name, status, deadline.elapsed() - started, figure, step.log)


# -- the steps -------------------------------------------------------------------


def _facts(context: Context) -> dict[str, str]:
    """torch's version and whether it sees CUDA, asked of a fresh interpreter."""
    code = (
        "import torch; print(torch.__version__); "
        "print('cuda' if torch.cuda.is_available() else 'no-cuda')"
    )
    try:
        done = subprocess.run(
            [context.python, "-c", code], capture_output=True, text=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        return {"torch": "", "cuda": "no-cuda"}
    lines = done.stdout.split() if done.returncode == 0 else []
    return {"torch": lines[0] if lines else "", "cuda": lines[1] if len(lines) > 1 else "no-cuda"}


def plan_env(context: Context) -> Plan:
    return Plan(
        (
            Command(("uname", "-a"), optional=True),
            Command(("git", "log", "-1", "--format=commit %H %cs %s"), optional=True),
            Command(("nvidia-smi",), optional=True),
            Command(("nvidia-smi", "-q", "-d", "CLOCK,POWER,PERFORMANCE"), optional=True),
            Command(context.probe("env")),
        )
    )


def install_commands(python: str, torch_version: str) -> tuple[Command, ...]:
    """pip commands that bring the README's CUDA torch: a ``+cpu`` build satisfies
    ``torch==2.13.0`` in pip's eyes, so it is replaced explicitly."""
    commands = []
    if "+cpu" in torch_version:
        reinstall = (*PIP, "--force-reinstall", "--no-deps", *PINS)
        commands.append(Command((python, *reinstall)))
    commands.append(Command((python, *PIP, *PINS, *TEST_DEPS)))
    return tuple(commands)


def plan_install(context: Context) -> Plan:
    facts = _facts(context)
    if facts["cuda"] == "cuda":
        native = list((ROOT / "gradaudit" / "engine").glob("_native*.so"))
        build = (context.python, "setup.py", "build_ext", "--inplace")
        return Plan(
            () if native else (Command(build, optional=True),),
            figure=f"torch {facts['torch']} sees CUDA: nothing installed"
            + ("" if native else "; native CPU kernel built"),
        )
    commands = install_commands(context.python, facts["torch"])
    if context.dry_run:
        wanted = " && ".join(" ".join(("python", *c.argv[1:])) for c in commands)
        return Plan(
            skip=f"dry run: torch {facts['torch'] or '(none)'} without CUDA; would run {wanted}"
        )
    return Plan(commands)


def cuda_test_files(tests: Path = ROOT / "tests") -> list[str]:
    """Every test module with a ``cuda``-marked test, and the two CUDA modules by name."""
    named = {"tests/engine/test_cuda.py", "tests/training/test_locate_cuda.py"}
    marked = {
        path.relative_to(tests.parent).as_posix()
        for path in tests.rglob("test_*.py")
        if "pytest.mark.cuda" in path.read_text(encoding="utf-8")
    }
    return sorted(named | marked)


def pytest_command(
    context: Context, files: Sequence[str], engine: str | None, cache: Path, marker: bool
) -> Command:
    argv = [context.python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    argv += ["-p", "benchmarks.force_engine"]
    if marker:
        argv += ["-m", "cuda"]
    if context.dry_run:
        argv.append("--collect-only")
    env = {
        "TRITON_CACHE_DIR": str(cache),
        "GA_CHECK_ENGINE": engine or "",
        "GA_CHECK_REQUIRE_CUDA": "0" if context.dry_run else "1",
    }
    return Command((*argv, *files), env)


def plan_tests(engine: str, cold: bool) -> Callable[[Context], Plan]:
    def plan(context: Context) -> Plan:
        cache = context.cold_cache if cold else context.warm_cache
        commands = [pytest_command(context, cuda_test_files(), engine, cache, marker=True)]
        if engine == "triton" and not cold:  # compiled first: the warm pass is warm
            warm_up = Command(context.probe("warm-up"), {"TRITON_CACHE_DIR": str(cache)})
            commands.insert(0, warm_up)
        return Plan(tuple(commands))

    return plan


def plan_kernel_tests(context: Context) -> Plan:
    files = (
        "tests/engine/test_triton_kernel.py",
        "tests/engine/test_gpu_logic.py",
        # The planned flush on the GPU, its facts read through torch's C shim and its binding.
        "tests/engine/test_triton_plan.py",
        # Its CUDA-graph replay, captured for real.
        "tests/engine/test_triton_graph.py",
        # The exponent histogram's Triton kernel (--precision, a monitor's precision=).
        "tests/engine/test_triton_histogram.py",
    )
    return Plan((pytest_command(context, files, None, context.warm_cache, marker=False),))


def plan_probe(what: str) -> Callable[[Context], Plan]:
    def plan(context: Context) -> Plan:
        return Plan((Command(context.probe(what), {"TRITON_CACHE_DIR": str(context.warm_cache)}),))

    return plan


def plan_sanitizer(context: Context) -> Plan:
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        return Plan(skip="compute-sanitizer not on PATH (no CUDA toolkit)")
    argv = (sanitizer, "--tool", "memcheck", "--print-limit", "20", "--error-exitcode", "1")
    env = {"TRITON_CACHE_DIR": str(context.warm_cache)}
    return Plan((Command((*argv, *context.probe("correctness", "--small")), env),))


#: The kernels the ``kernel-profile`` step asks Nsight Compute about (a regex of names):
#: the histogram, the stats kernels and ``torch.sum``'s, launched by ``gpu_probes kernels``.
PROFILED_KERNELS = "tensor_histogram|table_rows|merge_partials|reduce_kernel"


def plan_kernel_profile(context: Context) -> Plan:
    """Nsight Compute's view of the launches that fell short (``gpu_probes kernels``): speed
    of light, warp stalls, occupancy, memory. Without ``ncu`` the launches run unprofiled
    (their logic checked, nothing learnt)."""
    env = {"TRITON_CACHE_DIR": str(context.warm_cache)}
    ncu = shutil.which("ncu")
    if ncu is None:
        return Plan((Command(context.probe("kernels"), env),))
    sections = (
        "SpeedOfLight",
        "WarpStateStats",
        "Occupancy",
        "LaunchStats",
        "MemoryWorkloadAnalysis",
    )
    argv = [ncu, "--target-processes", "all", "--clock-control", "none"]
    argv += ["--kernel-name", f"regex:{PROFILED_KERNELS}"]
    for section in sections:
        argv += ["--section", section]
    return Plan((Command((*argv, *context.probe("kernels")), env),))


#: Most valuable first: the deadline cuts the tail. Logs are shared (at most 8 files).
STEPS: tuple[Step, ...] = (
    Step("env", "env.txt", 45, plan_env),
    Step("install", "env.txt", 240, plan_install),
    Step("tests-triton-warm", "tests.txt", 120, plan_tests("triton", cold=False)),
    Step("correctness", "probes.txt", 120, plan_probe("correctness")),
    Step("bandwidth", "bench.txt", 150, plan_probe("bandwidth")),
    Step("launch-shapes", "bench.txt", 120, plan_probe("launch-shapes")),
    Step("histogram", "bench.txt", 90, plan_probe("histogram")),
    Step("host-cost", "bench.txt", 60, plan_probe("host-cost")),
    Step("host-profile", "bench.txt", 60, plan_probe("host-profile")),
    Step("graph", "bench.txt", 60, plan_probe("graph")),
    Step("kernel-profile", "bench.txt", 120, plan_kernel_profile),
    Step("tests-kernel", "tests.txt", 120, plan_kernel_tests),
    Step("sanitizer", "sanitizer.txt", 90, plan_sanitizer),
    # Passed on every card so far (2026-11-27): what the deadline may cut first.
    Step("tests-triton-cold", "tests.txt", 100, plan_tests("triton", cold=True)),
    Step("tests-eager", "tests.txt", 100, plan_tests("eager", cold=False)),
)


def child_env(dry_run: bool) -> dict[str, str]:
    """The steps' environment: this checkout first on the path, Triton compiled for
    real (or interpreted, on a dry run), output unbuffered (a killed step keeps its log)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TRITON_INTERPRET", None)
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
        env["GA_DRY_RUN"] = "1"
    return env


def commit() -> str:
    """The checkout's commit (``-dirty`` with local changes), or ``unknown``."""
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def tree() -> str:
    """Git's id of the files as they are (every file git does not ignore, through a scratch
    index), or ``unknown``. It equals a commit's tree id (``git log --format='%h %T'``)
    when the files are that commit's, whatever commit the checkout's ``.git`` names: a lent
    machine's copy of ``.git`` can be older than the files sent with it (on 2026-11-27 the
    header said ``7b80a51-dirty`` for the files of ``c561162``)."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        try:
            for argv in (["git", "add", "--all"], ["git", "write-tree"]):
                done = subprocess.run(
                    argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=60, check=True
                )
        except (OSError, subprocess.SubprocessError):
            return "unknown"
    return done.stdout.strip()[:12]


def run(
    context: Context, deadline: Deadline, steps: Sequence[Step], only: Sequence[str] = ()
) -> Summary:
    dry = " (DRY RUN on the CPU: figures mean nothing)" if context.dry_run else ""
    header = [
        f"gradaudit GPU check{dry}, commit {commit()}, tree {tree()}",
        f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, budget {deadline.budget_s:.0f}s",
        "status  step                  time  figure  [log]",
    ]
    summary = Summary(context.out / "summary.txt", header)
    env = child_env(context.dry_run)
    for step in steps:
        if only and step.name not in only:
            continue
        summary.record(run_step(step, context, deadline, env))
    summary.close(deadline.elapsed())
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for every step")
    parser.add_argument(
        "--dry-run", action="store_true", default=os.environ.get("GA_DRY_RUN") == "1"
    )
    parser.add_argument("--scratch", type=Path, default=None, help="Triton caches (not in --out)")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated steps to run (a short rerun): "
        + ",".join(step.name for step in STEPS),
    )
    args = parser.parse_args(argv)
    only = [name for name in args.only.split(",") if name]
    unknown = set(only) - {step.name for step in STEPS}
    if unknown:
        parser.error(f"no such step: {', '.join(sorted(unknown))}")
    deadline = Deadline(args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    context = Context(sys.executable, args.out.resolve(), scratch.resolve(), args.dry_run)
    # The steps run in sessions of their own (so a timeout ends their children): a hard
    # stop from outside must reach them through this process.
    signal.signal(signal.SIGTERM, _stop)
    try:
        summary = run(context, deadline, STEPS, only)
    except Stopped as stop:
        print(f"gpu_check: stopped ({stop}); summary.txt holds the steps that ended")
        return 124
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0 if all(o.status in ("PASS", "SKIP") for o in summary.outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
