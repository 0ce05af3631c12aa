#!/usr/bin/env bash
# Issue 48's before/after speed table in one GPU job (run from the repo root there; the
# before tree arrives as .stage/before_d785b4c.tgz, the working tree is "after").
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out="$OUT/layout"; mkdir -p "$out" /tmp/before
tar xzf .stage/before_d785b4c.tgz -C /tmp/before
here="$(pwd)"; res=benchmarks/results/2026-11-29h-h200-layout-speed
for round in 0 1; do
  python3 "$res/layout_speed.py" /tmp/before "$here/jaxsample/bench/timing.py" "$out/before-$round" 2>&1 | grep -v Warn > "$out/before-$round.log"
  python3 "$res/layout_speed.py" "$here" "$here/jaxsample/bench/timing.py" "$out/after-$round" 2>&1 | grep -v Warn > "$out/after-$round.log"
done
python3 "$res/layout_compare.py" "$out"
