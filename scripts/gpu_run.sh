#!/usr/bin/env bash
# Everything the GPU machine checks, in one call (run from the repo root there):
#   bash scripts/gpu_run.sh [smoke] [tests] [alltests] [sweep] [bench] [spec] [mask]
#   (default: smoke tests bench).  tests: tests/test_gpu.py; alltests: every
#   GPU test file; spec: scripts/bench_spec.py with $SPEC_ARGS; mask: issue
#   5's table (sample + mask against sample alone, bench_truncation.py).
# Logs and JSON go to $OUT (the device tool's output folder) or ./gpu-out.
# GPU_TEST_WORKERS: pytest-xdist workers for the GPU tests (default 6; 0: none).
# SWEEP_BASELINE: a gumbel.py to compare against in the sweep (optional).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out="${OUT:-gpu-out}"; mkdir -p "$out"
steps=("$@"); [[ ${#steps[@]} -gt 0 ]] || steps=(smoke tests bench)
quiet() { grep -v "UserWarning\|warnings.warn"; }
workers="${GPU_TEST_WORKERS:-6}"; xdist=(); [[ "$workers" == 0 ]] || xdist=(-n "$workers")
status=0
for step in "${steps[@]}"; do
  case "$step" in
    smoke) python3 scripts/gpu_smoke.py 2>&1 | quiet | tee "$out/smoke.log" || exit 1 ;;
    tests) python3 -m pytest -m gpu -q -rA -p no:cacheprovider "${xdist[@]}" tests/test_gpu.py \
             2>&1 | quiet > "$out/gpu-tests.log"
           status=$((status | ${PIPESTATUS[0]})); tail -n 3 "$out/gpu-tests.log" ;;
    alltests) python3 -m pytest -m gpu -q -rA -p no:cacheprovider "${xdist[@]}" tests/test_gpu*.py \
             2>&1 | quiet > "$out/gpu-alltests.log"
           status=$((status | ${PIPESTATUS[0]})); grep -E "^(FAILED|ERROR)" "$out/gpu-alltests.log"
           tail -n 3 "$out/gpu-alltests.log" ;;
    spec) python3 scripts/bench_spec.py ${SPEC_ARGS:-} --json "$out/spec.json" 2>&1 | quiet \
             | tee "$out/spec.log"
           status=$((status | ${PIPESTATUS[0]})) ;;
    mask) python3 scripts/bench_truncation.py --batch 1,32,128,256 --dtypes float32 \
             --settings top_k50+top_p0.9,top_p0.95 --distributions randn_x1 \
             --mask-caps 64,1024,4096 --peers "" --iters 16 --repeats 3 \
             --json "$out/mask.json" 2>&1 | quiet | tee "$out/mask.log"
           status=$((status | ${PIPESTATUS[0]})) ;;
    sweep) python3 scripts/sweep_gumbel.py ${SWEEP_BASELINE:+--baseline "$SWEEP_BASELINE"} \
             2>&1 | quiet | tee "$out/sweep.log"
           status=$((status | ${PIPESTATUS[0]})) ;;
    bench) python3 -m jaxsample.bench --batch 1,8,32,128,256,512 --dtypes float32,bfloat16 \
             --dists randn,llm --fp64 --iters 32 --repeats 5 \
             --ops "pallas,xla reference,jax.random.categorical,jnp.argmax" \
             --json "$out/bench.json" 2>&1 | quiet | tee "$out/bench.log"
           status=$((status | ${PIPESTATUS[0]})) ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
exit $status
