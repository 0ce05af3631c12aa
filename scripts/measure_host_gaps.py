"""What the samplers' ``lax.cond``s cost beyond their kernels, per decode step.

    PYTHONPATH=. python3 scripts/measure_host_gaps.py [--batch 1,32,128]

XLA runs a ``lax.cond`` on a GPU by copying its predicate to the host, which
waits for it and then launches the branch: the GPU idles meanwhile, and the
host cannot queue later steps ahead.  ``jaxsample.bench`` sums kernel
durations, so it leaves that time out.  Per op, on one logits buffer with a
fresh key per step (no profiler running while the wall clock runs):

* ``calls``: wall time per call of ``--calls`` back-to-back calls of the
  jitted step from Python (a Python decode loop), blocking once at the end;
* ``loop``: wall time per step of a jitted ``lax.fori_loop`` of ``--steps``
  steps (XLA's while loop also sends its predicate to the host);
* ``kernels``: the summed device time of one step's kernels and copies
  (``jaxsample.bench.time_op``; its wall clock off GPU).

Ops: ``jnp.argmax`` and ``jax.random.categorical`` (no cond: the floor of the
dispatch and loop costs), then ``jaxsample.sample`` per setting with the
params as a jit argument (the serving case: the conds run) and, for
``none``, closed over (``rowwise.cond`` resolves the branch while tracing).
With ``--spec-k K``, also ``jaxsample.spec.rejection_sample`` per setting
(``K`` one-hot drafts of random tokens per request, target logits ``[B, K +
1, V]``), params as an argument and closed over.  Medians over
``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jaxsample as js
from jaxsample import bench

SETTINGS = {
    "none": dict(),
    "top_k50+top_p0.9": dict(top_k=50, top_p=0.9),
    "top_p0.95": dict(top_p=0.95),
}


def step_fns(batch, setting, mask_cap):
  """``{name: step(x, key, params) -> scalar}``."""
  if setting == "baselines":
    return {
        "jnp.argmax": (lambda x, key, _: jnp.sum(jnp.argmax(x, axis=-1)),
                       None),
        "jax.random.categorical": (lambda x, key, _: jnp.sum(
            jax.random.categorical(key, x, axis=-1)), None),
    }
  params = js.SamplingParams.make(batch, temperature=1.0, **SETTINGS[setting])

  def sample(x, key, params, return_mask=False):
    out = js.sample(x, params, key, return_mask=return_mask,
                    config=js.SamplerConfig(implementation="pallas",
                                            max_mask_ids=mask_cap))
    result, mask = out if return_mask else (out, None)
    total = jnp.sum(result.tokens) + jnp.sum(result.logprobs)
    if mask is not None:
      total = total + jnp.sum(mask.ids) + jnp.sum(mask.logz)
    return total

  fns = {f"sample {setting}, params as argument": sample}
  if setting == "none":
    fns[f"sample {setting}, params closed over"] = (
        lambda x, key, _: sample(x, key, params))
  else:
    fns[f"sample + mask K_cap {mask_cap} {setting}, params as argument"] = (
        lambda x, key, params: sample(x, key, params, return_mask=True))
  return {name: (fn, params) for name, fn in fns.items()}


def spec_fns(batch, setting, k):
  """``{name: (step(x, key, params), params)}`` of speculative verification:
  ``x`` is ``[B, k + 1, V]``."""
  params = js.SamplingParams.make(batch, temperature=1.0, **SETTINGS[setting])
  config = js.SamplerConfig(implementation="pallas")

  def verify(x, key, params):
    drafts = jax.random.randint(jax.random.fold_in(key, 1), (batch, k), 0,
                                x.shape[-1])
    out = js.spec.rejection_sample(x, drafts, jnp.full((batch,), k), params,
                                   key, config=config)
    return (jnp.sum(out.tokens) + jnp.sum(out.num_accepted) +
            jnp.sum(jnp.where(out.tokens >= 0, out.logprobs, 0.0)))

  return {
      f"spec k={k} {setting}, params as argument": (verify, params),
      f"spec k={k} {setting}, params closed over": (
          lambda x, key, _: verify(x, key, params), params),
  }


def time_calls(fn, x, key, params, calls, repeats):
  step = jax.jit(fn)
  keys = jax.random.split(key, calls)
  jax.block_until_ready(step(x, keys[0], params))
  per_call = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = [step(x, k, params) for k in keys]
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) * 1e6 / calls)
  return statistics.median(per_call)


def time_loop(fn, x, key, params, steps, repeats):
  @jax.jit
  def loop(x, key, params):
    body = lambda i, acc: acc + fn(x, jax.random.fold_in(key, i),
                                   params).astype(jnp.float32)
    return jax.lax.fori_loop(0, steps, body, jnp.zeros((), jnp.float32))

  jax.block_until_ready(loop(x, key, params))
  per_step = []
  for r in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(loop(x, jax.random.fold_in(key, r), params))
    per_step.append((time.perf_counter() - start) * 1e6 / steps)
  return statistics.median(per_step)


def main():
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", default="1,32,128")
  parser.add_argument("--settings", default=",".join(SETTINGS))
  parser.add_argument("--calls", type=int, default=64)
  parser.add_argument("--steps", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--mask-cap", type=int, default=1024)
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--spec-k", type=int, default=0)
  parser.add_argument("--skip-sample", action="store_true")
  args = parser.parse_args()
  print(f"# {jax.devices()[0].device_kind}; V = {args.vocab}, fp32, T = 1; "
        f"medians of {args.repeats}; us per step")
  print("| B | op | calls (wall) | loop (wall) | kernels (device) |")
  print("|---|---|---|---|---|")
  key = jax.random.key(0)
  for batch in map(int, args.batch.split(",")):
    x = jax.random.normal(jax.random.key(batch), (batch, args.vocab))
    settings = [] if args.skip_sample else ["baselines"] + args.settings.split(
        ",")
    ops = [(x, name, fn_params) for setting in settings
           for name, fn_params in step_fns(batch, setting,
                                           args.mask_cap).items()]
    if args.spec_k:
      target = jax.random.normal(jax.random.key(batch),
                                 (batch, args.spec_k + 1, args.vocab))
      ops += [(target, name, fn_params) for setting in
              args.settings.split(",")
              for name, fn_params in spec_fns(batch, setting,
                                              args.spec_k).items()]
    for inputs, name, (fn, params) in ops:
      calls = time_calls(fn, inputs, key, params, args.calls, args.repeats)
      loop = time_loop(fn, inputs, key, params, args.steps, args.repeats)
      step = jax.jit(fn)
      kernels = bench.time_op(lambda x: step(x, key, params), [inputs],
                              iters=16, repeats=3)["us"]
      print(f"| {batch} | {name} | {calls:.1f} | {loop:.1f} | "
            f"{kernels:.1f} |", flush=True)

if __name__ == "__main__":
  main()
