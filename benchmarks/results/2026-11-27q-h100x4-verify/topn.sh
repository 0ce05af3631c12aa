#!/bin/bash
# topn (issue 40): one GPU, <= ~400 s. From the repo root; outputs to $OUT.
#  1. the GPU tests of raw top-n logprobs (tied rows, the bench's shape)      ~40 s
#  2. A/B in one process: raw top-5 logprobs by token_logprobs (run keys from the read that
#     takes the max: 3 row reads) against top_logprobs(mode_values(...)) (run keys from the
#     values: 4 reads, the route before this branch), with the kernel breakdown   ~40 s
#  3. python -m jaxsample.bench processing, fp32 and bf16, plain rows             ~90 s
#  4. the decode step (Qwen2.5-0.5B, random bf16 weights, B = 64, 128) without and with
#     issue 40's processors and top-5 raw logprobs                               ~90 s
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/device.txt 2>&1
git log --oneline -1 > $OUT/commit.txt 2>&1

timeout 80 python3 -m pytest tests/test_processing_passes.py -m gpu -q -p no:xdist \
  -p no:cacheprovider > $OUT/gpu-tests.log 2>&1
tail -3 $OUT/gpu-tests.log

timeout 60 python3 - > $OUT/topn-ab.log 2>&1 <<'EOF'
import json, os
import jax, jax.numpy as jnp, numpy as np
import jaxsample as js
from jaxsample import logprobs
from jaxsample.bench.timing import time_op
B, V = 128, 151936
rows = []
for dtype in (jnp.float32, jnp.bfloat16):
  r = np.random.default_rng(0)
  inputs = [jnp.asarray(r.normal(size=(B, V)) * 2, dtype) for _ in range(4)]
  params = js.SamplingParams.make(B)
  tokens = jnp.asarray(r.integers(0, V, B), jnp.int32)
  ops = {
      "token_logprobs (runs from the max read)": jax.jit(lambda x: logprobs.token_logprobs(
          x, params, tokens, num_top=5, mode="raw_logprobs")),
      "top_logprobs(mode_values) (runs from the values)": jax.jit(lambda x: logprobs.top_logprobs(
          logprobs.mode_values(x, params, "raw_logprobs"), tokens, 5)),
      "jnp.max (one read)": jax.jit(lambda x: jnp.max(x, axis=-1)),
  }
  for name, fn in ops.items():
    t = time_op(fn, inputs, 20, 5)
    rows.append({"op": name, "dtype": jnp.dtype(dtype).name, "us": t["us"],
                 "kernel_us": t.get("kernel_us")})
    print(f"{name:50s} {jnp.dtype(dtype).name:9s} {t['us']:8.1f} us")
    for k, v in list((t.get("kernel_us") or {}).items())[:8]:
      print(f"    {v:8.1f}  {k}")
json.dump(rows, open(os.environ["OUT"] + "/topn-ab.json", "w"), indent=1)
EOF
cat $OUT/topn-ab.log | head -40

( time timeout 120 python3 -m jaxsample.bench processing --settings plain --no-progress \
  --out $OUT/processing.json ) > $OUT/processing.log 2>&1
tail -20 $OUT/processing.log

( time timeout 130 python3 -m jaxsample.bench.decode --processors --skip-embedded \
  --json $OUT/decode-processors.json ) > $OUT/decode-processors.log 2>&1
tail -8 $OUT/decode-processors.log
