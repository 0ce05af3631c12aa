"""Benchmarks with device-side timing: ``python -m jaxsample.bench --help``.

Each op is jitted, warmed up, then called ``--iters`` times on rotating
inputs (enough distinct logits buffers to exceed the GPU's L2, so nothing is
timed from cache) under the JAX profiler.  Device time per call is the summed
duration of the GPU kernels and copies the profiler recorded, divided by the
number of calls; the median of ``--repeats`` such runs is reported, with the
wall-clock time per call (dispatch included) alongside.  The HBM floor of an
op is the bytes it must read (the logits, once) over the bandwidth of a large
device copy measured in the same run.  On CPU the profiler has no device
plane and the wall-clock figure stands in.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample as js

L2_BYTES = 50 * 2**20
_TOP_K = 50
_TOP_P = 0.9


def _device_kernel_ns(trace_dir: str) -> int | None:
  """Sum of GPU event durations in a profiler trace, or None without a GPU plane."""
  files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  if not files:
    return None
  data = jax.profiler.ProfileData.from_file(files[0])
  total, seen = 0, False
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      # Stream lines hold the kernels and copies; skip derived summary lines.
      if not line.name.startswith("Stream"):
        continue
      for event in line.events:
        seen = True
        total += event.duration_ns
  return total if seen else None


def time_op(fn: Callable, inputs: list, iters: int, repeats: int) -> dict:
  """Median device and wall time (microseconds) of ``fn`` over rotating inputs."""
  jax.block_until_ready(fn(inputs[0]))
  device_us, wall_us = [], []
  for _ in range(repeats):
    with tempfile.TemporaryDirectory() as trace_dir:
      jax.profiler.start_trace(trace_dir)
      start = time.perf_counter()
      out = None
      for i in range(iters):
        out = fn(inputs[i % len(inputs)])
      jax.block_until_ready(out)
      wall_us.append((time.perf_counter() - start) * 1e6 / iters)
      jax.profiler.stop_trace()
      ns = _device_kernel_ns(trace_dir)
    if ns is not None:
      device_us.append(ns / 1e3 / iters)
  result = {"wall_us": statistics.median(wall_us)}
  if device_us:
    result["device_us"] = statistics.median(device_us)
  result["us"] = result.get("device_us", result["wall_us"])
  return result


def measure_bandwidth(gib: float = 2.0) -> float:
  """Bytes/s of a large device copy (read + write), median of 5."""
  n = int(gib * 2**30 / 4)
  x = jnp.arange(n, dtype=jnp.float32)
  copy = jax.jit(lambda a: a * 1.0001)
  t = time_op(copy, [x], iters=5, repeats=3)["us"]
  return 2 * n * 4 / (t * 1e-6)


def rotating_inputs(batch, vocab, dtype, seed=0):
  """Distinct random logits buffers, enough to exceed 2x the L2 (at most 64)."""
  n_bytes = batch * vocab * jnp.dtype(dtype).itemsize
  count = int(min(64, max(2, -(-2 * L2_BYTES // max(n_bytes, 1)))))
  keys = jax.random.split(jax.random.key(seed), count)
  return [(jax.random.normal(k, (batch, vocab), jnp.float32) * 2).astype(dtype)
          for k in keys]


def ops(batch: int, temperature: float, fp64: bool) -> dict[str, Callable]:
  """The ops compared, each a jitted function of one logits array."""
  key = jax.random.key(1)
  params = js.SamplingParams.make(batch, temperature=temperature)
  t = params.temperature[:, None]

  def sampler(**config):
    cfg = js.SamplerConfig(**config)
    fn = jax.jit(lambda x: js.sample(x, params, key, config=cfg).tokens)
    if not cfg.use_fp64_gumbel:
      return fn

    def fp64_call(x):
      with jax.enable_x64(True):
        return fn(x)

    return fp64_call

  table = {
      "jaxsample pallas philox": sampler(implementation="pallas", rng="philox"),
      "jaxsample pallas threefry": sampler(implementation="pallas",
                                           rng="threefry"),
      "jaxsample xla reference": sampler(implementation="xla", rng="philox"),
      "jax.random.categorical": jax.jit(
          lambda x: jax.random.categorical(key, x.astype(jnp.float32) / t)),
      "jnp.argmax": jax.jit(lambda x: jnp.argmax(x, axis=-1)),
      "lax.top_k(50)+categorical": jax.jit(lambda x: _top_k_sample(key, x / t)),
      "sort top-p(0.9)+categorical": jax.jit(
          lambda x: _sort_top_p_sample(key, x / t)),
  }
  if fp64:
    table["jaxsample pallas philox fp64"] = sampler(
        implementation="pallas", rng="philox", use_fp64_gumbel=True)
  return table


def _top_k_sample(key, y):
  values, indices = jax.lax.top_k(y, _TOP_K)
  choice = jax.random.categorical(key, values.astype(jnp.float32))
  return jnp.take_along_axis(indices, choice[:, None], axis=-1)[:, 0]


def _sort_top_p_sample(key, y):
  y = y.astype(jnp.float32)
  order = jnp.argsort(-y, axis=-1)
  ys = jnp.take_along_axis(y, order, axis=-1)
  probs = jax.nn.softmax(ys, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs
  ys = jnp.where(before < _TOP_P, ys, -jnp.inf)
  choice = jax.random.categorical(key, ys)
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", default="1,8,32,128,256,512")
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--temperature", type=float, default=0.7)
  parser.add_argument("--ops", default="",
                      help="comma-separated substrings selecting ops")
  parser.add_argument("--iters", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--fp64", action="store_true")
  parser.add_argument("--json", default="")
  args = parser.parse_args(argv)

  bandwidth = measure_bandwidth()
  device = jax.devices()[0]
  print(f"# device: {device.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
  rows = []
  selected = [s for s in args.ops.split(",") if s]
  header = (f"{'op':34s} {'dtype':8s} {'B':>4s} {'us':>9s} {'wall_us':>9s} "
            f"{'floor_us':>9s} {'x_floor':>8s}")
  print(header)
  for dtype in args.dtypes.split(","):
    for batch in [int(b) for b in args.batch.split(",")]:
      inputs = rotating_inputs(batch, args.vocab, jnp.dtype(dtype))
      floor_us = batch * args.vocab * jnp.dtype(dtype).itemsize / bandwidth * 1e6
      for name, fn in ops(batch, args.temperature, args.fp64).items():
        if selected and not any(s in name for s in selected):
          continue
        r = time_op(fn, inputs, args.iters, args.repeats)
        row = dict(op=name, dtype=dtype, batch=batch, vocab=args.vocab,
                   floor_us=floor_us, x_floor=r["us"] / floor_us, **r)
        rows.append(row)
        print(f"{name:34s} {dtype:8s} {batch:4d} {r['us']:9.1f} "
              f"{r['wall_us']:9.1f} {floor_us:9.1f} {row['x_floor']:8.2f}",
              flush=True)
      del inputs
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": device.device_kind, "backend": jax.default_backend(),
                 "jax": jax.__version__, "bandwidth_bytes_per_s": bandwidth,
                 "argv": sys.argv, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
