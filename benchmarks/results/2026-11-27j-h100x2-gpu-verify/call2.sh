#!/bin/bash
# call 2 (nvidia-h100-x2): every gpu/kernels/slow test on GPU 1; the report's bf16 slice on GPU 0
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
date -u
( CUDA_VISIBLE_DEVICES=1 timeout -s INT 520 python3 -m pytest -p no:benchmark -p no:cacheprovider \
    -m "gpu or kernels or slow" -n 12 -v -rfE --durations=30 tests/ > $OUT/gpu-alltests.log 2>&1
  echo "pytest rc=$?" >> $OUT/gpu-alltests.log ) &
( export CUDA_VISIBLE_DEVICES=0 OUT=$OUT BENCH_ARGS=--quick; timeout 480 bash scripts/gpu_run.sh report-151936-bfloat16 > /dev/null 2>&1 )
tail -30 $OUT/report-151936-bfloat16.log
wait
grep -E "^(FAILED|ERROR)|passed|failed|rc=" $OUT/gpu-alltests.log | tail -30
date -u
