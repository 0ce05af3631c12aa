#!/bin/bash
# call 1: train the draft model, serving GPU tests (default and highest matmul precision), decode bench
set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import jax; print(jax.__version__, jax.devices())"
mkdir -p $OUT/draft
( time timeout 150 python3 scripts/train_model.py --cache-dir .corpus --out $OUT/draft \
   --tokenizer jaxsample/models/data/shakespeare/tokenizer.json --d-model 64 --layers 2 --heads 2 \
   --kv-heads 1 --mlp 192 --steps 2000 --batch 64 --eval-every 500 ) > $OUT/train-draft.log 2>&1
tail -3 $OUT/train-draft.log
( time timeout 140 python3 -m pytest -p no:benchmark -m gpu -q -rfE tests/test_gpu_serving.py tests/test_gpu_serve_loop.py ) > $OUT/gpu-serving-default.log 2>&1
tail -3 $OUT/gpu-serving-default.log
( time JAX_DEFAULT_MATMUL_PRECISION=highest timeout 100 python3 -m pytest -p no:benchmark -m gpu -q -rfE tests/test_gpu_serving.py -k loop_equals ) > $OUT/gpu-serving-highest.log 2>&1
tail -3 $OUT/gpu-serving-highest.log
( time timeout 250 python3 -m jaxsample.bench.decode --shapes qwen2.5-0.5b --skip-embedded --json $OUT/decode-qwen.json ) > $OUT/decode-qwen.log 2>&1
tail -30 $OUT/decode-qwen.log
