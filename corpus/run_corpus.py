"""Scan every artifact of the corpus and print the confusion table (issue 26).

    python corpus/run_corpus.py [OUTDIR] [--gradaudit CMD] [--markdown FILE] [--jobs N]

For each artifact in ``OUTDIR/manifest.json`` it runs ``CMD scan PATH`` (the table
a person reads) and ``CMD scan PATH --format json`` (what it found, tensor by
tensor), each under a timeout, and compares the exit code with the expected one.
It also checks *why*: a failing verdict must name the broken parameter (or the
logged step), and the file must be read in the right role; a pass for a wrong
reason is counted apart. Outputs are kept under ``OUTDIR/results/``.

Exit status: 0 when every verdict is as expected, 1 otherwise (the "before"
table of issue 26 exits 1 on purpose), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_OUTDIR = Path.home() / ".cache" / "gradaudit-corpus"
DEFAULT_CMD = f"{shlex.quote(sys.executable)} -m gradaudit"

#: What ``files[].read_as`` must say for each role of the manifest (None: not checked).
READ_AS: dict[str, str | None] = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer state": "optimizer state",
    "training checkpoint": "training checkpoint",
    "trainer history": None,
    "non-model state": None,
    "torchscript": None,
}
#: Optimizer-state entry names (Adam, AdamW, SGD momentum, RMSprop).
OPTIMIZER_KEYS = re.compile(
    r"(^|\.)(exp_avg|exp_avg_sq|max_exp_avg_sq|momentum_buffer|square_avg|grad_avg)$"
)
#: gradaudit shows an optimizer entry with its parameter: ``state.0.exp_avg (fc1.weight)``.
PARAM_SUFFIX = re.compile(r"\s+\([^()]*\)$")
#: What the files inside a training-checkpoint directory may be read as.
CHECKPOINT_PARTS = {"training checkpoint", "weights", "optimizer state", "nothing"}


@dataclass
class Outcome:
    """One artifact's verdict against the manifest."""

    path: str
    kind: str
    condition: str
    role: str
    expected: int
    got: int | None
    json_exit: int | None = None
    warnings: int | None = None
    failing: int | None = None
    read_as: str = ""
    evidence_thin: bool | None = None
    named: bool | None = None
    role_ok: bool | None = None
    role_errors: int = 0
    seconds: float = 0.0
    causes: list[str] = field(default_factory=list)
    fail_kinds: list[str] = field(default_factory=list)
    #: Warning findings by kind (outlier, all-zero, ...), and the first few in full.
    warn_kinds: dict[str, int] = field(default_factory=dict)
    warn_lines: list[str] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """ok, false FAIL, miss, wrong reason, false error, timeout, mismatch."""
        if self.got is None:
            return "timeout"
        if self.expected == self.got:
            # NaN and Inf fail in any role; every other check depends on the role read.
            role_dependent = bool(set(self.fail_kinds) - {"nan", "inf"})
            if self.got == 1 and (
                self.named is False or (self.role_ok is False and role_dependent)
            ):
                return "wrong reason"
            return "ok"
        if self.expected == 0 and self.got == 1:
            return "false FAIL"
        if self.expected == 1 and self.got == 0:
            return "miss"
        if self.got >= 3 and self.expected < 3:
            return "false error"
        return "mismatch"


def run(cmd: Sequence[str], cwd: Path, timeout: float) -> tuple[int | None, str, str, float]:
    """Run in OUTDIR with the artifact's relative path: the output reads like the manifest."""
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False, cwd=cwd
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out, "timeout", time.perf_counter() - t0
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0


def failing_texts(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(name, kind, "name [role]: kind: message") of each finding that fails the run.

    Exceeded run-level limits count too, under their file's name.
    """
    found = [
        (str(lim["file"]), str(lim["kind"]), f"{lim['file']} [limit]: {lim['message']}")
        for lim in doc.get("limits", [])
    ]
    for section in ("tensors", "skipped"):
        for item in doc.get(section, []):
            for f in item.get("findings", []):
                if f.get("severity") == "error":
                    name, role = str(item["name"]), item.get("role", section)
                    found.append(
                        (name, str(f["kind"]), f"{name} [{role}]: {f['kind']}: {f['message']}")
                    )
    # A logged training history (trainer_state.json), where the report has one.
    for item in doc.get("history", []):
        for f in item.get("findings", []):
            if f.get("severity") == "error":
                name = str(f.get("name", item.get("file")))
                found.append(
                    (name, str(f["kind"]), f"{name} [history]: {f['kind']}: {f['message']}")
                )
    return found


def warning_texts(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(kind, "name [role]: kind: message") for each warning finding."""
    found = []
    for section in ("tensors", "skipped"):
        for item in doc.get(section, []):
            for f in item.get("findings", []):
                if f.get("severity") == "warning":
                    name, role = str(item["name"]), item.get("role", section)
                    found.append((f["kind"], f"{name} [{role}]: {f['kind']}: {f['message']}"))
    return found


def role_errors(doc: dict[str, Any], role: str) -> int:
    """Tensors read in a role their artifact and name rule out.

    In a gradient dump every tensor is a gradient; in weights, checkpoints and
    optimizer state, optimizer entries (``exp_avg`` ...) are optimizer state and
    nothing else is a gradient.
    """
    wrong = 0
    for t in doc.get("tensors", []):
        got = str(t.get("role", ""))
        if role == "gradients":
            wrong += got != "gradient"
            continue
        is_opt_name = bool(OPTIMIZER_KEYS.search(PARAM_SUFFIX.sub("", t["name"])))
        if is_opt_name != got.startswith("optimizer") or got == "gradient":
            wrong += 1
    return wrong


def scan_both(
    art: dict[str, Any], outdir: Path, results: Path, cmd: Sequence[str], timeout: float
) -> tuple[int | None, str, int | None, str, float]:
    """(exit, table output, JSON exit, JSON text, seconds); kept under ``results``."""
    slug = art["path"].replace("/", "__")
    rc, out, err, secs = run([*cmd, "scan", art["path"]], outdir, timeout)
    text = f"{out}\n--- stderr\n{err}"
    (results / f"{slug}.txt").write_text(f"$ exit {rc}\n{text}")
    jrc, jout, _, _ = run([*cmd, "scan", art["path"], "--format", "json"], outdir, timeout)
    (results / f"{slug}.json").write_text(jout)
    return rc, text, jrc, jout, secs


def reuse_both(
    art: dict[str, Any], results: Path
) -> tuple[int | None, str, int | None, str, float]:
    """The same from an earlier run's files (``--reuse``): judge again without scanning."""
    slug = art["path"].replace("/", "__")
    first, _, text = (results / f"{slug}.txt").read_text().partition("\n")
    code = first.removeprefix("$ exit ")
    rc = None if code == "None" else int(code)
    jout = (results / f"{slug}.json").read_text()
    try:
        jrc: int | None = int(json.loads(jout)["exit_code"])
    except (ValueError, KeyError):
        jrc = None
    return rc, text, jrc, jout, 0.0


def judge(
    art: dict[str, Any],
    outdir: Path,
    results: Path,
    cmd: Sequence[str],
    timeout: float,
    reuse: bool = False,
) -> Outcome:
    path = outdir / art["path"]
    oc = Outcome(
        art["path"], art["kind"], art["condition"], art["role"], art["expected_exit"], None
    )
    if reuse:
        rc, text, jrc, jout, secs = reuse_both(art, results)
    else:
        rc, text, jrc, jout, secs = scan_both(art, outdir, results, cmd, timeout)
    oc.got, oc.seconds, oc.json_exit = rc, secs, jrc
    oc.tail = [ln for ln in text.splitlines() if ln.strip()][-12:]
    try:
        doc = json.loads(jout)
    except ValueError:
        doc = None
    if doc is not None:
        summary = doc.get("summary", {})
        oc.warnings = summary.get("warnings")
        oc.failing = summary.get("failing_findings")
        files = doc.get("files", [])
        oc.read_as = ",".join(sorted({str(f.get("read_as")) for f in files}))
        oc.evidence_thin = any(bool(f.get("evidence_thin")) for f in files)
        fails = failing_texts(doc)
        oc.fail_kinds = sorted({kind for _, kind, _ in fails})
        warns = warning_texts(doc)
        oc.warn_kinds = dict(Counter(k for k, _ in warns))
        oc.warn_lines = [t for _, t in warns[:3]]
        oc.causes = [t for _, _, t in fails]
        oc.causes += [f"error: {e['message']}" for e in doc.get("errors", [])]
        want_role = READ_AS.get(art["role"])
        if want_role is not None and files:
            allowed = CHECKPOINT_PARTS if path.is_dir() else {want_role}
            if art["role"] != "training checkpoint":
                allowed = {want_role, "nothing"} if path.is_dir() else {want_role}
            oc.role_errors = role_errors(doc, art["role"])
            oc.role_ok = oc.role_errors == 0 and all(f.get("read_as") in allowed for f in files)
        if art["expected_exit"] == 1:
            names = art.get("expected_names") or []
            step = art.get("expected_step")
            hit = any(n in name for n in names for name, _, _ in fails)
            if step is not None:
                pattern = re.compile(rf"step\D{{0,3}}{step}\b", re.IGNORECASE)
                hit = hit or any(pattern.search(t) for _, _, t in fails)
            oc.named = hit if (names or step is not None) else None
    return oc


def md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def render(
    outcomes: list[Outcome], cmd: str, baseline: dict[str, dict[str, Any]] | None = None
) -> tuple[str, str]:
    """(plain text table, Markdown document); ``baseline``: an earlier run, by path."""
    counts = Counter(o.verdict for o in outcomes)
    healthy = [o for o in outcomes if o.expected == 0]
    warn = [o.warnings or 0 for o in healthy]
    bad = [o for o in outcomes if o.expected == 1]
    roles_checked = [o for o in outcomes if o.role_ok is not None]
    kinds: Counter[str] = Counter()
    for o in healthy:
        kinds.update(o.warn_kinds)
    totals = {
        "artifacts": len(outcomes),
        "as expected": counts["ok"],
        "false FAILs (healthy exit 1)": counts["false FAIL"],
        "misses (broken exit 0)": counts["miss"],
        "right for the wrong reason": counts["wrong reason"],
        "false errors (exit 3/4 on an auditable file)": counts["false error"],
        "other mismatches": counts["mismatch"],
        "timeouts": counts["timeout"],
        "healthy artifacts": len(healthy),
        "warnings on healthy artifacts": sum(warn),
        "warnings per healthy artifact (mean)": round(sum(warn) / len(warn), 1) if warn else 0,
        "warnings per healthy artifact (max)": max(warn) if warn else 0,
        "healthy artifacts with > 3 warnings": sum(w > 3 for w in warn),
        "warnings on healthy artifacts by kind": ", ".join(
            f"{k} {n}" for k, n in kinds.most_common()
        )
        or "none",
        "broken artifacts": len(bad),
        "broken artifacts failing with the parameter/step named": sum(
            o.got == 1 and o.named is not False for o in bad
        ),
        "files read in the right role": f"{sum(bool(o.role_ok) for o in roles_checked)}"
        f"/{len(roles_checked)}",
        "optimizer/non-optimizer tensors in the wrong role": sum(o.role_errors for o in outcomes),
    }
    head = ["artifact", "cond", "exp", "got", "verdict", "warn", "named", "read as", "role ok"]
    rows = []
    for o in outcomes:
        rows.append(
            [
                o.path,
                o.condition,
                str(o.expected),
                "T/O" if o.got is None else str(o.got),
                o.verdict,
                "-" if o.warnings is None else str(o.warnings),
                {None: "-", True: "yes", False: "NO"}[o.named],
                (o.read_as or "-") + (" (thin)" if o.evidence_thin else ""),
                {None: "-", True: "yes", False: "NO"}[o.role_ok]
                + (f" ({o.role_errors} wrong)" if o.role_errors else ""),
            ]
        )
        if baseline is not None:
            before = baseline.get(o.path)
            rows[-1].append(
                "-"
                if before is None
                else f"{before['got']} {before['verdict']}, {before['warnings']} warn"
            )
    if baseline is not None:
        head = [*head, "baseline"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append("")
    lines += [f"{k}: {v}" for k, v in totals.items()]
    text = "\n".join(lines)

    md = [f"# gradaudit corpus: confusion table\n\n`{cmd}` on {len(outcomes)} artifacts.\n"]
    md.append("| " + " | ".join(head) + " |")
    md.append("|" + "---|" * len(head))
    md += ["| " + " | ".join(md_escape(c) for c in r) + " |" for r in rows]
    md.append("\n## Totals\n")
    md.append("| total | value |\n|---|---|")
    md += [f"| {k} | {v} |" for k, v in totals.items()]
    wrong = [o for o in outcomes if o.verdict != "ok"]
    if wrong:
        md.append("\n## Wrong verdicts: what gradaudit said\n")
        for o in wrong:
            md.append(
                f"### `{o.path}` — {o.verdict} (expected {o.expected}, got {o.got}; "
                f"{o.condition}, {o.role})\n"
            )
            if o.causes:
                md.append(f"Failing findings ({len(o.causes)}), first 5:\n")
                md += [f"- `{md_escape(c)}`" for c in o.causes[:5]]
            md.append("\nLast lines of the table output:\n\n```")
            md += o.tail
            md.append("```\n")
    if baseline is not None:
        changed = [
            (o, baseline[o.path])
            for o in outcomes
            if o.path in baseline
            and (o.got, o.verdict, o.warnings)
            != (baseline[o.path]["got"], baseline[o.path]["verdict"], baseline[o.path]["warnings"])
        ]
        md.append(f"\n## Changed since the baseline ({len(changed)})\n")
        md += [
            f"- `{o.path}`: exit {b['got']} -> {o.got}, {b['verdict']} -> {o.verdict}, "
            f"warnings {b['warnings']} -> {o.warnings}"
            for o, b in changed
        ]
    noisy = [o for o in healthy if (o.warnings or 0) > 3]
    if noisy:
        md.append("\n## Healthy artifacts with more than 3 warnings\n")
        for o in noisy:
            by_kind = ", ".join(f"{k} {n}" for k, n in sorted(o.warn_kinds.items()))
            md.append(f"- `{o.path}`: {o.warnings} ({by_kind}), e.g.")
            md += [f"  - `{md_escape(t)}`" for t in o.warn_lines]
    return text, "\n".join(md) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", nargs="?", type=Path, default=DEFAULT_OUTDIR)
    parser.add_argument(
        "--gradaudit",
        default=DEFAULT_CMD,
        help="command that runs gradaudit; it runs in OUTDIR, so give absolute paths "
        "(e.g. 'env PYTHONPATH=/other/checkout /abs/python -m gradaudit')",
    )
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per scan")
    parser.add_argument("--jobs", type=int, default=2, help="scans run at once")
    parser.add_argument("--only", default="", help="substring filter on artifact paths")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="judge the outputs an earlier run left in --results again, without scanning",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="confusion.json of an earlier run: adds its verdict per artifact and what changed",
    )
    parser.add_argument(
        "--results", type=Path, help="where each scan's output goes (default OUTDIR/results)"
    )
    args = parser.parse_args(argv)
    outdir: Path = args.outdir.expanduser().resolve()
    manifest = outdir / "manifest.json"
    if not manifest.exists():
        parser.error(f"{manifest} not found: run corpus/make_corpus.py {outdir} first")
    arts = json.loads(manifest.read_text())["artifacts"]
    arts = [a for a in arts if args.only in a["path"]]
    results: Path = (args.results or outdir / "results").expanduser().resolve()
    results.mkdir(parents=True, exist_ok=True)
    cmd = shlex.split(args.gradaudit)
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        outcomes = list(
            pool.map(lambda a: judge(a, outdir, results, cmd, args.timeout, args.reuse), arts)
        )
    baseline = None
    if args.baseline:
        baseline = {b["path"]: b for b in json.loads(args.baseline.read_text())}
    text, md = render(outcomes, args.gradaudit, baseline)
    print(text)
    if args.markdown:
        args.markdown.write_text(md)
    if not args.only:  # a filtered run leaves the whole table's record alone
        (results / "confusion.json").write_text(
            json.dumps([o.__dict__ | {"verdict": o.verdict} for o in outcomes], indent=1) + "\n"
        )
    return 0 if all(o.verdict == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
