"""Truncated sampling and sampling masks on the GPU: device time vs peers.

    PYTHONPATH=. python3 scripts/bench_truncation.py --json out.json

Rows: jaxsample's kernels (``implementation="pallas"``), the XLA reference
(sorting), ``lax.top_k`` + categorical, sort + cumsum top-p, and a torch
sort-based top-k/top-p sampler (vLLM's fallback style) timed with CUDA events
on the same GPU; then sample + mask vs sample alone (``--extract``: and
``extract_sampling_mask`` on the kernels and on XLA).  Device time as in
``jaxsample.bench`` (profiler-summed kernels, medians, rotating inputs); HBM
floor = bytes of logits / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxsample as js  # noqa: E402
from jaxsample import bench  # noqa: E402

SETTINGS = {
    "top_k50": dict(top_k=50),
    "top_p0.9": dict(top_p=0.9),
    "top_k50+top_p0.9": dict(top_k=50, top_p=0.9),
    "min_p0.05": dict(min_p=0.05),
    "top_p0.95": dict(top_p=0.95),
    # Large top-k (above C / 2: the window searches).
    "top_k1000": dict(top_k=1000),
    "top_k20000": dict(top_k=20000),
    "top_k150000": dict(top_k=150000),
    "top_k20000+top_p0.9": dict(top_k=20000, top_p=0.9),
}
# The settings (the default).
MAIN_SETTINGS = ("top_k50", "top_p0.9", "top_k50+top_p0.9", "min_p0.05",
                 "top_p0.95")
MASK_SETTINGS = ("top_k50+top_p0.9", "top_p0.95")
DISTRIBUTIONS = ("randn_x1", "randn_x5", "zipf")
# Ties no candidate buffer or window holds (the pivot search): every entry
# equal, or random-normal rounded to halves (about 20 values).
TIE_DISTRIBUTIONS = ("flat", "halves")


def make_inputs(kind, batch, vocab, dtype, seed=0):
  """Rotating logits buffers of one distribution (see ``bench.rotating_inputs``)."""
  n_bytes = batch * vocab * jnp.dtype(dtype).itemsize
  count = int(min(16, max(2, -(-2 * bench.L2_BYTES // max(n_bytes, 1)))))
  out = []
  for i, key in enumerate(jax.random.split(jax.random.key(seed), count)):
    x = jax.random.normal(key, (batch, vocab), jnp.float32)
    if kind == "randn_x5":
      x = x * 5
    elif kind == "flat":
      x = jnp.full_like(x, 0.5 + i)
    elif kind == "halves":
      x = jnp.round(x * 2) / 2
    elif kind == "zipf":  # p_r ~ r^-1.1 over a random permutation of ranks
      ranks = jax.random.permutation(jax.random.fold_in(key, i),
                                     jnp.arange(1, vocab + 1), independent=True)
      ranks = jnp.broadcast_to(ranks, (batch, vocab))
      ranks = jax.vmap(lambda k, r: jax.random.permutation(k, r))(
          jax.random.split(key, batch), ranks)
      x = -1.1 * jnp.log(ranks.astype(jnp.float32)) + 0.1 * x
    out.append(x.astype(dtype))
  return out


def jax_ops(batch, setting, with_mask_caps, peers, extract=False,
            candidates=None):
  key = jax.random.key(1)
  params = js.SamplingParams.make(batch, temperature=1.0, **SETTINGS[setting])
  k = SETTINGS[setting].get("top_k", 0)
  p = SETTINGS[setting].get("top_p", 1.0)

  def sampler(impl, mask_cap=None):
    cfg = js.SamplerConfig(implementation=impl,
                           **({"max_mask_ids": mask_cap} if mask_cap else {}),
                           **({"max_candidates": candidates}
                              if candidates else {}))
    # Params are arguments, as in a decode loop (captured as constants, XLA
    # would fold the row conditions away).  The whole result (tokens,
    # logprobs, valid), as the mask rows return it.
    fn = jax.jit(lambda x, params: js.sample(
        x, params, key, config=cfg, return_mask=bool(mask_cap)))
    return lambda x: fn(x, params)

  suffix = f" C={candidates}" if candidates else ""
  table = {"jaxsample pallas" + suffix: sampler("pallas")}
  if peers:
    table["jaxsample xla reference"] = sampler("xla")
    if k:
      table["lax.top_k+categorical"] = jax.jit(
          lambda x: _top_k_sample(key, x, k))
    if p < 1:
      table["sort top-p+categorical"] = jax.jit(
          lambda x: _sort_top_p(key, x, p))
  for cap in with_mask_caps:
    table[f"jaxsample pallas +mask K_cap={cap}" + suffix] = sampler(
        "pallas", cap)
    for impl in ("pallas", "xla") if extract else ():
      cfg = js.SamplerConfig(implementation=impl, max_mask_ids=cap)
      fn = jax.jit(lambda x, params, cfg=cfg: js.extract_sampling_mask(
          x, params, config=cfg))
      table[f"extract_sampling_mask {impl} K_cap={cap}"] = (
          lambda x, fn=fn: fn(x, params))
  return table


def _top_k_sample(key, x, k):
  values, indices = jax.lax.top_k(x.astype(jnp.float32), k)
  choice = jax.random.categorical(key, values)
  return jnp.take_along_axis(indices, choice[:, None], axis=-1)[:, 0]


def _sort_top_p(key, x, p):
  y = x.astype(jnp.float32)
  order = jnp.argsort(-y, axis=-1)
  ys = jnp.take_along_axis(y, order, axis=-1)
  probs = jax.nn.softmax(ys, axis=-1)
  ys = jnp.where(jnp.cumsum(probs, axis=-1) - probs < p, ys, -jnp.inf)
  choice = jax.random.categorical(key, ys)
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def torch_time_us(inputs, setting, iters=30):
  """Median CUDA-event time of a torch sort-based top-k/top-p sampler."""
  try:
    import torch
  except ImportError:
    return None
  k = SETTINGS[setting].get("top_k", 0)
  p = SETTINGS[setting].get("top_p", 1.0)
  min_p = SETTINGS[setting].get("min_p", 0.0)
  tensors = [torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda()
             for x in inputs[:4]]
  if inputs[0].dtype == jnp.bfloat16:
    tensors = [t.bfloat16() for t in tensors]

  def sample(logits):
    logits = logits.float()
    if min_p:
      probs = logits.softmax(-1)
      top = probs.max(-1, keepdim=True).values
      logits = logits.masked_fill(probs < min_p * top, float("-inf"))
    if k or p < 1:
      ordered, index = logits.sort(dim=-1, descending=False)
      if k:
        kth = ordered.gather(1, torch.full((ordered.shape[0], 1),
                                           ordered.shape[1] - k,
                                           device=ordered.device))
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
      if p < 1:
        cum = ordered.softmax(-1).cumsum(-1)
        drop = cum <= 1 - p
        drop[:, -1] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
      logits = ordered.scatter(1, index, ordered)
    probs = logits.softmax(-1)
    noise = torch.empty_like(probs).exponential_()
    return probs.div_(noise).argmax(-1)

  for t in tensors:
    sample(t)
  times = []
  for i in range(iters):
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    sample(tensors[i % len(tensors)])
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) * 1e3)
  return statistics.median(times)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", default="1,32,128,256")
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--settings", default=",".join(MAIN_SETTINGS),
                      help=f"any of {','.join(SETTINGS)}")
  parser.add_argument("--distributions", default=",".join(DISTRIBUTIONS),
                      help=f"any of {','.join(DISTRIBUTIONS + TIE_DISTRIBUTIONS)}")
  parser.add_argument("--mask-caps", default="64,1024,4096")
  parser.add_argument("--iters", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--torch", action="store_true")
  parser.add_argument("--peers", default="1,32,128,256",
                      help="batch sizes at which the peers run too")
  parser.add_argument("--extract", action="store_true",
                      help="also time extract_sampling_mask (kernels, XLA)")
  parser.add_argument("--candidates", default="",
                      help="max_candidates values to time (default: the "
                      "config's default)")
  parser.add_argument("--json", default="")
  args = parser.parse_args(argv)

  bandwidth = bench.measure_bandwidth()
  print(f"# device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
  print(f"{'op':36s} {'setting':17s} {'dist':9s} {'dtype':8s} {'B':>4s} "
        f"{'us':>9s} {'floor':>7s} {'x_floor':>7s}")
  rows = []
  caps = [int(c) for c in args.mask_caps.split(",") if c]
  for dtype in args.dtypes.split(","):
    for batch in [int(b) for b in args.batch.split(",")]:
      floor = batch * args.vocab * jnp.dtype(dtype).itemsize / bandwidth * 1e6
      for dist in args.distributions.split(","):
        inputs = make_inputs(dist, batch, args.vocab, jnp.dtype(dtype))
        for setting in args.settings.split(","):
          mask_caps = caps if setting in MASK_SETTINGS else []
          peers = str(batch) in args.peers.split(",")
          timed = {}
          for candidates in [int(c) for c in args.candidates.split(",")
                             if c] or [None]:
            timed.update(
                (name, bench.time_op(fn, inputs, args.iters,
                                     args.repeats)["us"])
                for name, fn in jax_ops(batch, setting, mask_caps, peers,
                                        args.extract, candidates).items())
          if args.torch and peers:
            torch_us = torch_time_us(inputs, setting)
            if torch_us is not None:
              timed["torch sort top-k/top-p"] = torch_us
          for name, us in timed.items():
            row = dict(op=name, setting=setting, dist=dist, dtype=dtype,
                       batch=batch, us=us, floor_us=floor, x_floor=us / floor)
            rows.append(row)
            print(f"{name:36s} {setting:17s} {dist:9s} {dtype:8s} {batch:4d} "
                  f"{us:9.1f} {floor:7.1f} {us / floor:7.2f}", flush=True)
        del inputs
  if args.json:
    bench.write_json(args.json, bandwidth, rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
