"""Branch-free serving (``ServeLoop(branch_free=True)``,
``tuning.Branching(conds=False)``): the serving step program has no
data-dependent ``conditional`` or unknown-trip ``while`` outside the
kernels, and its outputs equal the default mode's bit for bit."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxsample import serve_demo
from jaxsample.bench import timing
from jaxsample.generation import serving
from jaxsample.pallas import tuning
from jaxsample.params import SamplerConfig
from jaxsample.serve_loop import NgramDrafter, ServeLoop, Speculation

from program_control import program_control
from test_serving import CACHE, SLOTS, random_requests
from test_serving import CONFIG as SERVING_CONFIG
from toy_lm import tiny_transformer

# A candidate buffer of 16 of the 32 ids: filtered rows of the tiny model
# keep more and take the large-set route (the cond's branch); masks of 16
# ids are wider than half the buffer: the listing and its fallback.
CONFIG = SamplerConfig(implementation="pallas", max_candidates=16,
                       max_mask_ids=16)


@pytest.fixture(scope="module")
def loops():
  """``loops(branch_free)``: a ``ServeLoop`` over one tiny model, masks
  on, built once per mode."""
  model = tiny_transformer(seed=0, vocab=32, max_len=CACHE, layers=1)
  return functools.cache(lambda free: ServeLoop(
      model, slots=SLOTS, cache_len=CACHE, config=CONFIG, return_masks=True,
      branch_free=free))


def step_control(loop: ServeLoop):
  """``program_control`` of the loop's step program (traced per-slot
  params, as every call)."""
  # pylint: disable=protected-access
  return program_control(loop._programs.step, loop._state, *loop._leaves,
                         loop._rates, loop._open_bitmask)


def assert_same_bits(got, want):
  """Two ``Completion``s with the same tokens, finish reason, drafts,
  masks, and logprob and logZ bits (-inf and -0.0 compare as themselves)."""
  assert got.token_ids == want.token_ids
  assert (got.finish_reason, got.drafted, got.accepted) == (
      want.finish_reason, want.drafted, want.accepted)
  assert got.sampling_mask == want.sampling_mask
  for field in ("logprobs", "logz"):
    np.testing.assert_array_equal(
        np.asarray(getattr(got, field) or [], np.float32).view(np.int32),
        np.asarray(getattr(want, field) or [], np.float32).view(np.int32))


def test_control_ops_lists_conds_and_unknown_trip_whiles():
  """The helper itself: a data-dependent cond and a ``while`` of traced
  bound are listed; a static ``fori_loop`` (a known trip count) and the
  ``pl.when`` inside an interpret-mode kernel are not."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

    @pl.when(x_ref[0] > 0)
    def _():
      o_ref[...] = -x_ref[...]

  def program(x, n):
    x = pl.pallas_call(kernel, out_shape=x, interpret=True,
                       name="jaxsample_test_kernel")(x)
    x = jax.lax.fori_loop(0, 3, lambda i, v: v + i, x)
    x = jax.lax.cond(x[0] > 1, lambda: x * 2, lambda: x)
    return jax.lax.fori_loop(0, n, lambda i, v: v + 1, x)

  ops = program_control(jax.jit(program), jnp.arange(8.0), 2)
  assert sorted(op.kind for op in ops) == ["conditional", "while"], ops
  assert all("test_branch_free.py" in op.source for op in ops), ops
  # a static trip count: the last loop is known too
  ops = program_control(jax.jit(lambda x: program(x, 2)), jnp.arange(8.0))
  assert [op.kind for op in ops] == ["conditional"], ops


@pytest.mark.kernels
def test_branch_free_step_program_has_no_data_dependent_control(loops):
  """No ``conditional`` and no unknown-trip ``while`` outside the kernels
  (the per-slot params are traced: every route is compiled)."""
  assert step_control(loops(True)) == []


@pytest.mark.kernels
@pytest.mark.slow
def test_outputs_are_bit_identical_in_both_modes(loops):
  """Mixed filters and masks through both loops: the same tokens, logprob
  bits, masks and logZ bits; the default mode's step has the large-set
  route's cond (``rowwise.only_if``)."""
  rs = np.random.default_rng(5)
  requests = [dataclasses.replace(r, return_masks=bool(i % 2))
              for i, r in enumerate(random_requests(rs, 8, max_tokens=6))]
  runs = {free: loops(free).run(requests) for free in (False, True)}
  assert not tuning.conds(loops(True).config.tuning)
  assert tuning.conds(loops(False).config.tuning)
  assert sum(len(c.token_ids) for c in runs[True]) > 0
  for plain, free in zip(runs[False], runs[True]):
    assert_same_bits(free, plain)
  conds = step_control(loops(False))
  assert conds and all(op.kind == "conditional" and "only_if" in op.source
                       for op in conds), conds


def test_busy_ns_is_the_union_of_intervals_within_the_window():
  events = [(0, 10, "a"), (5, 10, "b"), (30, 5, "c"), (32, 1, "d"),
            (40, 100, "e")]
  # [2, 15) + [30, 35) + [40, 50)
  assert timing.busy_ns(events, 2, 50) == 13 + 5 + 10
  assert timing.busy_ns(events, 15, 30) == 0
  assert timing.busy_ns([], 0, 10) == 0


def test_serve_bench_profiles_a_window_of_calls():
  """``serve_demo.serve`` with an ``IdleWindow`` over calls 2 .. 3: the
  window's wall time, and the GPU's busy share of it (None on CPU: no GPU
  events, printed as n/a)."""
  model = tiny_transformer(seed=0, vocab=32, max_len=CACHE, layers=1)
  loop = ServeLoop(model, slots=SLOTS, cache_len=CACHE, config=SERVING_CONFIG)
  requests = random_requests(np.random.default_rng(6), 6, max_tokens=8)
  idle = timing.IdleWindow()
  done, seconds = serve_demo.serve(loop, requests, 1, live=False, idle=idle,
                                   idle_calls=2)
  assert len(done) == len(requests)
  assert 0 < idle.wall_s < seconds
  if jax.default_backend() == "gpu":
    assert 0 <= idle.idle_share <= 1
  else:
    assert idle.busy_s is None and idle.idle_share is None
    # pylint: disable-next=protected-access
    assert "device idle n/a" in serve_demo._idle(idle)


@pytest.mark.kernels
@pytest.mark.slow
def test_speculative_outputs_are_bit_identical_in_both_modes():
  """Speculative decoding (n-gram drafts, masks): the same outputs in both
  modes, and no data-dependent control in the branch-free step."""
  model = tiny_transformer(seed=0, vocab=32, max_len=CACHE, layers=1)
  make = lambda free: ServeLoop(
      model, slots=SLOTS, cache_len=CACHE, config=CONFIG, return_masks=True,
      speculation=Speculation(NgramDrafter(2)), branch_free=free)
  requests = [dataclasses.replace(r, return_masks=bool(i % 2)) for i, r in
              enumerate(random_requests(np.random.default_rng(7), 8))]
  loops = {free: make(free) for free in (False, True)}
  runs = {free: loop.run(requests) for free, loop in loops.items()}
  assert sum(c.drafted for c in runs[True]) > 0
  for plain, free in zip(runs[False], runs[True]):
    assert_same_bits(free, plain)
  assert step_control(loops[True]) == []


def test_branch_free_option_sets_the_config_tuning():
  """None keeps a config's own ``branching`` (else the default); a bool sets
  it and keeps the other tuning; anything else is refused by name."""
  base = SamplerConfig(tuning=tuning.Tuning(stats=tuning.StatsLaunch(
      num_warps=8)))
  free = serving.branch_free_config(base, True)
  assert free.tuning.stats == base.tuning.stats
  assert not tuning.conds(free.tuning)
  assert serving.branch_free_config(free, None) == free
  assert tuning.conds(serving.branch_free_config(free, False).tuning)
  assert tuning.conds(serving.branch_free_config(base, None).tuning) == (
      not serving.DEFAULT_BRANCH_FREE)
  with pytest.raises(ValueError, match="branch_free must be"):
    serving.branch_free_config(base, "yes")
