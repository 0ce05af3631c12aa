"""Interleaved A/B in CPU seconds per call at B = 128, V = 151936 (fp32): the dense
processing pass (tests/test_processing_passes.py's oracle) against apply_processors with
the bench's processors, and one log_softmax + lax.top_k against token_logprobs (top-5 raw).

    JAX_PLATFORMS=cpu PYTHONPATH=. python3 benchmarks/results/2026-11-27g-cpu-processing-passes/ab_cpu.py
"""
import sys, time; sys.path.insert(0, "tests")
import numpy as np, jax, jax.numpy as jnp
import jaxsample as js
from jaxsample import processors as procs, logprobs
import test_processing_passes as t
B, V = 128, 151936
r = np.random.default_rng(0)
ids = lambda n: jnp.asarray(r.integers(0, V, (B, n)), jnp.int32)
rows = lambda v: jnp.full((B,), v, jnp.float32)
every = dict(repetition_penalty=rows(1.1), presence_penalty=rows(0.5), frequency_penalty=rows(0.2),
             output_ids=ids(1024), num_output=jnp.full((B,), 1024, jnp.int32),
             bias_ids=ids(16), bias_values=jnp.ones((B, 16), jnp.float32),
             bitmask=jnp.asarray(r.integers(-2**31, 2**31, (B, procs.bitmask_width(V))), jnp.int32))
p = js.LogitsProcessors(**every)
x = jnp.asarray(r.normal(size=(B, V)), jnp.float32)
tokens = jnp.zeros((B,), jnp.int32); params = js.SamplingParams.make(B)
new_p = jax.jit(procs.apply_processors)
top = jax.jit(lambda x, tk: logprobs.token_logprobs(x, params, tk, num_top=5))
cases = {"dense processing": lambda: t.dense_apply(x, p), "sparse processing": lambda: new_p(x, p),
         "dense top-5": lambda: t.dense_top_logprobs(x, tokens, 5), "two-stage top-5": lambda: top(x, tokens)}
for f in cases.values(): jax.block_until_ready(f())
cpu = {k: [] for k in cases}
for _ in range(7):
  for k, f in cases.items():
    t0 = time.process_time()
    for _ in range(3): jax.block_until_ready(f())
    cpu[k].append((time.process_time() - t0) / 3)
for k, v in cpu.items(): print(f"{k:20s} median {np.median(v)*1e3:8.1f} CPU-ms per call")
