"""Benchmarks with device-side timing: ``python -m jaxsample.bench --help``.

Each op is jitted, warmed up, then called ``--iters * --repeats`` times on
rotating inputs (enough distinct logits buffers to exceed the GPU's L2, so
nothing is timed from cache) under one JAX profiler trace.  The GPU events
(kernels and copies) of the trace are cut into calls in time order; device
time per call is the median over ``--repeats`` consecutive blocks of
``--iters`` calls of the block's mean, with the wall-clock time per call
(dispatch included) alongside.  The HBM floor of an op is the bytes it must
read (the logits, once) over the bandwidth of a large device copy measured in
the same run.  On CPU the profiler has no device plane and the wall-clock
figure stands in.

Logit distributions (``--dists``; each row of ``[B, V]`` independent):

* ``randn``: i.i.d. ``2 * N(0, 1)``.  The sampler's worst case: at T = 0.7
  every RNG tile of the Gumbel kernel may hold the winner, so none is skipped.
* ``llm``: an LLM-like row: a bulk of ``2 * N(0, 1)`` plus ``LLM_HEADS`` (8)
  head tokens at random ids with logits uniform in [15, 25], i.e. 6 to 16
  above the bulk's maximum (~9 at V = 151936).  With the kernel's tile skip,
  tiles of bulk only are skipped once a head's race value bounds them
  (``jaxsample.pallas.gumbel``).

``jaxsample pallas philox skip`` is the kernel with its opt-in tile skip
(``jaxsample.pallas.gumbel.TILE_SKIP``); on fp32 logits the fraction of RNG
tiles that drew random bits with it (``raced``, from
``GumbelPartials.raced_tiles``, over the first 4 input buffers) is printed
alongside.
"""

from __future__ import annotations

import argparse
import collections
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
from jaxsample import rng
from jaxsample.pallas import gumbel

L2_BYTES = 50 * 2**20
_TOP_K = 50
_TOP_P = 0.9


def _device_events(trace_dir: str) -> list[tuple[int, int, str]] | None:
  """(start_ns, duration_ns, name) of the GPU events of a trace, in time
  order."""
  files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  if not files:
    return None
  data = jax.profiler.ProfileData.from_file(files[0])
  events = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue
      events.extend((e.start_ns, e.duration_ns, e.name) for e in line.events)
  return sorted(events) or None


def time_op(fn: Callable, inputs: list, iters: int, repeats: int) -> dict:
  """Median device and wall time (microseconds) of ``fn`` over rotating inputs.

  One trace of ``iters * repeats`` calls; the device events are split into
  calls in time order (every call launches the same kernels), and the
  reported figure is the median over ``repeats`` blocks of ``iters`` calls of
  the block mean.  If the event count is no multiple of the calls, the mean
  over all calls is reported (``device_split`` False).  ``kernel_us``: each
  device op's mean time per call, by name (costliest first).
  """
  jax.block_until_ready(fn(inputs[0]))
  calls = iters * repeats
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    start = time.perf_counter()
    out = None
    for i in range(calls):
      out = fn(inputs[i % len(inputs)])
    jax.block_until_ready(out)
    wall_us = (time.perf_counter() - start) * 1e6 / calls
    jax.profiler.stop_trace()
    events = _device_events(trace_dir)
  result = {"wall_us": wall_us}
  if events:
    durations = [d for _, d, _ in events]
    per_name = collections.Counter()
    for _, d, name in events:
      per_name[name] += d / 1e3 / calls
    result["kernel_us"] = dict(per_name.most_common())
    if len(durations) % calls == 0:
      per_call = len(durations) // calls
      block = iters * per_call
      means = [sum(durations[r * block:(r + 1) * block]) / 1e3 / iters
               for r in range(repeats)]
      result["device_us"] = statistics.median(means)
      result["device_split"] = True
      result["kernels_per_call"] = per_call
    else:
      result["device_us"] = sum(durations) / 1e3 / calls
      result["device_split"] = False
  result["us"] = result.get("device_us", result["wall_us"])
  return result


def measure_bandwidth(gib: float = 2.0) -> float:
  """Bytes/s of a large device copy (read + write), median of 5."""
  n = int(gib * 2**30 / 4)
  x = jnp.arange(n, dtype=jnp.float32)
  copy = jax.jit(lambda a: a * 1.0001)
  t = time_op(copy, [x], iters=5, repeats=3)["us"]
  return 2 * n * 4 / (t * 1e-6)


DISTS = ("randn", "llm")
LLM_HEADS = 8


def make_logits(key, batch: int, vocab: int, dist: str = "randn"):
  """fp32 logits ``[batch, vocab]`` of a named distribution (module doc)."""
  bulk_key, id_key, value_key = jax.random.split(key, 3)
  x = jax.random.normal(bulk_key, (batch, vocab), jnp.float32) * 2
  if dist == "randn":
    return x
  if dist == "llm":
    ids = jax.vmap(lambda k: jax.random.choice(k, vocab, (LLM_HEADS,),
                                               replace=False))(
        jax.random.split(id_key, batch))
    heads = jax.random.uniform(value_key, (batch, LLM_HEADS), jnp.float32,
                               15.0, 25.0)
    return x.at[jnp.arange(batch)[:, None], ids].set(heads)
  raise ValueError(f"unknown distribution {dist!r}; expected one of {DISTS}")


def rotating_inputs(batch, vocab, dtype, seed=0, dist="randn"):
  """Distinct random logits buffers, enough to exceed 2x the L2 (at most 64)."""
  n_bytes = batch * vocab * jnp.dtype(dtype).itemsize
  count = int(min(64, max(2, -(-2 * L2_BYTES // max(n_bytes, 1)))))
  keys = jax.random.split(jax.random.key(seed), count)
  return [make_logits(k, batch, vocab, dist).astype(dtype) for k in keys]


def raced_fraction(inputs: list, temperature: float) -> float:
  """Fraction of RNG tiles that drew random bits in the Pallas philox kernel
  with the tile skip on (``gumbel.TILE_SKIP``)."""
  batch, vocab = inputs[0].shape
  params = js.SamplingParams.make(batch, temperature=temperature)
  config = js.SamplerConfig(implementation="pallas", rng="philox")
  streams, _ = rng.row_streams(jax.random.key(1), None, batch, vocab)
  fn = jax.jit(lambda x: gumbel.gumbel_partials(
      x, params.temperature, streams, config).raced_tiles)
  tiles = -(-vocab // rng.PHILOX_TILE)
  with gumbel.options(tile_skip=True):
    raced = [float(jnp.sum(fn(x))) for x in inputs[:4]]
  return sum(raced) / (len(raced) * batch * tiles)


def ops(batch: int, temperature: float, fp64: bool) -> dict[str, Callable]:
  """The ops compared, each a jitted function of one logits array.

  Two of them show what reading the inputs costs, with no sampling:
  ``jnp.max`` reads the logits once and does nothing else (XLA's row
  reduction), and ``jaxsample pallas greedy`` is the Gumbel kernel's launch
  plan, loads, argmax and combine with T = 0 (no random bits, no exp).
  """
  key = jax.random.key(1)
  params = js.SamplingParams.make(batch, temperature=temperature)
  greedy = js.SamplingParams.make(batch, temperature=0.0)
  t = params.temperature[:, None]

  def sampler(tile_skip=False, params=params, **config):
    cfg = js.SamplerConfig(**config)
    fn = jax.jit(lambda x: js.sample(x, params, key, config=cfg).tokens)

    def call(x):
      # The kernel's opt-in flags are read while tracing (first call).
      with jax.enable_x64(cfg.use_fp64_gumbel), gumbel.options(
          tile_skip=tile_skip):
        return fn(x)

    return call

  table = {
      "jaxsample pallas philox": sampler(implementation="pallas", rng="philox"),
      "jaxsample pallas philox skip": sampler(
          tile_skip=True, implementation="pallas", rng="philox"),
      "jaxsample pallas threefry": sampler(implementation="pallas",
                                           rng="threefry"),
      "jaxsample pallas greedy": sampler(params=greedy,
                                         implementation="pallas"),
      "jaxsample xla reference": sampler(implementation="xla", rng="philox"),
      "jnp.max": jax.jit(lambda x: jnp.max(x, axis=-1)),
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


def write_json(path: str, bandwidth: float, rows: list) -> None:
  """Writes a benchmark's rows with the device, JAX version, bandwidth and argv."""
  with open(path, "w") as f:
    json.dump({"device": jax.devices()[0].device_kind,
               "backend": jax.default_backend(), "jax": jax.__version__,
               "bandwidth_bytes_per_s": bandwidth, "argv": sys.argv,
               "rows": rows}, f, indent=1)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", default="1,8,32,128,256,512")
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--dists", default="randn,llm",
                      help=f"logit distributions, of {DISTS} (module doc)")
  parser.add_argument("--temperature", type=float, default=0.7)
  parser.add_argument("--ops", default="",
                      help="comma-separated substrings selecting ops")
  parser.add_argument("--later-dist-ops",
                      default="pallas,jax.random.categorical,jnp.argmax",
                      help="substrings selecting the ops timed on every "
                      "distribution after the first (the others do not "
                      "depend on the data)")
  parser.add_argument("--iters", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--fp64", action="store_true")
  parser.add_argument("--json", default="")
  parser.add_argument("--kernels", type=int, default=0,
                      help="also print the N costliest device ops per row")
  parser.add_argument("--resident", action="store_true",
                      help="time every op on one input buffer (dist "
                      "'DIST-L2'), which stays in the L2 when it fits: "
                      "what the op costs when HBM is not its bound")
  args = parser.parse_args(argv)

  bandwidth = measure_bandwidth()
  device = jax.devices()[0]
  print(f"# device: {device.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
        f"floor = logits bytes / copy bandwidth")
  rows = []
  selected = [s for s in args.ops.split(",") if s]
  later = [s for s in args.later_dist_ops.split(",") if s]
  dists = args.dists.split(",")
  header = (f"{'op':34s} {'dist':6s} {'dtype':8s} {'B':>4s} {'us':>9s} "
            f"{'wall_us':>9s} {'floor_us':>9s} {'x_floor':>8s} {'raced':>6s}")
  print(header)
  for dtype in args.dtypes.split(","):
    for batch in [int(b) for b in args.batch.split(",")]:
      floor_us = batch * args.vocab * jnp.dtype(dtype).itemsize / bandwidth * 1e6
      table = ops(batch, args.temperature, args.fp64)  # compiled once per B
      for d, dist in enumerate(dists):
        inputs = rotating_inputs(batch, args.vocab, jnp.dtype(dtype), dist=dist)
        if args.resident:
          inputs, dist = inputs[:1], f"{dist}-L2"
        raced = None
        for name, fn in table.items():
          if selected and not any(s in name for s in selected):
            continue
          if d and not any(s in name for s in later):
            continue
          r = time_op(fn, inputs, args.iters, args.repeats)
          row = dict(op=name, dist=dist, dtype=dtype, batch=batch,
                     vocab=args.vocab, floor_us=floor_us,
                     x_floor=r["us"] / floor_us, **r)
          if (name == "jaxsample pallas philox skip" and dtype == "float32" and
              jax.default_backend() == "gpu"):
            raced = raced_fraction(inputs, args.temperature)
            row["raced_fraction"] = raced
          rows.append(row)
          tag = f"{row['raced_fraction']:6.2f}" if "raced_fraction" in row else ""
          print(f"{name:34s} {dist:6s} {dtype:8s} {batch:4d} {r['us']:9.1f} "
                f"{r['wall_us']:9.1f} {floor_us:9.1f} {row['x_floor']:8.2f} "
                f"{tag}", flush=True)
          for kernel, us in list(r.get("kernel_us", {}).items())[:args.kernels]:
            print(f"    {us:8.2f}  {kernel[:80]}")
        del inputs
  if args.json:
    write_json(args.json, bandwidth, rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
