#!/bin/bash
# call 2 (nvidia-h100-x2): 2-GPU sharding (tests, 2 processes, bench); then the tests call 1 did not reach
# (GPU 1) beside the serving benchmarks (GPU 0)
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
date -u
( time timeout 150 python3 -m pytest -p no:benchmark -p no:cacheprovider -m gpu -v -rA tests/test_gpu_sharding.py ) > $OUT/gpu-sharding.log 2>&1
tail -12 $OUT/gpu-sharding.log
rm -f /tmp/mp.txt
for i in 0 1; do CUDA_VISIBLE_DEVICES=$i JAX_PLATFORMS=cuda timeout 120 python3 scripts/multiprocess_sample.py 12355 2 $i /tmp/mp.txt > /tmp/mp$i.log 2>&1 & done; wait
(tail -5 /tmp/mp0.log /tmp/mp1.log; echo "result:"; cat /tmp/mp.txt) > $OUT/multiprocess.log 2>&1
tail -4 $OUT/multiprocess.log
( time timeout 150 python3 -m jaxsample.bench sharded --no-progress --out $OUT/sharded.json ) > $OUT/sharded.log 2>&1
tail -16 $OUT/sharded.log
# the tests call 1 did not reach
python3 -m pytest -p no:benchmark -p no:cacheprovider -m "gpu or kernels or slow" --collect-only -q tests/ 2>/dev/null | grep "::" > /tmp/keep/all-ids.txt
python3 - <<'PY' > /tmp/keep/rest.txt
import re
ran = set(re.findall(r"(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S+)", open("/tmp/keep/alltests.log").read()))
ran |= set(re.findall(r"(tests/\S+) (?:PASSED|FAILED|SKIPPED|ERROR)", open("/tmp/keep/alltests.log").read()))
ids = [l.strip() for l in open("/tmp/keep/all-ids.txt") if l.strip() and "test_gpu_sharding" not in l]
print("\n".join(i for i in ids if i not in ran))
PY
echo "tests not reached in call 1: $(grep -c . /tmp/keep/rest.txt)"
if [ -s /tmp/keep/rest.txt ]; then
  ( CUDA_VISIBLE_DEVICES=1 timeout -s INT 330 python3 -m pytest -p no:benchmark -p no:cacheprovider -n 10 -v -rfE \
      --durations=20 $(cat /tmp/keep/rest.txt) > $OUT/gpu-rest.log 2>&1; echo "pytest rc=$?" >> $OUT/gpu-rest.log ) &
fi
export CUDA_VISIBLE_DEVICES=0
( time timeout 120 python3 -m jaxsample.serve_demo --bench --requests 128 --slots 32 --max-tokens 64 \
    --spec none ngram draft synthetic:0.9,0.8,0.7,0.6
  time timeout 60 python3 -m jaxsample.serve_demo --bench --requests 128 --slots 32 --max-tokens 64 --steps-per-call 8 --spec none
  time timeout 150 python3 -m jaxsample.serve_demo --bench --random --vocab 151936 --d-model 896 --layers 24 --heads 14 \
    --kv-heads 2 --mlp 4864 --dtype bfloat16 --cache-len 1024 --prompt-len 64 --slots 64 --requests 128 --max-tokens 64 \
    --spec none synthetic:0.9,0.8,0.7,0.6 ) > $OUT/serve.log 2>&1
cat $OUT/serve.log | grep -v "^$" | tail -30
wait
grep -E "^(FAILED|ERROR)|passed|failed|rc=" $OUT/gpu-rest.log 2>/dev/null | tail -20
date -u
