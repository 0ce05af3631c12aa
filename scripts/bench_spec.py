"""Device-time benchmark of speculative-decoding rejection sampling.

``PYTHONPATH=. python3 scripts/bench_spec.py [--batch 1,32,128] [--k 1,4,8]
[--dtypes float32,bfloat16] [--draft both|yes|no] [--json PATH]``

Same method as ``jaxsample.bench``: every op is jitted, warmed up and called
on rotating inputs (distinct target / draft logits buffers, > 2x the L2)
under the JAX profiler (``bench.time_op``: profiler-summed GPU kernel and copy
time per call, median over repeats; wall time per call alongside).  The HBM
floor is the bytes of the target logits ``[B, k + 1, V]`` (and of the draft
logits ``[B, k, V]``) read once, over the bandwidth of a large device copy
measured in the same run (``bench.measure_bandwidth``).

Ops per (dtype, B, k, draft logits or one-hot drafts):

* ``pallas``: ``rejection_sample(implementation="pallas")``, standard mode;
* ``pallas syn=R``: the same with ``synthetic_rates`` = ``R`` per slot, for
  each ``R`` of ``--rates``.  Pass 1 and the glue do the same work as the
  standard mode; pass 2 emits one token per request either way, but a
  rejection with draft logits races the residual (two rows) and a bonus token
  the plain target (one row), so the mix of ``num_accepted`` matters: on
  random logits the standard mode rejects at slot 0 almost always, which is
  the mix of ``R = 0``;
* ``pallas +mask K_cap=N`` (``--mask-caps``): the standard mode with
  ``return_mask=True`` and ``max_mask_ids = N``;
* ``xla``: the XLA reference (``implementation="xla"``), standard mode;
* ``jnp.max``: the target (and draft) logits read once by XLA's row max and
  nothing else: what the reads alone cost.

Each op returns the whole ``SpecResult`` (tokens, counts and logprobs), and
the synthetic rates are an argument of the jitted function: constant rates,
or dropped logprobs, would let XLA skip work the standard mode does.

For the Pallas ops the trace's device time per call is split into pass 1
(``jaxsample_spec_stats``; one-hot drafts: the single Gumbel pass,
``jaxsample_gumbel_max``), pass 2 (``jaxsample_spec_emit``) and the XLA glue
(every other kernel), with the kernels per call.

Inputs: ``2 N(0, 1)`` logits (``--dist llm`` adds head tokens, see
``jaxsample.bench``; needs a ``bench.rotating_inputs`` with ``dist``), draft
tokens = argmax of the draft logits (one-hot: random tokens; either way
computed before timing, as the drafter's output), ``n = k``,
``--temperature`` and the filters ``--top-k`` / ``--top-p`` / ``--min-p``
for every request, per-request keys and random positions.  With
random logits nearly every request rejects at slot 0 in the standard mode;
the synthetic mode spreads ``num_accepted`` over ``0 .. k``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample as js
from jaxsample import bench

PASS1 = ("jaxsample_spec_stats", "jaxsample_gumbel_max")  # or the one pass
PASS2 = ("jaxsample_spec_emit",)


def breakdown(kernel_us: dict) -> dict:
  """Device us per call of pass 1, pass 2 and the rest (``bench.time_op``'s
  ``kernel_us``)."""
  part = lambda keep: sum(us for n, us in kernel_us.items() if keep(n))
  named = lambda names: lambda n: any(name in n for name in names)
  glue = lambda n: not named(PASS1 + PASS2)(n)
  return {
      "pass1_us": part(named(PASS1)),
      "pass2_us": part(named(PASS2)),
      "other_us": part(glue),
      "other_kernels": sorted(filter(glue, kernel_us)),
  }


def make_inputs(batch, k, vocab, dtype, with_draft, dist, seed):
  """Rotating ``(target, draft, drafts)`` triples: ``draft`` None for one-hot
  drafts (``drafts`` random tokens), else ``drafts`` its argmax (computed
  here, outside the timed function: the drafter's output)."""
  kw = {} if dist == "randn" else {"dist": dist}
  target = bench.rotating_inputs(batch * (k + 1), vocab, dtype, seed=seed, **kw)
  target = [t.reshape(batch, k + 1, vocab) for t in target]
  if not with_draft:
    r = np.random.default_rng(seed)
    random_drafts = jnp.asarray(r.integers(0, vocab, (batch, k)), jnp.int32)
    return [(t, None, random_drafts) for t in target]
  draft = bench.rotating_inputs(batch * k, vocab, dtype, seed=seed + 1, **kw)
  draft = [d.reshape(batch, k, vocab) for d in draft]
  drafts = [jnp.argmax(d, axis=-1).astype(jnp.int32) for d in draft]
  count = max(len(target), len(draft))
  return [(target[i % len(target)], draft[i % len(draft)],
           drafts[i % len(draft)]) for i in range(count)]


def ops(batch, k, filters, rates, config_kw, mask_caps=()) -> dict:
  """The timed ops, each a jitted function of one ``make_inputs`` triple;
  ``filters``: ``SamplingParams.make``'s keywords, the same for every
  request; ``mask_caps``: ``K_cap`` values of ``pallas +mask`` ops (the
  standard mode with ``return_mask=True``)."""
  r = np.random.default_rng(batch * 100 + k)
  params = js.SamplingParams.make(batch, **filters)
  keys = jax.random.split(jax.random.key(3), batch)
  positions = jnp.asarray(r.integers(0, 2**20, batch), jnp.int32)
  n = jnp.full((batch,), k, jnp.int32)
  def op(impl, rate=None, mask_cap=0):
    config = js.SamplerConfig(implementation=impl, **config_kw,
                              **(dict(max_mask_ids=mask_cap) if mask_cap
                                 else {}))
    # The rates are an argument, as a harness sweeping them passes them:
    # constants would let XLA fold the acceptance test.
    rates = None if rate is None else jnp.full((k,), rate, jnp.float32)

    @jax.jit
    def run(inputs, rates):
      target, draft, drafts = inputs
      return js.spec.rejection_sample(
          target, drafts, n, params, keys, draft_logits=draft,
          synthetic_rates=rates, positions=positions, config=config,
          return_mask=bool(mask_cap))

    return functools.partial(run, rates=rates)

  table = {"pallas": op("pallas")}
  table.update({f"pallas +mask K_cap={c}": op("pallas", mask_cap=c)
                for c in mask_caps})
  table.update({f"pallas syn={r:g}": op("pallas", r) for r in rates})
  table["xla"] = op("xla")

  @jax.jit
  def read_once(inputs):  # the logits read once, nothing else
    target, draft, _ = inputs
    row_max = jnp.max(target, axis=-1)
    return row_max if draft is None else (row_max, jnp.max(draft, axis=-1))

  table["jnp.max"] = read_once
  return table


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", default="1,32,128")
  parser.add_argument("--k", default="1,4,8")
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--draft", default="both", choices=("both", "yes", "no"))
  parser.add_argument("--dist", default="randn")
  parser.add_argument("--temperature", type=float, default=0.7)
  parser.add_argument("--top-k", type=int, default=0)
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--min-p", type=float, default=0.0)
  parser.add_argument("--rates", default="0.8,0",
                      help="synthetic acceptance rates per slot to time")
  parser.add_argument("--mask-caps", default="",
                      help="K_cap values: also time the standard mode with "
                      "return_mask=True")
  parser.add_argument("--ops", default="",
                      help="comma-separated substrings selecting ops")
  parser.add_argument("--iters", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--no-breakdown", dest="breakdown", action="store_false")
  for name in ("block_size", "num_splits", "num_warps", "num_stages"):
    parser.add_argument(f"--{name.replace('_', '-')}", default="",
                        help=f"SamplerConfig.{name}: comma-separated values "
                        "to sweep (default: the heuristic)")
  parser.add_argument("--rng", default="philox")
  parser.add_argument("--json", default="")
  parser.add_argument("--hlo", default="",
                      help="a folder: also write each Pallas op's optimized HLO")
  args = parser.parse_args(argv)

  sweeps = {name: [int(v) for v in getattr(args, name).split(",") if v]
            for name in ("block_size", "num_splits", "num_warps", "num_stages")}
  plans = [dict(zip(sweeps, values)) for values in itertools.product(
      *[v or [None] for v in sweeps.values()])]
  selected = [s for s in args.ops.split(",") if s]
  drafts = {"both": (False, True), "yes": (True,), "no": (False,)}[args.draft]

  bandwidth = bench.measure_bandwidth()
  device = jax.devices()[0]
  print(f"# device: {device.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
        f"V={args.vocab}, T={args.temperature}, top_k={args.top_k}, "
        f"top_p={args.top_p:g}, min_p={args.min_p:g}, rng={args.rng}, "
        f"dist={args.dist}; floor = target (+ draft) logits bytes / copy "
        "bandwidth")
  print(f"{'op':23s} {'plan':24s} {'dtype':8s} {'B':>4s} {'k':>2s} "
        f"{'draft':5s} {'us':>8s} {'wall':>8s} {'floor':>7s} {'x_floor':>7s} "
        f"{'pass1':>7s} {'pass2':>7s} {'other':>7s} {'kern':>5s}")
  rows = []
  for dtype, batch, k, with_draft in itertools.product(
      args.dtypes.split(","), [int(b) for b in args.batch.split(",")],
      [int(k) for k in args.k.split(",")], drafts):
    itemsize = jnp.dtype(dtype).itemsize
    rows_read = batch * (k + 1) + (batch * k if with_draft else 0)
    floor_us = rows_read * args.vocab * itemsize / bandwidth * 1e6
    inputs = make_inputs(batch, k, args.vocab, jnp.dtype(dtype), with_draft,
                         args.dist, seed=batch * 10 + k)
    for plan in plans:
      config_kw = {key: v for key, v in plan.items() if v is not None}
      filters = dict(temperature=args.temperature, top_k=args.top_k,
                     top_p=args.top_p, min_p=args.min_p)
      table = ops(batch, k, filters,
                  [float(v) for v in args.rates.split(",") if v],
                  dict(config_kw, rng=args.rng),
                  [int(c) for c in args.mask_caps.split(",") if c])
      for name, fn in table.items():
        if selected and not any(s in name for s in selected):
          continue
        if name in ("xla", "jnp.max") and plan is not plans[0]:
          continue  # they ignore the plan
        if args.hlo and name.startswith("pallas"):
          label = "".join(c if c.isalnum() else "_" for c in
                          f"{name}_{dtype}_B{batch}_k{k}_draft{with_draft}")
          with open(os.path.join(args.hlo, f"{label}.hlo"), "w") as f:
            f.write(fn.func.lower(inputs[0], **fn.keywords).compile().as_text())
        for triple in inputs[:2]:  # warm-up beyond time_op's single call
          jax.block_until_ready(fn(triple))
        r = bench.time_op(fn, inputs, args.iters, args.repeats)
        row = dict(op=name, plan=config_kw, dtype=dtype, batch=batch, k=k,
                   draft=with_draft, vocab=args.vocab, floor_us=floor_us,
                   x_floor=r["us"] / floor_us, **r)
        if args.breakdown and name.startswith("pallas") and "kernel_us" in r:
          row.update(breakdown(r["kernel_us"]))
        rows.append(row)
        plan_s = ",".join(f"{key}={v}" for key, v in config_kw.items()) or "default"
        part = lambda key: (f"{row[key]:7.1f}" if key in row else f"{'':7s}")
        kern = (f"{row['kernels_per_call']:5.1f}" if "kernels_per_call" in row
                else "")
        print(f"{name:23s} {plan_s:24s} {dtype:8s} {batch:4d} {k:2d} "
              f"{'yes' if with_draft else 'no':5s} {r['us']:8.1f} "
              f"{r['wall_us']:8.1f} {floor_us:7.1f} {row['x_floor']:7.2f} "
              f"{part('pass1_us')} {part('pass2_us')} {part('other_us')} "
              f"{kern}", flush=True)
    del inputs

  # Summary: synthetic vs standard, kernels vs reference.
  print("\n# device time ratios: synthetic / standard, with masks / "
        "standard, xla / pallas")
  index = {(r["op"], str(r["plan"]), r["dtype"], r["batch"], r["k"],
            r["draft"]): r["us"] for r in rows}
  ratios = collections.defaultdict(list)
  for (op, plan, dtype, batch, k, draft), us in index.items():
    if op != "pallas":
      continue
    line = (f"{dtype:8s} B={batch:<4d} k={k} draft={'yes' if draft else 'no ':3s}"
            f" plan={plan:20s}")
    for other, other_us in index.items():
      if other[1:] != (plan, dtype, batch, k, draft):
        continue
      if other[0].startswith("pallas syn="):
        ratios[other[0]].append(other_us / us)
        line += f" {other[0][7:]}/std={other_us / us:.3f}"
      elif other[0].startswith("pallas +mask"):
        line += f" {other[0][13:]}/std={other_us / us:.2f}"
    xla = index.get(("xla", str({}), dtype, batch, k, draft))
    if xla is not None:
      line += f" xla/pallas={xla / us:.2f}"
    print(line)
  for name, values in ratios.items():
    print(f"# {name[7:]} / standard: median {statistics.median(values):.3f}, "
          f"min {min(values):.3f}, max {max(values):.3f}")
  if args.json:
    bench.write_json(args.json, bandwidth, rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
