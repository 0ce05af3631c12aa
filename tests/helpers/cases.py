"""Input batches, runners and checks that several test modules share (the
float64 oracle lives in ``helpers.oracle``, the statistics in
``helpers.stats``, small models in ``helpers.toy_lm``)."""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import reference, rng, spec
from jaxsample._src.pallas import threshold
from jaxsample._src.tuning import RaceLaunch, Tuning

from helpers.oracle import FP32_EPS, oracle_keep
from helpers.sampling import closing_over, without_truncation


# ---------------------------------------------------------------------------
# Rows of every kind and the oracle grid.
# ---------------------------------------------------------------------------


P_VALUES = (1e-6, 0.5, 0.9, 0.999999, 1.0)


M_VALUES = (0.0, 0.05, 0.5, 1.0)


def k_values(vocab):
  return (1, 2, 50 if vocab > 50 else 5, vocab - 1, vocab)


def make_row(kind, r, vocab):
  if kind == "random":
    return r.standard_normal(vocab) * 1.5
  if kind == "wide":
    return r.standard_normal(vocab) * 6 + 20
  if kind == "peaked":  # one token with probability 0.999
    x = np.zeros(vocab)
    x[r.integers(vocab)] = math.log(0.999 * (vocab - 1) / 0.001)
    return x
  if kind == "flat":
    return np.full(vocab, -1.25)
  if kind == "ties":  # values from a small integer set: ties at every boundary
    return r.integers(0, 4, vocab).astype(np.float64)
  if kind == "ties_halves":
    return r.integers(-6, 1, vocab) * 0.5
  if kind == "neg_inf":
    x = r.standard_normal(vocab)
    x[r.random(vocab) < 0.4] = -np.inf
    x[r.integers(vocab)] = 0.5
    return x
  if kind == "few_finite":
    x = np.full(vocab, -np.inf)
    x[r.choice(vocab, size=min(3, vocab), replace=False)] = [1.0, 1.0, -2.0][:min(3, vocab)]
    return x
  if kind == "single_finite":
    x = np.full(vocab, -np.inf)
    x[r.integers(vocab)] = -7.0
    return x
  raise ValueError(kind)


KINDS = ("random", "wide", "peaked", "flat", "ties", "ties_halves", "neg_inf",
         "few_finite", "single_finite")


def oracle_grid(vocab, seed, m_values=M_VALUES):
  """Rows of every kind for every (p, k, min-p): ``(y, ks, ps, ms, combos)``."""
  r = np.random.default_rng(seed)
  combos = list(itertools.product(P_VALUES, k_values(vocab), m_values))
  rows = [make_row(kind, r, vocab) for kind in KINDS for _ in combos]
  ks, ps, ms = ([c[i] for _ in KINDS for c in combos] for i in (1, 0, 2))
  return np.asarray(rows, np.float32), ks, ps, ms, combos


# ---------------------------------------------------------------------------
# Tolerances of the kernels' fp32 sums.
# ---------------------------------------------------------------------------


# Logprobs of the kernels vs the reference on the same fp32 ``y`` and kept
# set (bf16/fp16 widen to fp32 exactly): they differ in how the fp32 mass
# ``S = sum_K exp(y - max)`` is summed.  ``|d log S| = |dS / S|``: a
# tree-ordered sum of <= V terms in (0, 1] is off by ~log2(V) eps (17 eps,
# 2e-6, at V = 151936), and on a GPU the kernels' ``ex2.approx`` (< 2^-22 per
# term) and ``x * (1 / T)`` add < 1e-6 here, hence ``atol``; ``rtol`` (8 eps)
# covers the rounding of the logprob itself.  Measured on CPU: at most 1 ulp
# (<= 9.5e-7) at V = 1007 and V = 151936.
LOGPROB_RTOL, LOGPROB_ATOL = 1e-6, 4e-6


LSE_ATOL, LOGZ_ATOL = 3e-6, 4e-6  # ``check_kept_mass_and_lse_match_float64``


def mass_tolerance(lse, atol):
  """The fp32 error bound of the kernels' ``lse`` (``atol`` ``LSE_ATOL``)
  and ``logz`` (``LOGZ_ATOL``) on a row whose logsumexp is ``lse``: two
  rounded adds of magnitude ``|lse|`` and the relative error of the fp32
  sums (``check_kept_mass_and_lse_match_float64`` says why)."""
  return 2 * FP32_EPS * abs(lse) + atol


def logsumexp64(y, where):
  y = np.asarray(y, np.float64)[where]
  return float(y.max() + np.log(np.sum(np.exp(y - y.max()))))


# ---------------------------------------------------------------------------
# The kept-set batch (every row kind x p x k x min-p).
# ---------------------------------------------------------------------------


def tail_rows(vocab, r):
  """Rows on which top-p 0.999999 drops a tail: a near-flat bulk (every
  token above 3e-6 of the mass, at V = 151936 too) and three tail tokens
  holding 2.5e-8, 1.5e-8 and 1e-8 of it.  The crossing (the bulk's last
  token) lies 9.6e-7 of the mass (8.1 eps) above ``p = 0.999999`` and over
  2e-6 below it, beyond the oracle's margin (``top_p_rtol``), so the kept
  set (the bulk) is checked exactly: ``(rows, ks, ps, ms)``, with top-k off
  and at ``V - 1`` (which drops the smallest tail token)."""
  rows = []
  for _ in range(2):
    x = r.standard_normal(vocab) * 0.1
    tail = r.choice(vocab, 3, replace=False)
    x[tail] = -np.inf
    bulk = np.log(np.sum(np.exp(x)))
    x[tail] = bulk + np.log([2.5e-8, 1.5e-8, 1e-8])
    rows.append(x)
  return (np.asarray(rows, np.float32), [vocab, vocab - 1], [0.999999] * 2,
          [0.0] * 2)


def invalid_rows(vocab, r):
  """Invalid truncating rows (README "Bad input"): random rows with a few
  NaNs (top-p 0.999999; top-k 50, top-p 0.9 and min-p 0.05) and with one
  +inf (top-k 2, top-p 0.5): ``(rows, ks, ps, ms)``."""
  x = r.standard_normal((3, vocab)) * 1.5
  x[0, r.choice(vocab, 3, replace=False)] = np.nan
  x[1, r.choice(vocab, 2, replace=False)] = np.nan
  x[2, r.integers(vocab)] = np.inf
  return (x.astype(np.float32), [vocab, 50, 2], [0.999999, 0.9, 0.5],
          [0.0, 0.05, 0.0])


def kept_set_batch(vocab):
  """The oracle grid (``oracle_grid``'s rows, unchanged) followed by
  ``tail_rows`` and ``invalid_rows``: ``(y, ks, ps, ms, kinds)``."""
  y, ks, ps, ms, combos = oracle_grid(vocab, seed=vocab + 1,
                                     m_values=M_VALUES[:3])
  r = np.random.default_rng(vocab + 2)
  kinds = [kind for kind in KINDS for _ in combos]
  for kind, (rows, *cols) in (("tail", tail_rows(vocab, r)),
                              ("invalid", invalid_rows(vocab, r))):
    y = np.concatenate([y, rows])
    ks, ps, ms = (a + list(b) for a, b in zip((ks, ps, ms), cols))
    kinds += [kind] * len(rows)
  return y, ks, ps, ms, np.asarray(kinds)


# ---------------------------------------------------------------------------
# The public sampler: logits, temperatures, launches and result checks.
# ---------------------------------------------------------------------------


SAMPLE_SHAPE = (5, 4096)  # the sampler tests' workhorse shape (shared compiles)


def params_by_row(cases, batch: int, r) -> SamplingParams:
  """``SamplingParams`` of ``batch`` rows, row ``b`` taking the keyword dict
  ``cases[(b + random) % len(cases)]`` (absent fields at their neutral
  values): every case appears once ``batch >= len(cases)``."""
  rows = [cases[(b + int(r.integers(len(cases)))) % len(cases)]
          for b in range(batch)]
  field = lambda name, off: [row.get(name, off) for row in rows]
  return SamplingParams.make(batch, temperature=field("temperature", 1.0),
                             top_k=field("top_k", 0), top_p=field("top_p", 1.0),
                             min_p=field("min_p", 0.0))


def race(**launch) -> Tuning:
  """A tuning override of the Gumbel race's launch (``tuning.RaceLaunch``)."""
  return Tuning(gumbel=RaceLaunch(**launch))


def random_logits(seed, batch, vocab, scale=2.0, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  return jnp.asarray(r.standard_normal((batch, vocab)) * scale,
                     jnp.float32).astype(dtype)


def random_temps(seed, batch, lo=0.4, hi=1.8):
  return np.random.default_rng(seed + 1000).uniform(lo, hi, batch).astype(np.float32)


def assert_same_result(a, b):
  """Tokens and validity bit-identical, logprobs within 1e-5."""
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.valid, b.valid)
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)


def assert_tokens_off_boundary(out, ref, logits, params, *, most_differ=1):
  """``out``'s tokens and validity against the reference result ``ref``:
  tokens equal on every row but those whose kept set lies on a top-p
  rounding boundary (the oracle's ``near_boundary``), at most
  ``most_differ`` of them."""
  vocab = np.shape(logits)[1]
  canon = params.canonical(vocab)
  y = np.asarray(reference.temper(reference.sanitize(jnp.asarray(logits)),
                                  canon.temperature))
  np.testing.assert_array_equal(np.asarray(out.valid), np.asarray(ref.valid))
  differ = np.flatnonzero(np.asarray(out.tokens) != np.asarray(ref.tokens))
  for b in differ:
    oracle = oracle_keep(y[b], int(canon.top_k[b]), float(canon.top_p[b]),
                         float(canon.min_p[b]))
    assert oracle.near_boundary, (b, out.tokens[b], ref.tokens[b])
  assert len(differ) <= most_differ, differ


def assert_result_types(out, batch, vocab):
  assert out.tokens.shape == (batch,) and out.tokens.dtype == np.int32
  assert out.logprobs.shape == (batch,) and out.logprobs.dtype == np.float32
  assert out.valid.shape == (batch,) and out.valid.dtype == np.bool_
  assert np.all((out.tokens >= 0) & (out.tokens < vocab))


# ---------------------------------------------------------------------------
# The truncation kernels, jitted.
# ---------------------------------------------------------------------------


@functools.cache
def _truncated_sampler(config):
  """One jitted ``sample_truncated`` per config: params and streams are
  arguments, so calls of one shape compile once."""
  return jax.jit(functools.partial(threshold.sample_truncated, config=config))


def truncate(x, params, config=SamplerConfig(), key=jax.random.key(0)):
  batch, vocab = x.shape
  canon = params.canonical(vocab)
  streams, _ = rng.row_streams(key, None, batch, vocab)
  return jax.tree.map(np.asarray, _truncated_sampler(config)(
      jnp.asarray(x), canon, streams))



# ---------------------------------------------------------------------------
# Sampling masks.
# ---------------------------------------------------------------------------


FIELDS = ("ids", "count", "logz", "lse", "truncated", "overflow")


_extract = jax.jit(jaxsample.extract_sampling_mask, static_argnames=("config",))


def to_np(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def extract(logits, params, **config_kw):
  """``extract_sampling_mask``, jitted; the XLA reference unless
  ``implementation`` says otherwise."""
  config_kw.setdefault("implementation", "xla")
  return to_np(_extract(jnp.asarray(logits), params,
                        config=SamplerConfig(**config_kw)))


sample_masked = jax.jit(functools.partial(jaxsample.sample, return_mask=True),
                        static_argnames=("config",))


def sample_with_mask(logits, params, key, *, impl, positions=None, **config_kw):
  """``sample(..., return_mask=True)``, jitted; kernel runs of batches without
  filters close over the params (``helpers.sampling.closing_over``)."""
  config = SamplerConfig(implementation=impl, **config_kw)
  if impl == "pallas" and without_truncation(params, np.shape(logits)[1]):
    fn = closing_over(params, lambda p: lambda x, k, pos: jaxsample.sample(
        x, p, k, positions=pos, return_mask=True, config=config), config)
    return to_np(fn(jnp.asarray(logits), key, positions))
  return to_np(sample_masked(jnp.asarray(logits), params, key,
                             positions=positions, config=config))


def oracle_order(y, kept):
  """Kept ids by descending ``y``, smallest id first among equal values."""
  order = np.lexsort((np.arange(len(y)), -np.asarray(y, np.float64)))
  return order[kept[order]]


def assert_masks_equal(a, b, *, exact_floats=True):
  """Equal kept sets; ``logz``/``lse`` bit-equal, or within 1e-5 when the
  masses come from a kernel's own summation order (``exact_floats=False``)."""
  for f in FIELDS:
    if f in ("logz", "lse") and not exact_floats:
      np.testing.assert_allclose(getattr(a, f), getattr(b, f), rtol=1e-5,
                                 atol=1e-5, err_msg=f)
    else:
      np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


def assert_mask_types(m, batch, cap):
  assert m.ids.shape == (batch, cap) and m.ids.dtype == np.int32
  for f, dtype in (("count", np.int32), ("logz", np.float32),
                   ("lse", np.float32), ("truncated", np.bool_),
                   ("overflow", np.bool_)):
    assert getattr(m, f).shape == (batch,), f
    assert getattr(m, f).dtype == dtype, f


def listed(m, b):
  """Row ``b``'s listed ids (asserting the -1 padding after them)."""
  n = min(int(m.count[b]), m.ids.shape[1]) if m.truncated[b] else 0
  assert np.all(m.ids[b, n:] == -1), (b, m.ids[b])
  return m.ids[b, :n]


def mask_kept(m, b, y):
  """Row ``b``'s kept set as a bool ``[V]`` (needs ``count <= K_cap``)."""
  if not m.truncated[b]:
    return np.asarray(y) > -np.inf
  kept = np.zeros(len(y), bool)
  kept[listed(m, b)] = True
  return kept


def rebuilt_logprob(m, b, y, token):
  """``y_token - lse - logz`` in float64: the log-probability a consumer
  rebuilds from the mask."""
  return float(y[token]) - float(m.lse[b]) - float(m.logz[b])


def tempered(x, t):
  """Step 2 in numpy (greedy rows keep ``x``)."""
  x = np.asarray(x, np.float32)
  return x if t == 0 else (x / np.float32(t)).astype(np.float32)


# ---------------------------------------------------------------------------
# Speculative decoding: the workhorse shape and runner.
# ---------------------------------------------------------------------------


B, K, V = 64, 3, 16  # the shared workhorse shape


PALLAS_SLICE = 1024


_jitted = jax.jit(spec.rejection_sample,
                  static_argnames=("config", "return_mask"))


def run(target, drafts, num_draft, params, key, *, draft_logits=None,
        rates=None, positions=None, gen="philox", jit=True, impl="xla",
        return_mask=False, **config_kw):
  """``rejection_sample`` as numpy; jitted with explicit positions (default
  0) unless ``jit=False`` (kernel runs of batches without filters close over
  the params: ``helpers.sampling.closing_over``).  Pallas batches of per-request keys
  larger than ``PALLAS_SLICE`` run slice by slice (the last slice padded by
  wrapping), unless ``return_mask``."""
  batch = len(num_draft)
  if positions is None and (jit or rng.key_words(key).ndim == 2):
    positions = np.zeros(batch)
  per_request = rng.key_words(key).ndim == 2
  if (impl == "pallas" and jit and per_request and batch > PALLAS_SLICE and
      not return_mask):
    parts = []
    for start in range(0, batch, PALLAS_SLICE):
      idx = np.arange(start, start + PALLAS_SLICE) % batch
      take = lambda a: None if a is None else np.asarray(a)[idx]
      part = run(take(target), take(drafts), take(num_draft),
                 jax.tree.map(lambda a: a[idx], params), key[idx],
                 draft_logits=take(draft_logits), rates=rates,
                 positions=take(positions), gen=gen, impl=impl, **config_kw)
      parts.append(jax.tree.map(lambda a: a[:batch - start], part))
    return jax.tree.map(lambda *a: np.concatenate(a), *parts)
  config = SamplerConfig(rng=gen, implementation=impl, **config_kw)
  fn = functools.partial(_jitted if jit else spec.rejection_sample,
                         config=config, return_mask=return_mask)
  if jit and impl == "pallas" and without_truncation(params,
                                                     np.shape(target)[-1]):
    closed = closing_over(params, lambda p: lambda t, d, n, k, **kw: (
        spec.rejection_sample(t, d, n, p, k, config=config,
                              return_mask=return_mask, **kw)), config,
                          return_mask)
    fn = lambda t, d, n, p, k, **kw: closed(t, d, n, k, **kw)
  out = fn(jnp.asarray(target), jnp.asarray(drafts, jnp.int32),
           jnp.asarray(num_draft, jnp.int32), params, key,
           draft_logits=None if draft_logits is None else jnp.asarray(
               draft_logits),
           synthetic_rates=None if rates is None else jnp.float32(rates),
           positions=None if positions is None else jnp.asarray(
               positions, jnp.int32))
  return jax.tree.map(np.asarray, out)


def assert_same(a, b):
  """Tokens and counts identical, logprobs within 1e-5 (module doc)."""
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.num_accepted, b.num_accepted)
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)


# For tests of the definition whose kernel-path cases test_spec_kernels.py's
# parity tests pin bit for bit (greedy rows, synthetic rates 0 and 1, k = 1,
# bf16, batch keys, clamping): on CPU they run the reference alone, as a
# kernel-path compile in interpret mode (threshold kernels included) costs
# ~30 s.
REFERENCE_ONLY = ("xla",)


def probs_np(x, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
  """Processed distribution of one row (float64 oracle; point mass if greedy)."""
  x = np.asarray(x, np.float32)
  if temperature == 0:
    return np.eye(x.size)[np.argmax(x)]
  y = (x / np.float32(temperature)).astype(np.float32)
  o = oracle_keep(y, top_k, top_p, min_p)
  assert not o.near_boundary
  return o.probs(y)


def assert_padding(out, num_accepted):
  """``num_accepted`` as given; emitted slots hold tokens, the rest -1 / 0."""
  pad = np.arange(out.tokens.shape[1])[None] > num_accepted[:, None]
  np.testing.assert_array_equal(out.num_accepted, num_accepted)
  assert np.all(out.tokens[pad] == -1) and np.all(out.tokens[~pad] >= 0)
  assert np.all(out.logprobs[pad] == 0)


def slot(m, i):
  """Slot ``i`` of a mask with a token axis: a mask of ``[B, ...]`` fields."""
  return jax.tree.map(lambda a: a[i], m)


def keys(n, seed=0):
  return jax.random.split(jax.random.key(seed), n)


def logits(seed, *shape, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(
      np.float32)


# ---------------------------------------------------------------------------
# Speculative decoding: edge cases.
# ---------------------------------------------------------------------------


def edge_case_batch(seed, batch, k, vocab, *, with_draft):
  """Random requests with edge cases in fixed row groups (see the test)."""
  r = np.random.default_rng(seed)
  target = logits(seed, batch, k + 1, vocab, scale=2.0)
  draft = target[:, :k] + 0.7 * logits(seed + 1, batch, k, vocab)
  target[r.random(target.shape) < 0.1] = -np.inf
  draft[r.random(draft.shape) < 0.1] = -np.inf
  drafts = np.where(r.random((batch, k)) < 0.6, np.argmax(draft, -1),
                    r.integers(0, vocab, (batch, k)))
  n = r.integers(0, k + 1, batch)
  temps = r.choice([0.0, 0.6, 1.0, 1.7], batch)
  pos = r.integers(0, 2**31, batch)
  # 0-7: all accepted: draft rows equal to target rows peaked at the drafts
  # (q_t(d) = 1 - O(e^-40) for one-hot drafts).
  g = slice(0, 8)
  target[g] = logits(seed + 2, 8, k + 1, vocab)
  drafts[g] = r.integers(0, vocab, (8, k))
  for i in range(k):
    target[g, i][np.arange(8), drafts[g, i]] = 50.0
  draft[g] = target[g, :k]
  n[g], temps[g] = k, 1.0
  # 8-15: the first draft has no target mass.
  g = slice(8, 16)
  target[g, 0][np.arange(8), drafts[g, 0]] = -np.inf
  n[g], temps[g] = k, 0.9
  # 16-23: zero residual: equal rows, the draft -inf in both (draft logits).
  g = slice(16, 24)
  draft[g] = target[g, :k]
  draft[g, 0][np.arange(8), drafts[g, 0]] = -np.inf
  target[g, 0][np.arange(8), drafts[g, 0]] = -np.inf
  n[g], temps[g] = k, 1.3
  # 24-27: invalid target rows at slot 0 (NaN, +inf, no finite entry, x / T
  # overflowing), 28-31: invalid draft rows (one-hot fallback).
  target[24, 0, 3] = np.nan
  target[25, 0, 5] = np.inf
  target[26, 0] = -np.inf
  target[27, 0, [2, 7]] = 3e38
  draft[28:32, 0, 1] = np.nan
  n[24:32], temps[24:28], temps[28:32] = k, [1.0, 1.0, 0.8, 0.5], 1.1
  # 32, 33: slot 0 valid and accepted-prone, an invalid slot 1.
  target[32:34, 1, 4] = np.nan
  params = SamplingParams.make(batch, temperature=temps)
  return (target, drafts, n, params, keys(batch, seed)), dict(
      draft_logits=draft if with_draft else None, positions=pos)
