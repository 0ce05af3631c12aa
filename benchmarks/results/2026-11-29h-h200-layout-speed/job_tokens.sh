#!/usr/bin/env bash
# Issue 48's tokens check in one GPU job: both trees' outputs on the same inputs, compared
# (timing skipped: job.sh timed them).  Run from the repo root there.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false LAYOUT_TOKENS_ONLY=1
out=/tmp/layout_tokens; mkdir -p "$out" /tmp/before
tar xzf .stage/before_d785b4c.tgz -C /tmp/before
here="$(pwd)"; res=benchmarks/results/2026-11-29h-h200-layout-speed
python3 "$res/layout_speed.py" /tmp/before "$here/jaxsample/bench/timing.py" "$out/before-0" 2>&1 | grep -v Warn | tail -3
python3 "$res/layout_speed.py" "$here" "$here/jaxsample/bench/timing.py" "$out/after-0" 2>&1 | grep -v Warn | tail -3
python3 "$res/layout_compare.py" "$out" | tail -3 | tee "$OUT/tokens.txt"
