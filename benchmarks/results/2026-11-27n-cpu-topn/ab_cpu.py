import time, statistics, jax, jax.numpy as jnp, numpy as np
import jaxsample as js
from jaxsample import logprobs
B, V = 32, 151936
x = jnp.asarray(np.random.default_rng(0).normal(size=(B, V)) * 2, jnp.float32)
params = js.SamplingParams.make(B); tokens = jnp.arange(B, dtype=jnp.int32)
ops = {"after: token_logprobs": jax.jit(lambda x: logprobs.token_logprobs(x, params, tokens, num_top=5, mode="raw_logprobs")),
       "before: top_logprobs(mode_values)": jax.jit(lambda x: logprobs.top_logprobs(logprobs.mode_values(x, params, "raw_logprobs"), tokens, 5))}
a = ops["after: token_logprobs"](x); b = ops["before: top_logprobs(mode_values)"](x)
assert all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
res = {k: [] for k in ops}
for _ in range(7):
  for k, f in ops.items():
    t = time.process_time()
    for _ in range(5): jax.block_until_ready(f(x))
    res[k].append((time.process_time() - t) / 5 * 1e3)
for k, v in res.items(): print(f"{k:40s} CPU-ms/call median {statistics.median(v):.1f}  {[round(u,1) for u in v]}")
