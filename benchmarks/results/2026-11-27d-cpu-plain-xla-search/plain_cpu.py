"""Plain sampling on CPU (B = 8, V = 32000, fp32, T = 1): CPU seconds per call
of jaxsample.sample (xla_search and the reference) against
jax.random.categorical, and of the pieces of the plain path, interleaved in
one process (median of --repeats blocks of --iters calls; process_time, so
the two cores' threads both count).  Params and the key are jit arguments.

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/results/2026-11-27d-cpu-plain-xla-search/plain_cpu.py
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample as js
from jaxsample import reference, rng

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--vocab", type=int, default=32000)
parser.add_argument("--iters", type=int, default=10)
parser.add_argument("--repeats", type=int, default=9)
parser.add_argument("--out", default="")
args = parser.parse_args()
B, V = args.batch, args.vocab
x = jax.random.normal(jax.random.key(0), (B, V), jnp.float32)
params = js.SamplingParams.make(B)
key = jax.random.key(1)


def sampler(impl, generator="philox"):
  cfg = js.SamplerConfig(implementation=impl, rng=generator)
  return jax.jit(lambda x, p, k: js.sample(x, p, k, config=cfg))


def streams(k):
  return rng.row_streams(k, None, B, V)[0]


def race(generator):
  return jax.jit(lambda x, p, k: jnp.argmax(
      x + rng.gumbel_noise(generator, streams(k), V), axis=-1))


ops = {
    "sample xla_search (philox)": sampler("xla_search"),
    "sample xla_search (threefry)": sampler("xla_search", "threefry"),
    "sample xla (reference)": sampler("xla"),
    "jax.random.categorical": jax.jit(
        lambda x, p, k: jax.random.categorical(k, x)),
    "piece: philox noise + argmax": race("philox"),
    "piece: threefry noise + argmax": race("threefry"),
    "piece: exact logsumexp": jax.jit(lambda x, p, k: reference.logsumexp_where(
        x, x > -jnp.inf)),
    "piece: jax.nn.logsumexp": jax.jit(
        lambda x, p, k: jax.nn.logsumexp(x, axis=-1)),
    "piece: max + argmax": jax.jit(
        lambda x, p, k: (jnp.max(x, -1), jnp.argmax(x, -1))),
    "piece: lax.top_k(64)": jax.jit(lambda x, p, k: jax.lax.top_k(x, 64)),
}
for f in ops.values():
  jax.block_until_ready(f(x, params, key))
cpu = {name: [] for name in ops}
for _ in range(args.repeats):
  for name, f in ops.items():
    start = time.process_time()
    for _ in range(args.iters):
      out = f(x, params, key)
    jax.block_until_ready(out)
    cpu[name].append((time.process_time() - start) / args.iters * 1e3)
base = float(np.median(cpu["jax.random.categorical"]))
rows = {name: {"cpu_ms": float(np.median(v)), "min": float(np.min(v)),
               "max": float(np.max(v))} for name, v in cpu.items()}
print(f"B = {B}, V = {V}: CPU ms per call, median of {args.repeats} blocks "
      f"of {args.iters} (min-max); x categorical")
for name, r in rows.items():
  print(f"{name:32s} {r['cpu_ms']:8.3f} ({r['min']:.2f}-{r['max']:.2f})"
        f"  {r['cpu_ms'] / base:5.2f}x")
if args.out:
  with open(args.out, "w") as f:
    json.dump({"batch": B, "vocab": V, "iters": args.iters,
               "repeats": args.repeats, "ops": rows}, f, indent=1)
