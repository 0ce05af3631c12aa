#!/usr/bin/env bash
# Issue 49's same-run table: the tree before this session's route changes (.stage/before_9e4501a.tgz)
# and the working tree, timed by the working tree's harness in one job on one GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
here="$(pwd)"; res="${RES:-.stage/ab}"; out="$OUT/ab"; mkdir -p "$out" /tmp/before
tar xzf .stage/before_9e4501a.tgz -C /tmp/before
timing="$here/jaxsample/bench/timing.py"
python3 "$res/speed_ab.py" /tmp/before "$timing" "$out/before-core" core 2>&1 | grep -v Warn > "$out/before-core.log"
python3 "$res/speed_ab.py" "$here" "$timing" "$out/after-core" core 2>&1 | grep -v Warn > "$out/after-core.log"
[ "${GRID_WIDE:-1}" = 1 ] && python3 "$res/speed_ab.py" "$here" "$timing" "$out/after-wide" wide 2>&1 | grep -v Warn > "$out/after-wide.log"
python3 "$res/compare_ab.py" "$out" | tee "$out/table.md"
