#!/bin/bash
# call 1 (nvidia-h100-x2): every gpu/kernels/slow test on GPU 1; decode + processing benches on GPU 0
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
date -u; nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
mkdir -p /tmp/keep
( CUDA_VISIBLE_DEVICES=1 timeout -s INT 550 python3 -m pytest -p no:benchmark -p no:cacheprovider \
    -m "gpu or kernels or slow" -n 12 -v -rfE --durations=40 tests/ > /tmp/keep/alltests.log 2>&1
  echo "pytest rc=$?" >> /tmp/keep/alltests.log; cp /tmp/keep/alltests.log $OUT/gpu-alltests.log ) &
export CUDA_VISIBLE_DEVICES=0
( time timeout 330 python3 -m jaxsample.bench.decode --json $OUT/decode.json ) > $OUT/decode.log 2>&1
tail -40 $OUT/decode.log
( time timeout 190 python3 -m jaxsample.bench processing --no-progress --out $OUT/processing.json ) > $OUT/processing.log 2>&1
tail -30 $OUT/processing.log
wait
grep -E "^(FAILED|ERROR)|passed|failed|rc=" $OUT/gpu-alltests.log | tail -40
date -u
