"""Public API ``jaxsample.sample`` on both backends (``implementation="xla"`` and
``"pallas"``; on CPU the Pallas kernel runs in interpret mode): kernel vs
reference parity, row kinds, invalid rows, jax.random compatibility, batch
invariance, sampled frequencies, truncation through the API and bad inputs.

The Gumbel kernel's parity tests here use untruncated params (top_k=0,
top_p=1, min_p=0); its launch plans, peaked rows and race ties are
``test_race_kernel.py``'s, the FP64 noise path ``test_fp64_gumbel.py``'s;
truncated batches are tested here through the public API and kernel by
kernel in ``test_threshold.py`` and ``test_truncated_sampling.py``.

Most tests reuse the shape (5, 4096) so that jit compilations are shared.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams

from helpers.cases import (SAMPLE_SHAPE, assert_result_types, assert_same_result,
                           random_logits, random_temps)
from helpers.oracle import oracle_keep
from helpers.parametrize import (GENERATORS, GENERATORS_SLOW_THREEFRY,
                                 IMPLEMENTATIONS, IMPLEMENTATIONS_BY_GENERATOR,
                                 on_gpu, slow_case)
from helpers.programs import outside_conds
from helpers.sampling import make_params, run_sample
from helpers.stats import assert_chi2_fits

B, V = SAMPLE_SHAPE  # the shared workhorse shape


def parity(x, params, key, gen, positions=None, **kw):
  """Runs both backends, checks parity, returns the pallas result."""
  a = run_sample(x, params, key, positions=positions, impl="pallas", rng=gen, **kw)
  b = run_sample(x, params, key, positions=positions, impl="xla", rng=gen, **kw)
  assert_result_types(a, *x.shape)
  assert_same_result(a, b)
  return a


# ---------------------------------------------------------------------------
# Kernel vs reference parity (untruncated params: the kernel runs).
# ---------------------------------------------------------------------------


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}


def parity_cases():
  """``(shape, dtype, generator, fp64)``: fp32 at five shapes in interpret
  mode (every backend; threefry's beyond V = 4096 ``slow``); on a GPU
  every production shape x dtype x generator x noise precision."""
  def name(shape, dtype, gen, fp64):
    return f"{shape[0]}x{shape[1]}-{dtype}-{gen}-{'fp64' if fp64 else 'fp32'}"
  cases = [(pytest.param if gen == "philox" or shape[1] <= V else slow_case)(
               shape, "float32", gen, False,
               id=name(shape, "float32", gen, False))
           for shape in [(1, 1007), (B, V), (3, 32000), (2, 151936),
                         (513, 1007)] for gen in GENERATORS]
  cases += [on_gpu(shape, dtype, gen, fp64, id=name(shape, dtype, gen, fp64))
            for shape in [(1, 151936), (8, 151936), (128, 151936), (4, 32000),
                          (2, 1007)]
            for dtype in DTYPES for gen in GENERATORS for fp64 in (False, True)]
  cases += [on_gpu((513, 1007), dtype, gen, fp64,
                   id=name((513, 1007), dtype, gen, fp64))
            for dtype in DTYPES for gen in GENERATORS for fp64 in (False, True)
            if (dtype, fp64) != ("float32", False)]
  return cases


@pytest.mark.kernels
@pytest.mark.parametrize("shape,dtype,gen,fp64", parity_cases())
def test_pallas_matches_xla(shape, dtype, gen, fp64):
  """Untruncated rows (the Gumbel kernel), every third one greedy and a -inf
  prefix in row 0: tokens and validity equal the reference's bit for bit,
  logprobs within 1e-5; greedy rows take the argmax with logprob 0, and the
  noise matters (not every sampled row takes its argmax)."""
  batch, vocab = shape
  seed = batch * 7 + vocab
  x = random_logits(seed, batch, vocab, scale=3.0)
  x = x.at[0, :7].set(-jnp.inf).astype(DTYPES[dtype])
  temps = random_temps(seed, batch)
  temps[1::3] = 0.0
  params = SamplingParams.make(batch, temperature=temps)
  out = parity(x, params, jax.random.key(seed), gen, fp64=fp64)
  assert out.valid.all()
  greedy = temps == 0
  xf = np.asarray(x.astype(jnp.float32))
  np.testing.assert_array_equal(out.tokens[greedy], np.argmax(xf[greedy], -1))
  np.testing.assert_array_equal(out.logprobs[greedy], 0.0)
  if (~greedy).sum() > 1:
    assert not np.array_equal(out.tokens[~greedy], np.argmax(xf[~greedy], -1))


def test_static_and_traced_params_agree():
  """The kernel path with params the jit closes over (``rowwise.cond`` takes
  the Gumbel branch alone; most kernel tests here run that way,
  ``helpers.sampling.closing_over``) equals the path with traced params (a
  ``lax.cond`` on the device), and a truncating batch with traced params
  still takes its branch."""
  x = random_logits(41, B, V)
  params = SamplingParams.make(B, temperature=random_temps(41, B))
  key = jax.random.key(41)
  closed = run_sample(x, params, key, impl="pallas")
  assert_same_result(closed, run_sample(x, params, key, impl="pallas",
                                        traced_params=True))
  truncating = SamplingParams.make(B, temperature=1.0, top_k=[0, 3, 0, 0, 0])
  assert_same_result(
      run_sample(x, truncating, key, impl="pallas", traced_params=True),
      run_sample(x, truncating, key, impl="xla"))


@pytest.mark.parametrize("return_mask,fp64", [(False, False), (True, False),
                                              (False, True)])
def test_traced_params_send_one_predicate_to_the_host(return_mask, fp64):
  """With traced params the kernel path sends one cond's predicate to the
  host per call (a round trip on a GPU), with or without a mask or FP64
  noise: fp32 noise runs every route's kernels outside any cond (rows skip
  the routes they do not take) except the large-set route, whose branch
  holds no cond of its own but the mask listing's fallback."""
  x = random_logits(43, B, V)
  params = SamplingParams.make(B, temperature=1.0, top_k=[0, 3, 0, 0, 0])
  config = SamplerConfig(implementation="pallas", use_fp64_gumbel=fp64)
  with jax.enable_x64(fp64):
    jaxpr = jax.make_jaxpr(lambda x, params: jaxsample.sample(
        x, params, jax.random.key(0), config=config,
        return_mask=return_mask))(x, params)
  found = outside_conds(jaxpr.jaxpr)
  assert found["cond"] == 1
  assert found["nested"] == int(return_mask)
  if fp64:  # the batch cond: the kept sets, or the Gumbel kernel alone
    return
  for kernel in ("jaxsample_row_stats", "jaxsample_collect_candidates",
                 "jaxsample_select_threshold", "jaxsample_gumbel_max"):
    assert found.get(kernel), kernel


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
@pytest.mark.parametrize("offset,scale,temperature", [
    (0.0, 1.0, 0.05), (1000.0, 2.0, 1.0), (-3000.0, 2.0, 1.0),
    (4100.0, 1.0, 1.0), (-5000.0, 3.0, 1.0), (20.0, 3.0, 0.01), (0.0, 0.01, 1.0)])
def test_pallas_matches_xla_extreme_magnitudes(gen, offset, scale, temperature):
  """Large / small tempered logits and near-ties between leaders."""
  r = np.random.default_rng(int(abs(offset)) + 3)
  x = (r.standard_normal((B, V)) * scale + offset).astype(np.float32)
  for b in range(B):  # a few near-tied leaders spread over the row
    lead = r.choice(V, size=4, replace=False)
    x[b, lead] = x[b].max() + np.float32([0.0, 0.001, 0.002, 0.5]) * scale
  params = SamplingParams.make(B, temperature=temperature)
  key = jax.random.key(int(offset) + 7)
  a = run_sample(jnp.asarray(x), params, key, impl="pallas", rng=gen)
  b = run_sample(jnp.asarray(x), params, key, impl="xla", rng=gen)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.valid, b.valid)
  # logprob = y_token - logsumexp(y) cancels at large |y|: allow a few ulps of
  # the tempered logits on top of 1e-5.
  y_abs = float(np.max(np.abs(x))) / temperature
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0,
                             atol=1e-5 + 8 * float(np.spacing(np.float32(y_abs))))


# ---------------------------------------------------------------------------
# Row kinds.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_mixed_greedy_and_sampled_rows(gen):
  x = np.array(random_logits(5, B, V, scale=1.0))
  x[0, [100, 7, 4000]] = 9.0  # ties at the max of a greedy row
  x[2, :] = 0.5  # all-equal greedy row: token 0
  x[4, :10] = -np.inf
  temps = np.float32([0.0, 1.0, 0.0, 0.7, 0.0])
  params = SamplingParams.make(B, temperature=temps)
  out = parity(jnp.asarray(x), params, jax.random.key(5), gen)
  np.testing.assert_array_equal(out.tokens[[0, 2, 4]],
                                [7, 0, int(np.argmax(x[4]))])
  np.testing.assert_array_equal(out.logprobs[[0, 2, 4]], 0.0)
  assert np.all(out.logprobs[[1, 3]] < 0)
  assert out.valid.all()


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_rows_with_neg_inf_entries(gen):
  r = np.random.default_rng(6)
  x = r.standard_normal((B, V)).astype(np.float32)
  x[0, r.random(V) < 0.3] = -np.inf
  x[1, r.random(V) < 0.99] = -np.inf
  x[2, :] = -np.inf
  x[2, 1234] = -50.0  # a single finite entry
  x[3, :-1] = -np.inf  # only the last id is finite
  x[4, ::2] = -np.inf
  params = SamplingParams.make(B, temperature=[1.0, 2.0, 0.5, 1.0, 0.9])
  out = parity(jnp.asarray(x), params, jax.random.key(6), gen)
  assert out.valid.all()
  assert np.all(np.isfinite(x[np.arange(B), out.tokens]))
  assert out.tokens[2] == 1234 and out.tokens[3] == V - 1
  np.testing.assert_allclose(out.logprobs[[2, 3]], 0.0, atol=1e-6)


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
def test_all_equal_rows(gen):
  values = np.float32([0.0, -3.5, 100.0, -60.0, 7.0])
  x = jnp.asarray(np.repeat(values[:, None], V, axis=1))
  params = SamplingParams.make(B, temperature=[1.0, 0.3, 2.0, 1.0, 1.0])
  out = parity(x, params, jax.random.key(8), gen)
  # Uniform over V tokens: logprob -log(V).
  np.testing.assert_allclose(out.logprobs, -math.log(V), rtol=0, atol=1e-5)
  assert len(set(out.tokens.tolist())) > 1  # ties are broken by the noise


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_logprob_precision_at_low_temperature(impl):
  """logprob = y_token - logsumexp_K(y) must not lose precision to fp32
  cancellation when the tempered logits are large (low temperature or large
  logits): here T = 1e-3 on logits ~ 20, and an all-equal row of -1e30 whose
  exact logprob is -log(V)."""
  r = np.random.default_rng(25)
  x = (r.standard_normal((B, V)) * 3 + 20).astype(np.float32)
  for b in range(3):  # near-ties at the top so the noise picks either token
    top = np.argsort(-x[b])[:2]
    x[b, top[1]] = x[b, top[0]] - 0.0005 * (b + 1)
  x[3, :] = -1e30
  temps = np.float32([1e-3, 1e-3, 1e-3, 1.0, 1e-3])
  out = run_sample(jnp.asarray(x), SamplingParams.make(B, temperature=temps),
                   jax.random.key(25), impl=impl)
  # The sampler's own fp32 tempered logits (XLA's division: on CPU it is not
  # always the correctly rounded quotient), so only the logprob arithmetic is
  # under test; the expectation is then exact float64 arithmetic on them.
  y_all = np.asarray(jnp.asarray(x) / jnp.asarray(temps)[:, None], np.float64)
  for b in range(B):
    y = y_all[b]
    # Shifted form: y - y.max() is exact in float64, so want carries no
    # cancellation either (for the -1e30 row it is exactly -log(V)).
    want = (y[out.tokens[b]] - y.max()) - np.log(np.sum(np.exp(y - y.max())))
    # The kernel sums exp(x * (1/T) - bound): each term's exponent is within
    # ~1 ulp of fl(x / T), so its documented bound adds a few ulp of max|y|.
    slack = 4 * np.spacing(np.float32(np.abs(y).max())) if impl == "pallas" else 0
    assert abs(out.logprobs[b] - want) <= 1e-5 * max(1.0, abs(want)) + slack, (
        b, out.logprobs[b], want)


@pytest.mark.parametrize("impl,gen", IMPLEMENTATIONS_BY_GENERATOR)
def test_tempered_overflow_rows_are_invalid(impl, gen):
  """Validity is a property of the tempered logits (finite max of x / T): a
  row whose x / T overflows fp32 is invalid, its token is the first entry of
  max(y) and its logprob -inf (never NaN); other rows are unaffected."""
  x = np.array(random_logits(26, B, V, scale=1.0))
  x[0, 5] = 1e35  # with T = 1e-4 (sampled: T >= MIN_TEMPERATURE): y = +inf
  x[0, 9] = 2e35  # also +inf: the first +inf entry (5) is the token
  x[1, :] = -3e38  # with T = 0.5: every y overflows to -inf
  params = SamplingParams.make(B, temperature=[1e-4, 0.5, 1.0, 1.0, 1.0])
  out = run_sample(jnp.asarray(x), params, jax.random.key(26), impl=impl, rng=gen)
  assert_result_types(out, B, V)
  np.testing.assert_array_equal(out.valid, [False, False, True, True, True])
  np.testing.assert_array_equal(out.tokens[:2], [5, 0])
  np.testing.assert_array_equal(out.logprobs[:2], -np.inf)
  assert not np.any(np.isnan(out.logprobs)), out.logprobs
  assert np.all(out.logprobs[2:] <= 0), out.logprobs


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_input_dtypes(gen, dtype):
  x = random_logits(10, B, V, scale=3.0, dtype=dtype)
  x = x.at[1, :100].set(-jnp.inf)
  params = SamplingParams.make(B, temperature=[1.0, 0.0, 0.6, 1.5, 1.0])
  key = jax.random.key(10)
  out = parity(x, params, key, gen)
  assert out.valid.all()
  # Logits are read in their own dtype and computed in fp32: same result as
  # the exact fp32 upcast.
  for impl in IMPLEMENTATIONS:
    up = run_sample(x.astype(jnp.float32), params, key, impl=impl, rng=gen)
    np.testing.assert_array_equal(up.tokens, out.tokens)
    np.testing.assert_allclose(up.logprobs, out.logprobs, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Invalid rows through the kernel (untruncated params).
# ---------------------------------------------------------------------------


def _invalid_batches():
  r = np.random.default_rng(11)
  def base():
    return r.standard_normal(V).astype(np.float32)
  rows1, want1 = [], []
  x = base(); x[7] = np.nan; rows1.append(x); want1.append(7)
  x = base(); x[9] = np.nan; x[3] = np.inf; rows1.append(x); want1.append(3)
  x = np.full(V, -np.inf, np.float32); rows1.append(x); want1.append(0)
  x = np.full(V, -np.inf, np.float32); x[0] = np.nan; rows1.append(x); want1.append(0)
  rows1.append(base()); want1.append(None)
  rows2, want2 = [], []
  x = base(); x[V - 1] = np.inf; rows2.append(x); want2.append(V - 1)
  x = np.full(V, np.nan, np.float32); rows2.append(x); want2.append(0)
  x = np.full(V, -np.inf, np.float32); rows2.append(x); want2.append(0)
  x = np.full(V, -np.inf, np.float32); x[[2, 5]] = np.inf; x[9] = 1.0
  rows2.append(x); want2.append(2)
  x = base(); x[3000] = np.nan; x[2999] = -np.inf; rows2.append(x); want2.append(3000)
  return [(np.stack(rows1), want1, [1.0, 0.5, 1.0, 0.0, 1.0]),
          (np.stack(rows2), want2, [1.0, 0.0, 0.0, 0.7, 2.0])]


@pytest.mark.parametrize("gen", GENERATORS_SLOW_THREEFRY)
@pytest.mark.parametrize("batch", [0, 1])
def test_invalid_rows_through_kernel(gen, batch):
  x, want, temps = _invalid_batches()[batch]
  params = SamplingParams.make(B, temperature=temps)
  out = parity(jnp.asarray(x), params, jax.random.key(12), gen)
  invalid = np.array([w is not None for w in want])
  np.testing.assert_array_equal(out.valid, ~invalid)
  np.testing.assert_array_equal(out.tokens[invalid],
                                [w for w in want if w is not None])
  assert np.all(out.logprobs[invalid] == -np.inf)
  assert np.all(np.isfinite(out.logprobs[~invalid]))



# ---------------------------------------------------------------------------
# jax.random compatibility (batch invariance: test_batch_invariance.py).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_threefry_one_key_matches_jax_random_categorical(impl):
  x = random_logits(13, B, V, scale=1.0)
  temps = random_temps(13, B, 0.5, 2.0)
  key = jax.random.key(13)
  out = run_sample(x, SamplingParams.make(B, temperature=temps), key, impl=impl,
                   rng="threefry")
  want = np.asarray(jax.random.categorical(key, x / jnp.asarray(temps)[:, None]))
  np.testing.assert_array_equal(out.tokens, want)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_threefry_per_request_position0_matches_categorical(impl):
  x = random_logits(14, B, V, scale=1.0)
  keys = jax.random.split(jax.random.key(14), B)
  out = run_sample(x, SamplingParams.make(B), keys, impl=impl, rng="threefry",
                   positions=jnp.zeros(B, jnp.int32))
  for b in range(B):
    assert out.tokens[b] == int(jax.random.categorical(keys[b], x[b]))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_raw_key_data_equals_typed_keys(impl):
  x = random_logits(17, B, V, scale=1.0)
  params = SamplingParams.make(B)
  keys = jax.random.split(jax.random.key(17), B)
  pos = jnp.arange(B, dtype=jnp.int32)
  a = run_sample(x, params, keys, positions=pos, impl=impl)
  b = run_sample(x, params, jax.random.key_data(keys), positions=pos, impl=impl)
  assert_same_result(a, b)
  key = jax.random.key(18)
  a = run_sample(x, params, key, impl=impl)
  b = run_sample(x, params, jax.random.key_data(key), impl=impl)
  assert_same_result(a, b)


# ---------------------------------------------------------------------------
# Distribution of the kernel path.
# ---------------------------------------------------------------------------


@pytest.mark.slow  # test_pallas_matches_xla pins these bits to the reference's
@pytest.mark.parametrize("gen", GENERATORS)
def test_pallas_sampled_frequencies(gen):
  vocab, draws, t = 16, 4096, 0.8
  logits = (np.random.default_rng(19).standard_normal(vocab) * 1.2).astype(np.float32)
  x = jnp.broadcast_to(jnp.asarray(logits), (draws, vocab))
  out = run_sample(x, SamplingParams.make(draws, temperature=t),
                   jax.random.key(19), impl="pallas", rng=gen)
  y = (logits / np.float32(t)).astype(np.float64)
  probs = np.exp(y - y.max())
  probs /= probs.sum()
  assert_chi2_fits(out.tokens, probs)
  np.testing.assert_allclose(out.logprobs, np.log(probs[out.tokens]), rtol=0,
                             atol=2e-5)


# ---------------------------------------------------------------------------
# Truncation and canonical parameters through the public API.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl,gen", IMPLEMENTATIONS_BY_GENERATOR)
def test_truncated_rows_sample_in_kept_set(impl, gen):
  x = np.array(random_logits(20, B, V, scale=1.5))
  x[3, :50] = -np.inf
  temps = [1.0, 0.7, 1.3, 1.0, 0.0]
  ks, ps, ms = [40, 0, 0, 7, 3], [1.0, 0.9, 1.0, 0.8, 0.5], [0.0, 0.0, 0.1, 0.05, 0.0]
  params = SamplingParams.make(B, temperature=temps, top_k=ks, top_p=ps, min_p=ms)
  out = run_sample(jnp.asarray(x), params, jax.random.key(20), impl=impl, rng=gen)
  assert_result_types(out, B, V)
  for b in range(4):
    y = (x[b] / np.float32(temps[b])).astype(np.float32)
    o = oracle_keep(y, ks[b], ps[b], ms[b])
    assert not o.near_boundary
    assert o.kept[out.tokens[b]]
    np.testing.assert_allclose(out.logprobs[b], np.log(o.probs(y)[out.tokens[b]]),
                               rtol=1e-5, atol=2e-5)
  assert out.tokens[4] == np.argmax(x[4]) and out.logprobs[4] == 0.0


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_canonical_out_of_range_values_through_sample(impl):
  """Traced out-of-range params follow SamplingParams.canonical."""
  x = np.array(random_logits(21, B, V, scale=1.0))
  x[3, [10, 20, 30]] = 8.0  # a top tie group of three
  x[4, 77] = 8.0
  params = make_params(B, temperature=[np.nan, -1.0, np.inf, 1.0, 1.0],
                       top_p=[1.0, 1.0, 1.0, 0.0, 1.0],
                       min_p=[0.0, 0.0, 0.0, 0.0, 2.0])
  out = run_sample(jnp.asarray(x), params, jax.random.key(21), impl=impl)
  np.testing.assert_array_equal(out.tokens[:3], np.argmax(x[:3], -1))
  np.testing.assert_array_equal(out.logprobs[:3], 0.0)  # greedy
  assert out.tokens[3] in (10, 20, 30)
  np.testing.assert_allclose(out.logprobs[3], -math.log(3), atol=1e-6)
  assert out.tokens[4] == 77
  np.testing.assert_allclose(out.logprobs[4], 0.0, atol=1e-6)


@pytest.mark.parametrize("impl,gen", IMPLEMENTATIONS_BY_GENERATOR)
def test_top_k_at_least_vocab_is_off(impl, gen):
  x = random_logits(22, B, V, scale=1.0)
  key = jax.random.key(22)
  off = run_sample(x, SamplingParams.make(B, top_k=0), key, impl="xla", rng=gen)
  for k in (V, V + 1, -1):
    got = run_sample(x, make_params(B, top_k=k), key, impl=impl, rng=gen)
    assert_same_result(got, off)


def test_auto_implementation():
  x = random_logits(23, B, V)
  params = SamplingParams.make(B, temperature=random_temps(23, B))
  key = jax.random.key(23)
  expected = "pallas" if jax.default_backend() == "gpu" else "xla"
  auto = run_sample(x, params, key, impl="auto")
  assert_same_result(auto, run_sample(x, params, key, impl=expected))


def test_default_config_runs_eagerly():
  x = random_logits(24, 2, 1007)
  out = jax.tree.map(np.asarray, jaxsample.sample(x, SamplingParams.make(2),
                                                  jax.random.key(0)))
  assert_result_types(out, 2, 1007)
  assert isinstance(jaxsample.sample(x, SamplingParams.make(2), jax.random.key(0)),
                    jaxsample.SampleResult)


@pytest.mark.parametrize("impl", ["xla", "xla_search"])
def test_logprobs_off_returns_the_same_tokens_without_logprobs(impl):
  """``SamplerConfig(logprobs=False)``: ``logprobs`` None, tokens and
  ``valid`` those of the call with logprobs, with and without a mask and
  on an empty batch; a non-bool is rejected naming the field."""
  x = random_logits(3, B, V)
  params = make_params(B, top_k=[0, 5, 0, 50, 0], top_p=[1.0, 0.9, 0.8, 1.0, 1.0])
  key = jax.random.key(4)
  on = jaxsample.sample(x, params, key, config=SamplerConfig(implementation=impl))
  config = SamplerConfig(implementation=impl, logprobs=False)
  off = jaxsample.sample(x, params, key, config=config)
  off_masked, mask = jaxsample.sample(x, params, key, config=config, return_mask=True)
  for out in (off, off_masked):
    assert out.logprobs is None
    np.testing.assert_array_equal(out.tokens, on.tokens)
    np.testing.assert_array_equal(out.valid, on.valid)
  assert mask.ids.shape[0] == B
  empty = jaxsample.sample(jnp.zeros((0, V)), SamplingParams.make(0), key,
                           config=config)
  assert empty.logprobs is None and empty.tokens.shape == (0,)
  with pytest.raises(ValueError, match="logprobs must be a bool"):
    SamplerConfig(logprobs=1)


# ---------------------------------------------------------------------------
# Edge cases and bad inputs.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("per_request", [False, True])
def test_empty_batch(impl, per_request):
  x = jnp.zeros((0, 1007), jnp.float32)
  key = (jax.random.split(jax.random.key(0), 0) if per_request
         else jax.random.key(0))
  out = run_sample(x, SamplingParams.make(0), key, impl=impl, jit=False)
  assert_result_types(out, 0, 1007)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", ["1d", "3d", "int", "bool", "v0", "batch"])
def test_bad_inputs_raise_value_error(impl, case):
  params = SamplingParams.make(2)
  x = {"1d": jnp.zeros((2,)), "3d": jnp.zeros((2, 3, 4)),
       "int": jnp.zeros((2, 10), jnp.int32), "bool": jnp.zeros((2, 10), bool),
       "v0": jnp.zeros((2, 0)), "batch": jnp.zeros((3, 10))}[case]
  with pytest.raises(ValueError):
    jaxsample.sample(x, params, jax.random.key(0),
                     config=SamplerConfig(implementation=impl))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_keys_and_positions_raise_value_error(impl):
  config = SamplerConfig(implementation=impl)
  x = jnp.zeros((2, 10))
  params = SamplingParams.make(2)
  with pytest.raises(ValueError, match="positions"):
    jaxsample.sample(x, params, jax.random.key(0), positions=jnp.zeros(2, jnp.int32),
                     config=config)
  with pytest.raises(ValueError):
    jaxsample.sample(x, params, jax.random.split(jax.random.key(0), 3), config=config)
  with pytest.raises(ValueError):
    jaxsample.sample(x, params, jax.random.split(jax.random.key(0), 2),
                     positions=jnp.zeros(3, jnp.int32), config=config)
