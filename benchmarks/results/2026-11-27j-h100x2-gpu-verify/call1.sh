#!/bin/bash
# call 1 (nvidia-h100-x2): the 2-GPU file and 2 processes; then the Qwen-shape decode step (GPU 0)
# beside the processing bench (GPU 1)
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
date -u; nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader; git log --oneline -1 2>/dev/null
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
( time timeout -s INT 270 python3 -m pytest -p no:benchmark -p no:cacheprovider -m gpu -v -rA --durations=10 tests/test_gpu_sharding.py ) > $OUT/gpu-sharding.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|real" $OUT/gpu-sharding.log | tail -14
rm -f /tmp/mp.txt
for i in 0 1; do CUDA_VISIBLE_DEVICES=$i JAX_PLATFORMS=cuda timeout 90 python3 scripts/multiprocess_sample.py 12355 2 $i /tmp/mp.txt > /tmp/mp$i.log 2>&1 & done; wait
(tail -5 /tmp/mp0.log /tmp/mp1.log; echo "result:"; cat /tmp/mp.txt) > $OUT/multiprocess.log 2>&1
tail -3 $OUT/multiprocess.log
( CUDA_VISIBLE_DEVICES=1 bash -c "time timeout 200 python3 -m jaxsample.bench processing --no-progress --out $OUT/processing.json" > $OUT/processing.log 2>&1 ) &
( CUDA_VISIBLE_DEVICES=0 bash -c "time timeout 200 python3 -m jaxsample.bench.decode --shapes qwen2.5-0.5b --skip-embedded --json $OUT/decode-qwen.json" ) > $OUT/decode-qwen.log 2>&1
wait
tail -25 $OUT/decode-qwen.log; tail -30 $OUT/processing.log
date -u
