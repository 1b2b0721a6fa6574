#!/usr/bin/env bash
# The project's GPU check (benchmarks/gpu_check.py): run from a clone on a machine with an
# H100/H200, in <= 8 minutes; results in $OUT (summary.txt first). docs/gpu.md says how.
#
#     bash benchmarks/gpu_check.sh [--only STEP,STEP] [--budget SECONDS]
#     GA_DRY_RUN=1 bash benchmarks/gpu_check.sh     # the same logic on a CPU, tiny sizes
#
# This wrapper only sets the scene: the checkout on the path, $OUT, a scratch folder for
# Triton's caches outside $OUT (they would be too many files to send back), and a hard
# stop a little after the check's own deadline (BUDGET_S, default 450 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
BUDGET_S=${BUDGET_S:-450}
PY=${PY:-python3}
mkdir -p "$OUT"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the check sets it for a dry run only
timeout -k 10 $((BUDGET_S + 20)) "$PY" -m benchmarks.gpu_check \
  --out "$OUT" --budget "$BUDGET_S" --scratch "$SCRATCH" "$@" 2>&1 | tee "$OUT/console.txt"
status=${PIPESTATUS[0]}
[ "$status" -eq 124 ] && echo "gpu_check.sh: stopped at the hard limit ($((BUDGET_S + 20)) s)" | tee -a "$OUT/summary.txt"
exit "$status"
