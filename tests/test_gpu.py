"""GPU-only tests of the Gumbel kernel: per-request keys, batch invariance,
ties, invalid rows, threefry against ``jax.random.categorical``, the GPU
division and peaked rows (the chunk filter's path) at production shapes.  The parity of every
shape x dtype x generator x noise precision is ``test_sample``'s
``test_pallas_matches_xla`` (GPU-marked cases).

Run on the GPU machine with ``python -m pytest -m gpu tests/``.  On other
backends every test here is skipped (``require_gpu`` fixture).

Parity tests use untruncated params (top_k=0, top_p=1, min_p=0): with any
filter on, ``implementation="pallas"`` routes the batch to the XLA reference
(``lax.cond``) and the kernel would not run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import SamplingParams

from helpers.parametrize import GENERATORS
from helpers.sampling import run_sample

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_gpu")]



def make_case(batch, vocab, dtype, seed):
  r = np.random.default_rng(seed)
  x = jnp.asarray(r.standard_normal((batch, vocab)) * 3, jnp.float32)
  x = x.at[0, :7].set(-jnp.inf).astype(dtype)
  temps = r.uniform(0.4, 1.8, batch).astype(np.float32)
  temps[1::3] = 0.0  # greedy rows mixed in (none when batch == 1)
  return x, SamplingParams.make(batch, temperature=temps)


def assert_parity(a, b):
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.valid, b.valid)
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
  assert a.tokens.dtype == np.int32 and a.logprobs.dtype == np.float32


@pytest.mark.parametrize("gen", GENERATORS)
@pytest.mark.parametrize("shape", [(8, 151936), (513, 1007)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_per_request_keys_and_positions(shape, gen):
  batch, vocab = shape
  x, params = make_case(batch, vocab, jnp.bfloat16, seed=7)
  keys = jax.random.split(jax.random.key(7), batch)
  positions = jnp.arange(batch, dtype=jnp.int32) * 13
  a = run_sample(x, params, keys, positions=positions, impl="pallas", rng=gen)
  b = run_sample(x, params, keys, positions=positions, impl="xla", rng=gen)
  assert_parity(a, b)
  # Batch invariance: a request sampled alone draws the same token.
  for r in (0, batch // 2, batch - 1):
    alone = run_sample(x[r:r + 1], jax.tree.map(lambda v: v[r:r + 1], params),
                       keys[r:r + 1], positions=positions[r:r + 1],
                       impl="pallas", rng=gen)
    assert alone.tokens[0] == a.tokens[r]


@pytest.mark.parametrize("gen", GENERATORS)
def test_batch_invariance_under_shuffle_and_padding_on_gpu(gen):
  """fp32, per-request keys and positions: a shuffled batch gives the
  shuffled tokens (and the same logprobs: same plan), a padded batch (another
  launch plan) the same tokens and logprobs within 1e-5."""
  batch, vocab = 64, 151936
  x, params = make_case(batch, vocab, jnp.float32, seed=17)
  keys = jax.random.split(jax.random.key(17), batch)
  positions = jnp.arange(batch, dtype=jnp.int32) * 7 + 3
  a = run_sample(x, params, keys, positions=positions, impl="pallas", rng=gen)
  perm = np.random.default_rng(17).permutation(batch)
  take = lambda tree, rows: jax.tree.map(lambda v: v[rows], tree)
  shuffled = run_sample(x[perm], take(params, perm), keys[perm],
                        positions=positions[perm], impl="pallas", rng=gen)
  np.testing.assert_array_equal(shuffled.tokens, a.tokens[perm])
  np.testing.assert_array_equal(shuffled.logprobs, a.logprobs[perm])
  pad = 100 - batch
  padded_params = SamplingParams.make(100, temperature=np.concatenate(
      [np.asarray(params.temperature), np.full(pad, 0.9, np.float32)]))
  padded = run_sample(
      jnp.concatenate([x, jnp.ones((pad, vocab), x.dtype)]), padded_params,
      jnp.concatenate([keys, jax.random.split(jax.random.key(5), pad)]),
      positions=jnp.concatenate([positions, jnp.zeros(pad, jnp.int32)]),
      impl="pallas", rng=gen)
  np.testing.assert_array_equal(padded.tokens[:batch], a.tokens)
  np.testing.assert_allclose(padded.logprobs[:batch], a.logprobs, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("gen", GENERATORS)
def test_tied_rows_on_gpu(gen, dtype):
  """Rows of a few distinct values (ties everywhere, the max tied across
  many ids) and flat rows, sampled and greedy: the reference's tokens bit for
  bit; greedy rows take the smallest id of the tied max."""
  batch, vocab = 8, 151936
  r = np.random.default_rng(23)
  x = np.round(r.standard_normal((batch, vocab)) * 2) / 2  # ~20 values
  x[2:4] = 0.75  # flat rows
  x[4, 1000::3] = x[4].max() + 20  # a max tied across ~50000 ids
  x[5] = x[4]
  x = jnp.asarray(x, jnp.float32).astype(dtype)
  params = SamplingParams.make(batch, temperature=[1.0, 0.0, 1.3, 0.0, 0.7,
                                                   0.0, 1.0, 0.0])
  key = jax.random.key(23)
  a = run_sample(x, params, key, impl="pallas", rng=gen)
  b = run_sample(x, params, key, impl="xla", rng=gen)
  assert_parity(a, b)
  np.testing.assert_array_equal(a.tokens[[1, 3, 5]], [
      int(np.argmax(np.asarray(x[1], np.float32))), 0, 1000])
  assert a.tokens[4] >= 1000 and (a.tokens[4] - 1000) % 3 == 0


@pytest.mark.parametrize("gen", GENERATORS)
def test_invalid_rows_on_gpu(gen):
  batch, vocab = 4, 32000
  x = np.asarray(jax.random.normal(jax.random.key(3), (batch, vocab)))
  x = np.array(x)
  x[0, 5] = np.nan
  x[1, :] = -np.inf
  x[2, 9] = np.inf
  x[2, 20] = np.nan
  params = SamplingParams.make(batch, temperature=[1.0, 1.0, 0.0, 1.0])
  key = jax.random.key(3)
  a = run_sample(jnp.asarray(x), params, key, impl="pallas", rng=gen)
  b = run_sample(jnp.asarray(x), params, key, impl="xla", rng=gen)
  assert_parity(a, b)
  np.testing.assert_array_equal(a.valid, [False, False, False, True])
  np.testing.assert_array_equal(a.tokens[:3], [5, 0, 9])
  assert np.all(a.logprobs[:3] == -np.inf)


def test_threefry_kernel_matches_jax_random_categorical():
  batch, vocab = 8, 151936
  x = jax.random.normal(jax.random.key(1), (batch, vocab))
  temps = jnp.linspace(0.5, 1.5, batch, dtype=jnp.float32)
  key = jax.random.key(2)
  a = run_sample(x, SamplingParams.make(batch, temperature=np.asarray(temps)),
                 key, impl="pallas", rng="threefry")
  want = np.asarray(jax.random.categorical(key, x / temps[:, None]))
  np.testing.assert_array_equal(a.tokens, want)


def test_kernel_division_equals_the_reference_tempering_on_gpu():
  """The kernels' ``x / T`` (``common.gpu_div``) is XLA's quotient bit for bit
  on GPU (XLA's fp32 division is not the IEEE quotient there: both issue
  ``div.full.f32``)."""
  from jax.experimental import pallas as pl
  from jaxsample._src import reference
  from jaxsample._src.pallas import common
  r = np.random.default_rng(12)
  x = jnp.asarray((r.standard_normal((6, 4096)) * 10).astype(np.float32))
  temps = jnp.float32([0.7, 0.3, 1.9, 3.3, 0.9, 1e-3])

  def kernel(t_ref, x_ref, o_ref):
    row = pl.program_id(0)
    o_ref[row, :] = common.gpu_div(x_ref[row, :], t_ref[row])

  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape,
                                                              jnp.float32),
                       grid=(6,))(temps, x)
  want = jax.jit(reference.temper)(x, temps)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def llm_like_case(batch, vocab, dtype, seed, heads=8):
  """Bulk 2 * N(0, 1) plus a few head tokens 15-25 (most tiles skipped), with
  greedy rows, a -inf block and a first-tile head mixed in."""
  r = np.random.default_rng(seed)
  x = (r.standard_normal((batch, vocab)) * 2).astype(np.float32)
  for b in range(batch):
    x[b, r.choice(vocab, heads, replace=False)] = r.uniform(15, 25, heads)
  x[0, 3] = 40.0
  x[-1, :vocab // 3] = -np.inf
  temps = r.uniform(0.5, 1.2, batch).astype(np.float32)
  temps[1::5] = 0.0
  return jnp.asarray(x).astype(dtype), SamplingParams.make(batch, temperature=temps)


def run_kernel(x, params, key, gen, *, fp64=False, runs=1):
  """``sample`` through the kernel: ``runs`` results of repeated calls."""
  from jaxsample import SamplerConfig, sample
  config = SamplerConfig(implementation="pallas", rng=gen, use_fp64_gumbel=fp64)
  fn = jax.jit(lambda x: sample(x, params, key, config=config))
  with jax.enable_x64(fp64):
    return [jax.tree.map(np.asarray, fn(x)) for _ in range(runs)]


@pytest.mark.parametrize("fp64", [False, True], ids=["fp32noise", "fp64noise"])
@pytest.mark.parametrize("gen", GENERATORS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("batch", [8, 128])
def test_peaked_rows_match_reference(batch, dtype, gen, fp64):
  """Peaked rows (the chunk filter skips most chunks' exact race) draw the
  reference's tokens; repeated runs agree."""
  vocab = 151936
  x, params = llm_like_case(batch, vocab, dtype, seed=batch + 5)
  key = jax.random.key(batch)
  a, *again = run_kernel(x, params, key, gen, fp64=fp64, runs=4)
  b = run_sample(x, params, key, impl="xla", rng=gen, fp64=fp64)
  assert_parity(a, b)
  assert a.valid.all() and a.tokens[0] == 3
  for c in again:
    np.testing.assert_array_equal(c.tokens, a.tokens)
    np.testing.assert_allclose(c.logprobs, a.logprobs, rtol=1e-6, atol=1e-6)
