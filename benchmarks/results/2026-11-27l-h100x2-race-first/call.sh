#!/bin/bash
# call 3 (nvidia-h100-x2): race-first (GPU 0: its tests, benchmark, kernel breakdown) beside the
# processing benchmark after the top-n fix (GPU 1, fp32 and bf16 plain rows)
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
( CUDA_VISIBLE_DEVICES=1 bash -c "time timeout 200 python3 -m jaxsample.bench processing --settings plain --no-progress --out $OUT/processing.json" > $OUT/processing.log 2>&1 ) &
CUDA_VISIBLE_DEVICES=0 bash .gpujobs/racefirst.sh
wait
tail -22 $OUT/processing.log
