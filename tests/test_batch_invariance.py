"""The sampler's batch invariance (README, docs/generation.md Reproducibility):
with per-request keys, a logits row gives the same token, validity and
logprob at any batch index, batch size and padding.

Bit for bit on the XLA paths (their normalizers are fixed-point digit sums,
``reference.exact_sum``).  On the kernels the tokens are bit for bit at any
launch plan, and the logprobs are bit for bit between two batch sizes whose
launch plans (``kernel_plans``: the split count per row and the race's
warps, which ``pallas.common.make_plan`` and ``race_plan`` choose from the
batch size and V) are equal; between plans they differ by the fp32 rounding
of another grouping of the normalizer's sum, within ``PLAN_ATOL``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src.parallel.batch import shard_config
from jaxsample._src.pallas import common
from jaxsample._src import tuning
from jaxsample._src.pallas.threshold.base import pass_plan

from helpers.cases import SAMPLE_SHAPE, logits, random_logits
from helpers.parametrize import slow_case
from helpers.sampling import run_sample

B, V = SAMPLE_SHAPE
IMPLEMENTATIONS = (  # (implementation, generator)
    pytest.param("xla", "philox", id="xla-philox"),
    pytest.param("xla", "threefry", id="xla-threefry"),
    pytest.param("xla_search", "philox", id="xla_search-philox"),
    pytest.param("pallas", "philox", id="pallas-philox"),
    slow_case("pallas", "threefry", id="pallas-threefry"))
PLAN_ATOL = 1e-5  # logprobs between launch plans, logits of scale 2, V = 4096
# Plain, greedy, top-k, top-p and min-p rows (params traced: one program).
PARAMS = SamplingParams.make(B, temperature=[1.0, 0.0, 1.2, 0.8, 1.0],
                             top_k=[0, 0, 20, 0, 0], top_p=[1.0, 1.0, 1.0, 0.9, 1.0],
                             min_p=[0.0, 0.0, 0.0, 0.0, 0.05])
KEYS = jax.random.split(jax.random.key(15), B)
POSITIONS = jnp.asarray([0, 3, 3, 1000, 2**20], jnp.int32)
# ``batch_invariant``'s batches: with ``TINY``'s 64-element loads at V = 4096
# the default plans of these sizes all differ (many splits per row, as a
# large V has with the default loads).
BATCHES = (1, 9, 40, 130)
TINY = tuning.Tuning(stats=tuning.StatsLaunch(block_size=64, chunks_per_step=1),
                     compact=tuning.CompactLaunch(block_size=64),
                     spec_stats=tuning.SpecStatsLaunch(block_size=64))


def kernel_plans(batch: int, vocab: int, config: SamplerConfig):
  """The launch plans that depend on the batch size: the Gumbel race's and
  the truncation passes' (stats, candidate compaction)."""
  tuned = tuning.resolve(config.tuning)
  return (common.race_plan(batch, vocab, tuned.gumbel, tuned.occupancy,
                           generator=config.rng, fp64=config.use_fp64_gumbel),
          pass_plan(batch, vocab, tuned.stats, tuned.occupancy),
          pass_plan(batch, vocab, tuned.compact, tuned.occupancy))


def sample(impl, x, params, keys, positions, gen="philox", **config):
  return run_sample(x, params, keys, positions=positions, impl=impl, rng=gen,
                    traced_params=True, **config)


def assert_rows_equal(impl, gen, got, want, rows_got, rows_want, batch_got,
                      batch_want):
  """Tokens and validity bit for bit; logprobs bit for bit on the XLA paths
  and on the kernels at equal plans, else within ``PLAN_ATOL``."""
  np.testing.assert_array_equal(got.tokens[rows_got], want.tokens[rows_want])
  np.testing.assert_array_equal(got.valid[rows_got], want.valid[rows_want])
  config = SamplerConfig(rng=gen)
  if impl == "pallas" and (kernel_plans(batch_got, V, config) !=
                           kernel_plans(batch_want, V, config)):
    np.testing.assert_allclose(got.logprobs[rows_got],
                               want.logprobs[rows_want], rtol=0,
                               atol=PLAN_ATOL)
  else:
    np.testing.assert_array_equal(got.logprobs[rows_got],
                                  want.logprobs[rows_want])


@pytest.mark.kernels
@pytest.mark.parametrize("impl,gen", IMPLEMENTATIONS)
def test_rows_are_independent_of_slot_batch_size_and_padding(impl, gen):
  x = random_logits(15, B, V)
  batch = sample(impl, x, PARAMS, KEYS, POSITIONS, gen)
  assert batch.valid.all()
  rows = np.arange(B)
  for b in range(B):  # alone (B = 1)
    alone = sample(impl, x[b:b + 1], PARAMS[b:b + 1], KEYS[b:b + 1],
                   POSITIONS[b:b + 1], gen)
    assert_rows_equal(impl, gen, alone, batch, [0], [b], 1, B)
  perm = np.array([3, 1, 4, 0, 2])  # shuffled
  shuffled = sample(impl, x[perm], PARAMS[perm], KEYS[perm], POSITIONS[perm],
                    gen)
  assert_rows_equal(impl, gen, shuffled, batch, rows, perm, B, B)
  # Padded to 8: junk rows with their own keys around the requests, and
  # request 2's row a second time in the last slot.
  junk = random_logits(16, 2, V)
  xp = jnp.concatenate([junk[:1], x, junk[1:], x[2:3]])
  where = np.array([1, 2, 3, 4, 5, 7])  # the requests' slots in xp
  keep = np.array([0, 1, 2, 3, 4, 2])
  pad = lambda a, fill: jnp.concatenate([fill[:1], a, fill[1:], a[2:3]])
  padded = sample(impl, xp,
                  SamplingParams.concatenate([PARAMS[:1], PARAMS, PARAMS[3:4],
                                              PARAMS[2:3]]),
                  pad(KEYS, jax.random.split(jax.random.key(99), 2)),
                  pad(POSITIONS, jnp.asarray([7, 5], jnp.int32)), gen)
  assert_rows_equal(impl, gen, padded, batch, where, keep, 8, B)
  # Positions matter: the next position gives other tokens somewhere.
  moved = sample(impl, x, PARAMS, KEYS, POSITIONS + 1, gen)
  sampled = np.asarray(PARAMS.temperature) > 0
  assert not np.array_equal(moved.tokens[sampled], batch.tokens[sampled])


def test_kernel_plans_depend_on_the_batch_size():
  """What docs/generation.md says of the kernels' plans (the heuristic):
  chosen from the rows and V (at V = 151936 the race takes 38 splits per
  row for 8 rows and 25 for 16; at V = 2048 one plan below 32 rows; 1-warp
  races from 32 rows)."""
  config = SamplerConfig()
  few, many = (kernel_plans(rows, 151936, config) for rows in (8, 16))
  assert (few[0].num_splits, many[0].num_splits) == (38, 25)
  assert all(kernel_plans(rows, 2048, config) == kernel_plans(1, 2048, config)
             for rows in range(1, 32))
  assert kernel_plans(1, 4096, config) == kernel_plans(8, 4096, config)
  assert (kernel_plans(31, 151936, config)[0].num_warps !=
          kernel_plans(32, 151936, config)[0].num_warps)


@pytest.mark.kernels
def test_kernel_logprobs_between_launch_plans():
  """One batch on the kernels at the heuristic's plan and at one split per
  row: the same tokens, logprobs within ``PLAN_ATOL``."""
  one_split = tuning.Tuning(gumbel=tuning.RaceLaunch(num_splits=1),
                            stats=tuning.StatsLaunch(num_splits=1),
                            compact=tuning.CompactLaunch(num_splits=1))
  config = SamplerConfig(tuning=one_split)
  assert kernel_plans(B, V, config) != kernel_plans(B, V, SamplerConfig())
  x = random_logits(15, B, V)
  default = sample("pallas", x, PARAMS, KEYS, POSITIONS)
  split = sample("pallas", x, PARAMS, KEYS, POSITIONS, tuning=one_split)
  np.testing.assert_array_equal(split.tokens, default.tokens)
  np.testing.assert_array_equal(split.valid, default.valid)
  np.testing.assert_allclose(split.logprobs, default.logprobs, rtol=0,
                             atol=PLAN_ATOL)


# The requests: plain, greedy, top-k, top-p, min-p, top-k + top-p, and a flat
# top-p row whose kept set overflows the candidate buffer (the large-set route).
REQUESTS = SamplingParams.make(
    7, temperature=[1.0, 0.0, 1.2, 0.8, 1.0, 0.7, 3.0],
    top_k=[0, 0, 20, 0, 0, 50, 0], top_p=[1.0, 1.0, 1.0, 0.9, 1.0, 0.9, 0.99],
    min_p=[0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0])
R = REQUESTS.batch_size


def _requests(vocab):
  x = np.array(random_logits(21, R, vocab))
  x[-1] *= 0.05  # flat: thousands of ids in its top-p set
  return (jnp.asarray(x), jax.random.split(jax.random.key(21), R),
          jnp.asarray([0, 5, 9, 17, 2**20, 33, 1], jnp.int32))


def _layout(batch: int):
  """``(slots, fill)``: the requests' slots in a batch of ``batch`` rows
  (each request alone at B = 1, ``slots`` then lists one slot per call) and
  how many junk rows fill the rest."""
  if batch == 1:
    return np.zeros(R, int), 0
  slots = np.random.default_rng(batch).choice(batch, R, replace=False)
  return slots, batch - R


def _batched(batch, x, keys, positions, draft=None):
  """The requests' arrays laid out for ``batch`` rows: ``[(rows, arrays)]``
  (one call per request at B = 1).  Junk rows: random logits (one repeats
  request 0's row under its own key), all-zero padding rows, mixed params."""
  slots, fill = _layout(batch)
  if batch == 1:
    return [([0], jax.tree.map(lambda a: a[r:r + 1], (x, REQUESTS, keys,
                                                      positions, draft)))
            for r in range(R)]
  r = np.random.default_rng(batch + 1)
  junk_x = logits(batch, fill, *x.shape[1:], scale=2.0)
  junk_x[0] = np.asarray(x[0])
  junk_x[1::3] = 0.0
  junk_params = SamplingParams.make(
      fill, temperature=r.uniform(0.0, 1.5, fill).astype(np.float32),
      top_k=r.choice([0, 5, 100], fill), top_p=r.choice([1.0, 0.5, 0.95], fill),
      min_p=r.choice([0.0, 0.1], fill))
  junk = (jnp.asarray(junk_x), junk_params,
          jax.random.split(jax.random.key(batch), fill),
          jnp.asarray(r.integers(0, 100, fill), jnp.int32),
          None if draft is None else jnp.asarray(
              logits(batch + 2, fill, *draft.shape[1:], scale=2.0)))
  order = np.empty(batch, int)  # row b of the batch: index into requests + junk
  order[slots] = np.arange(R)
  order[np.setdiff1d(np.arange(batch), slots)] = R + np.arange(fill)
  whole = jax.tree.map(lambda a, b: jnp.concatenate([a, b])[order],
                       (x, REQUESTS, keys, positions, draft), junk)
  return [(slots, whole)]


@functools.partial(jax.jit, static_argnames=("config", "call"))
def _call(x, params, keys, positions, config, call):
  """``sample`` (``call`` "sample"), with its mask ("sample+mask"), or
  ``extract_sampling_mask`` ("extract")."""
  if call == "extract":
    return jaxsample.extract_sampling_mask(x, params, config=config)
  return jaxsample.sample(x, params, keys, positions=positions, config=config,
                          return_mask=call == "sample+mask")


def _per_request(batches, run):
  """``{B: outputs of the requests in request order}``."""
  results = {}
  for batch in batches:
    outs = [jax.tree.map(lambda a: np.asarray(a)[np.asarray(rows)], run(*args))
            for rows, args in _batched(batch, *batches[batch])]
    results[batch] = jax.tree.map(lambda *a: np.concatenate(a), *outs)
  return results


def _assert_all_equal(results):
  """Every batch size's outputs bit for bit those of the first."""
  first, *rest = results
  paths, want = zip(*jax.tree_util.tree_flatten_with_path(results[first])[0])
  for batch in rest:
    got = jax.tree.leaves(results[batch])
    for path, a, b in zip(paths, got, want):
      np.testing.assert_array_equal(
          a, b, err_msg=f"B = {batch}: {jax.tree_util.keystr(path)}")


@pytest.mark.kernels
@pytest.mark.parametrize("call,gen,fp64,batches", [
    ("sample+mask", "philox", False, BATCHES[:2]),
    slow_case("sample+mask", "philox", False, BATCHES),
    slow_case("sample", "philox", False, BATCHES),
    slow_case("extract", "philox", False, BATCHES),
    slow_case("sample+mask", "threefry", False, BATCHES),
    slow_case("sample+mask", "philox", True, BATCHES)])
def test_batch_invariant_kernel_rows_are_bit_identical(call, gen, fp64,
                                                       batches):
  """``SamplerConfig(batch_invariant=True)``: ``sample`` (plain and with its
  mask) and ``extract_sampling_mask``: every request's token, validity,
  logprob and mask (kept ids, count, ``logz``, ``lse``, flags) at B = 1 and
  9 (and 40 and 130: slow cases), whose default plans differ, among junk and
  padding rows, bit for bit."""
  config = SamplerConfig(implementation="pallas", rng=gen,
                         use_fp64_gumbel=fp64, tuning=TINY,
                         batch_invariant=True)
  args = _requests(V)
  with jax.enable_x64(fp64):
    results = _per_request({b: args for b in batches},
                           lambda x, p, k, pos, _: _call(x, p, k, pos, config,
                                                         call))
  out = results[1]
  result, mask = {"sample": (out, None), "sample+mask": out,
                  "extract": (None, out)}[call]
  assert result is None or result.valid.all()
  # not vacuous: kept sets, the flat row's overflowing one
  assert mask is None or (mask.truncated[2:].all() and mask.overflow[-1])
  _assert_all_equal(results)


def _drafts(positions, vocab: int):
  """``(drafts, num_draft)``: k = 2 drafts per request, ``(p + 1) * [1,
  2] % V`` at position ``p``, one of them on odd positions."""
  positions = jnp.asarray(positions)
  drafts = (positions[:, None] + 1) * jnp.asarray([1, 2]) % vocab
  return drafts.astype(jnp.int32), 2 - positions % 2


@functools.partial(jax.jit, static_argnames=("config",))
def _verify(target, params, keys, positions, draft_logits, config):
  """``rejection_sample`` of ``_drafts``, with its masks (batch first:
  ``[B, k + 1, ...]``)."""
  drafts, num_draft = _drafts(positions, target.shape[-1])
  result, masks = jaxsample.rejection_sample(
      target, drafts, num_draft, params, keys, draft_logits=draft_logits,
      positions=positions, config=config, return_mask=True)
  return result, jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), masks)


@pytest.mark.kernels
@pytest.mark.parametrize("with_draft", [slow_case(True), slow_case(False)])
def test_batch_invariant_verification_is_bit_identical(with_draft):
  """``SamplerConfig(batch_invariant=True)``: ``rejection_sample`` (k = 2, draft logits or one-hot drafts):
  every request's tokens, acceptance, logprobs and masks at B = 1, 9, 40 and
  130, among junk and padding rows, bit for bit."""
  config = SamplerConfig(implementation="pallas", tuning=TINY,
                         batch_invariant=True)
  vocab = 2048
  x, keys, positions = _requests(3 * vocab)
  drafts, _ = _drafts(positions, vocab)
  # Likely drafts (the target's logit + 6 there): accepts and rejects.
  target = x.reshape(R, 3, vocab).at[
      np.arange(R)[:, None], np.arange(2), drafts].add(6.0)
  draft = (jnp.asarray(logits(22, R, 2, vocab, scale=2.0)) if with_draft
           else None)
  results = _per_request(
      {b: (target, keys, positions, draft) for b in BATCHES},
      lambda t, p, k, pos, d: _verify(t, p, k, pos, d, config))
  out, _ = results[1]
  assert 0 < out.num_accepted.sum() < 2 * R  # accepts and rejects
  _assert_all_equal(results)


def test_batch_invariant_batches_had_different_plans():
  """The batches above are not vacuous: without ``batch_invariant`` their
  kernel plans differ (``TINY``'s 64-element loads at V = 4096), with it
  they are the one-row plan."""
  plain = SamplerConfig(implementation="pallas", tuning=TINY)
  invariant = SamplerConfig(implementation="pallas", tuning=TINY,
                            batch_invariant=True)
  shard = lambda config: shard_config(config, 1)
  assert len({kernel_plans(b, V, shard(plain)) for b in BATCHES}) == len(BATCHES)
  assert {kernel_plans(b, V, shard(invariant)) for b in BATCHES} == {
      kernel_plans(1, V, shard(plain))}
