#!/usr/bin/env bash
# Everything the GPU machine checks, in one call (run from the repo root there):
#   bash scripts/gpu_run.sh [smoke] [tests] [bench]      (default: all three)
# Logs and JSON go to $OUT (the device tool's output folder) or ./gpu-out.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
out="${OUT:-gpu-out}"; mkdir -p "$out"
steps=("$@"); [[ ${#steps[@]} -gt 0 ]] || steps=(smoke tests bench)
quiet() { grep -v "UserWarning\|warnings.warn"; }
status=0
for step in "${steps[@]}"; do
  case "$step" in
    smoke) python3 scripts/gpu_smoke.py 2>&1 | quiet | tee "$out/smoke.log" || exit 1 ;;
    tests) python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | quiet | tee "$out/gpu-tests.log"
           status=$((status | ${PIPESTATUS[0]})) ;;
    bench) python3 -m jaxsample.bench --batch 1,8,32,128,256,512 --dtypes float32,bfloat16 \
             --fp64 --json "$out/bench.json" 2>&1 | quiet | tee "$out/bench.log"
           status=$((status | ${PIPESTATUS[0]})) ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
exit $status
