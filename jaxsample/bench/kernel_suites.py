"""Suites that time kernel internals and orderings: pivot and sort.

* ``pivot``: the pivot search (``threshold.pivot_threshold``, the fallback of
  large kept sets) on randn rows, every row active and idle, by count (top-k
  ``V / 2``) and by mass (top-p 0.9): every pass runs.  ``--warps`` sets
  the pivot's ``tuning.PivotLaunch.num_warps``.
* ``sort``: XLA's orderings of ``[B, N]`` (value, id) pairs, as the mask
  listing sorts them (``--vocab`` is ``N``): values on a coarse grid (ties),
  ids in vocab order, each op checked against a numpy oracle (value
  descending, smallest id first; an unstable one-key sort may break ties
  otherwise).
  Two Pallas orderings (bitonic, rank by comparison) lost to these
  (``benchmarks/results/2026-11-26b-h200-extract/``); they are in
  ``scripts/bench_sort.py`` of commit 834697f.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsample.bench import cases as cases_lib
from jaxsample.bench.runner import Group, Suite
from jaxsample.bench.suites import grid_cases
from jaxsample._src.pallas import common, threshold
from jaxsample._src import tuning
from jaxsample._src.params import SamplerConfig, SamplingParams

__all__ = ["PIVOT", "SORT"]


def _pivot_options(parser):
  parser.add_argument("--warps", default="0", help="the pivot search's num_warps; 0: the device's")


def _build_pivot(args, case) -> Group:
  params = SamplingParams.make(case.batch, top_k=case.vocab // 2,
                               top_p=0.9).canonical(case.vocab)
  floor = jnp.full((case.batch,), -jnp.inf)
  row_max = jnp.full((case.batch,), 8.0)  # above every randn x1 logit
  ops = {}
  for warps, by_count, rows in itertools.product(
      [int(w) for w in args.warps.split(",")], (True, False), ("active", "idle")):
    active = jnp.full((case.batch,), rows == "active")
    config = SamplerConfig(tuning=tuning.overriding({"pivot.num_warps": warps})
                           if warps else None)
    fn = jax.jit(functools.partial(threshold.pivot_threshold, params=params, active=active,
                                   floor=floor, row_max=row_max, config=config,
                                   by_count=by_count))
    name = f"pivot {'count' if by_count else 'mass'} {rows}"
    ops[name + (f" warps={warps}" if warps else "")] = fn
  return Group(label=case.label(), inputs=case.inputs(most=2), ops=ops,
               floor_bytes=case.logits_bytes, peer_rows=lambda x: x,
               peer_filters=case.filters, temperature=case.temperature)


PIVOT = Suite(
    name="pivot",
    help="the pivot search of large kept sets (kernel), active and idle rows",
    defaults=dict(dists="randn_x1", temperature=1.0, iters=8, repeats=3),
    add_options=_pivot_options, cases=grid_cases, build=_build_pivot)


def _xla_sort(pairs, stable=True, num_keys=1):
  y, ids = pairs
  return lax.sort((-y, ids), num_keys=num_keys, is_stable=stable)[1]


def _xla_key_sort(pairs):
  """One uint32 key (descending order key), the ids as values, stable."""
  y, ids = pairs
  return lax.sort((~common.order_key(y), ids), num_keys=1, is_stable=True)[1]


def _oracle(y, ids) -> np.ndarray:
  y, ids = np.asarray(y), np.asarray(ids)
  return np.stack([ids[r][np.lexsort((ids[r], -y[r]))] for r in range(y.shape[0])])


def _build_sort(args, case) -> Group:
  width = case.vocab
  inputs = []
  for i in range(cases_lib.buffer_count(case.batch * width * 8, most=8)):
    y = jnp.round(jax.random.normal(jax.random.key(i), (case.batch, width)) * 8) / 8
    ids = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), y.shape)  # vocab order
    inputs.append((y, ids))
  ops = {"xla sort stable (-y, ids)": jax.jit(_xla_sort),
         "xla sort unstable (-y, ids)": jax.jit(functools.partial(_xla_sort, stable=False)),
         "xla sort unstable, 2 keys": jax.jit(functools.partial(_xla_sort, stable=False,
                                                                num_keys=2)),
         "xla sort uint32 key, stable": jax.jit(_xla_key_sort)}
  want = _oracle(*inputs[0])
  extra = {name: {"exact": bool(np.array_equal(np.asarray(fn(inputs[0])), want))}
           for name, fn in ops.items()}
  return Group(label=dict(case.label(), width=width), inputs=inputs, ops=ops,
               floor_bytes=case.batch * width * 8, peer_rows=lambda pairs: pairs[0],
               peer_filters={}, temperature=1.0, extra=extra)


SORT = Suite(
    name="sort",
    help="XLA orderings of [B, N] (value, id) pairs (the mask listing's sort; N = --vocab)",
    defaults=dict(batch="1,32,128,256", vocab=4096, iters=16, repeats=3),
    add_options=lambda parser: None, cases=grid_cases, build=_build_sort)
