"""Start/end times and SM of every program of the Gumbel kernel (GPU only).

``PYTHONPATH=. python3 scripts/program_timeline.py OUT B [NUM_WARPS NUM_SPLITS]``
runs ``gumbel._kernel`` wrapped so that each program also writes
``%globaltimer_lo`` at its start and after its last result, and its ``%smid``;
prints how long the kernel's programs ran, how late they started and how
their ends spread, and saves the last run's arrays to
``OUT/timeline-B-WARPS-SPLITS.npz``; ``--summary FILE.npz...`` prints the
same spreads from saved runs.
Diagnostic for where a one-wave kernel's time goes (ramp-up, steady state,
tail); the timer reads are inline asm, ordered only by data dependencies.
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import jaxsample as js
from jaxsample import bench, rng, rowwise
from jaxsample.pallas import common, gumbel, tuning


def _special(register: str, like):
  """A special register's 32-bit value (``like`` orders the read)."""
  (value,) = plgpu.elementwise_inline_asm(
      f"mov.u32 $0, %{register};", args=[like], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(like.shape, jnp.int32)])
  return jnp.max(value)


def timed_kernel(*refs, **kw):
  *refs, start_ref, end_ref, sm_ref = refs
  row, split = pl.program_id(0), pl.program_id(1)
  dummy = jnp.full((32,), row + split, jnp.int32)
  start_ref[row, split] = _special("globaltimer_lo", dummy)
  gumbel._kernel(*refs, **kw)  # pylint: disable=protected-access
  index_ref = refs[4]  # row table, offset, x, race, index
  after = jnp.full((32,), index_ref[row, split], jnp.int32)
  end_ref[row, split] = _special("globaltimer_lo", after)
  sm_ref[row, split] = _special("smid", dummy)


def summarize(start, end, sm):
  """Prints the spread of one run's program start/end times (ns) per SM."""
  start_us, end_us = start / 1e3, end / 1e3
  q = lambda a: " ".join(f"{np.percentile(a, p):6.1f}" for p in
                         (0, 10, 50, 90, 100))
  print(f"  start us  p0/10/50/90/100: {q(start_us)}")
  print(f"  end   us  p0/10/50/90/100: {q(end_us)}")
  print(f"  run   us  p0/10/50/90/100: {q(end_us - start_us)}")
  per_sm = np.bincount(sm.ravel(), minlength=132)
  print(f"  programs per SM min/median/max: {per_sm.min()} "
        f"{int(np.median(per_sm))} {per_sm.max()}; SMs used "
        f"{(per_sm > 0).sum()}")
  last_end = np.array([end_us[sm == s].max() if (sm == s).any() else 0
                       for s in range(per_sm.size)])
  print(f"  SM finish us p0/10/50/90/100: {q(last_end[per_sm > 0])}")


def main(out, batch, warps=None, splits=None):
  vocab = 151936
  tuned = tuning.resolve(tuning.Tuning(gumbel=tuning.RaceLaunch(
      num_warps=warps, num_splits=splits)))
  plan = common.race_plan(batch, vocab, tuned.gumbel, tuned.occupancy,
                          generator="philox", fp64=False)
  params = js.SamplingParams.make(batch, temperature=0.7)
  streams, _ = rng.row_streams(jax.random.key(1), None, batch, vocab)
  shape = (batch, plan.num_splits)
  kernel = functools.partial(timed_kernel, plan=plan, vocab=vocab,
                             generator="philox", fp64=False, skip=False,
                             floored=False, count_finite=False)
  out_shape = [jax.ShapeDtypeStruct(shape, d) for d in (
      jnp.float32, jnp.int32, jnp.float32, jnp.float32, jnp.int32, jnp.int32,
      jnp.int32)]
  call = pl.pallas_call(kernel, out_shape=out_shape, grid=shape,
                        compiler_params=plan.compiler_params(),
                        name="timed_gumbel")

  @jax.jit
  def run(x):
    table = rowwise.pack_rows([params.temperature,
                               jnp.ones((batch,), jnp.int32), streams.key0,
                               streams.key1, streams.base_hi, streams.base_lo],
                              batch)
    return call(table, jnp.zeros((1,), jnp.int32), x)

  inputs = bench.rotating_inputs(batch, vocab, jnp.dtype(jnp.float32),
                                 dist="randn")
  results = []
  for i in range(20):
    outs = jax.block_until_ready(run(inputs[i % len(inputs)]))
    start, end, sm = (np.asarray(o) for o in outs[4:])
    t0 = start.min()  # ns since it, mod 2^32
    results.append(((start - t0).astype(np.uint32).astype(np.int64),
                    (end - t0).astype(np.uint32).astype(np.int64), sm))
  start, end, sm = results[-1]
  spans = [(e.max() - s.min()) / 1e3 for s, e, _ in results[5:]]
  print(f"B={batch} warps={plan.num_warps} splits={plan.num_splits}x"
        f"{plan.steps} programs={start.size} kernel span (first start to last"
        f" end) median of 15 runs {np.median(spans):.1f} us")
  summarize(start, end, sm)
  np.savez(f"{out}/timeline-{batch}-{plan.num_warps}-{plan.num_splits}.npz",
           start=start, end=end, sm=sm)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--summary", nargs="+", metavar="FILE.npz",
                      help="print the spreads of saved runs (no GPU needed)")
  parser.add_argument("out", nargs="?", help="folder for the run's .npz")
  parser.add_argument("plan", nargs="*", type=int, metavar="B [NUM_WARPS NUM_SPLITS]")
  cli = parser.parse_args()
  if cli.summary:
    for path in cli.summary:
      print(path)
      summarize(**np.load(path))
  elif cli.out is None or len(cli.plan) not in (1, 3):
    parser.error("give OUT B [NUM_WARPS NUM_SPLITS] or --summary FILE.npz...")
  else:
    main(cli.out, *cli.plan)
