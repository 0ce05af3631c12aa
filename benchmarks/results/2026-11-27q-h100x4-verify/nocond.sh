#!/bin/bash
# nocond (issue 38, host share), one GPU, <= 390 s: the serve loop with and without the
# branch-free sampler (ServeLoop(branch_free=...), tuning.Branching(conds=False)).
#   serve.log       embedded model, --spec none, 4 steps/call: default (conds) / branch-free,
#                   interleaved twice (A B A B); each line: tok/s, host share, in dispatch,
#                   device idle share (profiler window of 16 step calls)
#   serve-qwen.log  Qwen2.5-0.5B-shaped random model (bf16, cache 1,024, 64 slots), both modes
#   bitid.log       embedded completions in both modes, compared with cmp (bit identity on GPU)
#   tests.log       pytest -m "gpu or kernels" tests/test_branch_free.py (no data-dependent
#                   control in the compiled branch-free step; both modes bit-identical)
# Each command gets what is left of the 390 s budget (at most its own cap), in this order.
# Run from the repo root: OUT=<folder> bash .gpujobs/nocond.sh
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=/tmp/nocond-jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
out="${OUT:-gpu-out}"; mkdir -p "$out"
end=$(( $(date +%s) + 390 ))
budget() { local left=$(( end - $(date +%s) )); (( left < $1 )) && echo "$left" || echo "$1"; }
quiet() { grep -v "UserWarning\|warnings.warn"; }
demo=(python3 -m jaxsample.serve_demo --bench --requests 128 --slots 32 --max-tokens 64 --spec none)
qwen=(--random --vocab 151936 --d-model 896 --layers 24 --heads 14 --kv-heads 2 --mlp 4864
      --dtype bfloat16 --cache-len 1024 --prompt-len 64 --slots 64)
dump=(python3 scripts/dump_completions.py)
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log --oneline -1; } \
  | tee "$out/env.log"
for round in 1 2; do
  for mode in --no-branch-free --branch-free; do
    timeout "$(budget 45)" "${demo[@]}" "$mode" 2>&1 | quiet | tee -a "$out/serve.log"
  done
done
for mode in --no-branch-free --branch-free; do
  timeout "$(budget 75)" "${demo[@]}" "${qwen[@]}" "$mode" 2>&1 | quiet | tee -a "$out/serve-qwen.log"
done
for mode in no-branch-free branch-free; do
  timeout "$(budget 30)" "${dump[@]}" "$out/$mode.json" --requests 128 --slots 32 --max-tokens 64 \
    "--$mode" 2>&1 | quiet | tail -2 | tee -a "$out/bitid.log"
done
{ cmp "$out/no-branch-free.json" "$out/branch-free.json" && echo "conds / branch-free: IDENTICAL"; } \
  2>&1 | tee -a "$out/bitid.log"
timeout "$(budget 150)" python3 -m pytest -m "gpu or kernels" -q -rA -p no:cacheprovider \
  tests/test_branch_free.py 2>&1 | quiet | tail -n 25 | tee "$out/tests.log"
date -u | tee -a "$out/env.log"
