#!/bin/bash
# racefirst (issue 41): the GPU tests of the race-first route, then the
# benchmark: plain sample and race-first (logprobs off, M = 1 and 4) against
# jnp.max, top-p 0.95 / top-k 50 + top-p 0.9 / min-p 0.05, B = 1, 32, 128, 512.
# About 300 s in all (each part has its own timeout).
export PYTHONPATH=. PYTHONUNBUFFERED=1
date -u; nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 2>/dev/null
( time timeout -s INT 110 python3 -m pytest -p no:cacheprovider -m gpu -v -rA --durations=10 \
    tests/test_gpu_race_first.py ) > $OUT/gpu-race-first.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|real" $OUT/gpu-race-first.log | tail -14
( time timeout -s INT 260 python3 -m jaxsample.bench sample --no-progress --no-reference \
    --settings plain,top_p0.95,top_k50+top_p0.9,min_p0.05 --batch 1,32,128,512 \
    --dtypes float32 --dists llm,randn --race-first 1,4 --ops "jaxsample,jnp.max" \
    --iters 8 --repeats 3 --bandwidth-gib 0.25 --out $OUT/race-first-bench.json ) \
    > $OUT/race-first-bench.log 2>&1
tail -130 $OUT/race-first-bench.log
# where the time goes: B = 128, top-p 0.95, the costliest device ops per op
( time timeout -s INT 45 python3 -m jaxsample.bench sample --no-progress --no-reference \
    --settings top_p0.95 --batch 128 --dtypes float32 --dists llm --race-first 1,4 \
    --ops "jaxsample,jnp.max" --iters 8 --repeats 3 --bandwidth-gib 0.25 --kernels 6 \
    --out $OUT/race-first-kernels.json ) > $OUT/race-first-kernels.log 2>&1
tail -40 $OUT/race-first-kernels.log
date -u
