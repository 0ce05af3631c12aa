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

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src.pallas import common
from jaxsample._src import tuning
from jaxsample._src.pallas.threshold.base import pass_plan

from helpers.cases import SAMPLE_SHAPE, random_logits
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
