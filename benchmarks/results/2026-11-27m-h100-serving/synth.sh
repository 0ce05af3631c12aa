#!/bin/bash
# synth (issue 38), one GPU, ~300 s: the serving loop after the host cuts of branch synth.
#   serve.log       embedded model, --spec none ngram draft synthetic:0.9,0.8,0.7,0.6 (default: 4 steps/call)
#   serve-qwen.log  Qwen2.5-0.5B-shaped random model (bf16, cache 1,024, 64 slots), none + synthetic
#   serve-spc.log   embedded, --spec none at 1 and at 8 steps per call (host share against steps per call)
#   bitid.log       embedded completions at 1 and 4 steps per call, compared with cmp (bit identity on GPU)
# Each command gets what is left of the 290 s budget (at most its own cap), in this order.
# Run from the repo root: OUT=<folder> bash .gpujobs/synth.sh
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=/tmp/synth-jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
out="${OUT:-gpu-out}"; mkdir -p "$out"
end=$(( $(date +%s) + 290 ))
budget() { local left=$(( end - $(date +%s) )); (( left < $1 )) && echo "$left" || echo "$1"; }
quiet() { grep -v "UserWarning\|warnings.warn"; }
demo=(python3 -m jaxsample.serve_demo --bench --requests 128 --slots 32 --max-tokens 64)
qwen=(--random --vocab 151936 --d-model 896 --layers 24 --heads 14 --kv-heads 2 --mlp 4864
      --dtype bfloat16 --cache-len 1024 --prompt-len 64 --slots 64)
dump=(python3 scripts/dump_completions.py)
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log --oneline -1; } \
  | tee "$out/env.log"
timeout "$(budget 120)" "${demo[@]}" --spec none ngram draft synthetic:0.9,0.8,0.7,0.6 2>&1 | quiet \
  | tee "$out/serve.log"
timeout "$(budget 110)" "${demo[@]}" "${qwen[@]}" --spec none synthetic:0.9,0.8,0.7,0.6 2>&1 | quiet \
  | tee "$out/serve-qwen.log"
for spc in 1 8; do
  timeout "$(budget 35)" "${demo[@]}" --steps-per-call "$spc" --spec none 2>&1 | quiet \
    | tee -a "$out/serve-spc.log"
done
for spc in 1 4; do
  timeout "$(budget 30)" "${dump[@]}" "$out/spc$spc.json" --requests 128 --slots 32 --max-tokens 64 \
    --steps-per-call "$spc" 2>&1 | quiet | tail -2 | tee -a "$out/bitid.log"
done
{ cmp "$out/spc1.json" "$out/spc4.json" && echo "1 and 4 steps per call: IDENTICAL"; } 2>&1 \
  | tee -a "$out/bitid.log"
date -u | tee -a "$out/env.log"
