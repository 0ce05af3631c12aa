"""jaxsample._src.spec.rejection_sample's edge cases and API errors, on both
backends (``implementation="xla"`` and ``"pallas"``; interpret mode on CPU):
padding slots, drafts without probability, a zero residual, invalid rows,
k = 0, empty batches, bf16 logits, per-request and batch keys, jit and
clamping, FP64 noise, bad inputs.  The theorem, the random layout and the
masks are test_spec.py's; kernel parity test_spec_kernels.py's.

Tokens must match exactly across programs; logprobs within 1e-5.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import spec

from helpers.cases import (REFERENCE_ONLY, B, K, V, assert_mask_types, assert_padding,
                           assert_same, keys, logits, probs_np, run, slot)
from helpers.parametrize import (IMPLEMENTATIONS, IMPLEMENTATIONS_SLOW_KERNELS,
                                 slow_case)
from helpers.sampling import make_params, run_sample


@pytest.mark.parametrize("impl", REFERENCE_ONLY)
def test_k1_equals_longer_k_with_padding(impl):
  """Slots >= num_draft are padding: their tokens and logits change nothing."""
  r = np.random.default_rng(12)
  target = logits(12, B, K + 1, V)
  draft = logits(13, B, K, V)
  drafts = r.integers(0, V, (B, K))
  n = r.integers(0, 2, B)
  params = SamplingParams.make(B, temperature=[0.0, 0.9, 1.0, 1.3] * (B // 4))
  ks = keys(B, 8)
  short = run(target[:, :2], drafts[:, :1], n, params, ks,
              draft_logits=draft[:, :1], impl=impl)
  target[:, 2:] = np.nan  # garbage padding
  drafts[:, 1:] = -5
  long = run(target, drafts, n, params, ks, draft_logits=draft, impl=impl)
  assert short.tokens.shape == (B, 2)
  assert 0 < short.num_accepted.sum() < n.sum()
  assert_same(jax.tree.map(lambda a: a[:, :2] if a.ndim == 2 else a, long),
              short)
  assert np.all(long.tokens[:, 2:] == -1)


@pytest.mark.parametrize("zero,impl", [
    *((zero, "xla") for zero in ("target", "draft", "one_hot_target")),
    ("target", "pallas"), slow_case("draft", "pallas"),
    slow_case("one_hot_target", "pallas")])
def test_drafts_with_zero_probability_are_rejected(zero, impl):
  """q_t(d) = 0 (by -inf or by top-k) or q_d(d) = 0: always rejected.
  Pallas: by -inf only (no filter, so the kernels run)."""
  r = np.random.default_rng(13)
  target = logits(13, B, K + 1, V)
  draft = logits(14, B, K, V)
  drafts = r.integers(0, V, (B, K))
  rows = np.arange(B)
  x = draft if zero == "draft" else target
  top_k = 4 if impl == "xla" else 0
  x[rows[::2], 0, drafts[::2, 0]] = -np.inf
  x[rows[1::2], 0, drafts[1::2, 0]] = -50.0 if top_k else -np.inf
  out = run(target, drafts, np.full(B, K), SamplingParams.make(B, top_k=top_k),
            keys(B), draft_logits=None if zero == "one_hot_target" else draft,
            impl=impl)
  assert_padding(out, np.zeros(B, int))
  if zero != "draft":
    assert np.all(out.tokens[:, 0] != drafts[:, 0])
  for b in range(B):
    pt = probs_np(target[b, 0], top_k=top_k)
    assert out.logprobs[b, 0] == pytest.approx(
        math.log(pt[out.tokens[b, 0]]), abs=2e-5)


def test_zero_residual_falls_back_to_the_target():
  """q_t == q_d and d outside the kept set: rejected, zero residual, so the
  emitted token is the plain sample of the target row (kernels:
  test_kernel_edge_cases_match_the_reference)."""
  target = logits(14, B, K + 1, V)
  drafts = np.argsort(target[:, :K], axis=-1)[..., 0]  # the least likely
  params = SamplingParams.make(B, temperature=0.8, top_k=3)
  ks = keys(B, 9)
  out = run(target, drafts, np.full(B, K), params, ks,
            draft_logits=target[:, :K])
  assert_padding(out, np.zeros(B, int))
  noise_keys, _ = spec.stream_keys(ks, B)
  want = run_sample(jnp.asarray(target[:, 0]), params, noise_keys,
                    positions=jnp.zeros(B, jnp.int32))
  np.testing.assert_array_equal(out.tokens[:, 0], want.tokens)
  np.testing.assert_allclose(out.logprobs[:, 0], want.logprobs, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_invalid_rows(impl):
  base = np.linspace(-1, 1, V, dtype=np.float32)
  target = np.tile(base, (B, K + 1, 1))
  drafts = np.full((B, K), 3)
  draft = np.tile(base, (B, K, 1))
  target[0, 1, 5] = np.nan  # slot 0 accepted (q_t == q_d), slot 1 invalid
  target[1, 0] = -np.inf  # greedy row without a finite logit at slot 0
  target[2, 0] = -np.inf  # invalid draft row: one-hot fallback, and ...
  target[2, 0, 3] = 0.0  # ... q_t(d) = 1: always accepted
  draft[2, 0] = np.nan
  target[3, 0, 6] = np.inf  # invalid slot 0 of a sampled row
  target[4, 2] = np.nan  # invalid beyond the stop: no effect
  target[4, 0, 3] = -np.inf
  target[5, 0, 3] = np.nan  # greedy: d is the invalid row's argmax, rejected
  temps = np.ones(B)
  temps[[1, 5]] = 0.0
  params = SamplingParams.make(B, temperature=temps)
  out = run(target, drafts, np.full(B, K), params, keys(B), draft_logits=draft,
            impl=impl)
  np.testing.assert_array_equal(out.tokens[0, :3], [3, 5, -1])
  assert out.num_accepted[0] == 1 and out.logprobs[0, 1] == -np.inf
  np.testing.assert_array_equal(out.tokens[1], [0, -1, -1, -1])
  assert out.logprobs[1, 0] == -np.inf
  assert out.num_accepted[2] == K and out.logprobs[2, 0] == 0
  np.testing.assert_array_equal(out.tokens[3], [6, -1, -1, -1])
  assert out.logprobs[3, 0] == -np.inf
  assert out.num_accepted[4] == 0 and np.isfinite(out.logprobs[4, 0])
  target[4, 2] = base
  again = run(target, drafts, np.full(B, K), params, keys(B),
              draft_logits=draft, impl=impl)
  np.testing.assert_array_equal(again.tokens[4], out.tokens[4])
  np.testing.assert_array_equal(out.tokens[5], [3, -1, -1, -1])
  assert out.logprobs[5, 0] == -np.inf
  np.testing.assert_array_equal(out.num_accepted[6:], K)  # untouched rows


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_SLOW_KERNELS)
def test_k0_is_plain_sampling(impl):
  target = logits(22, B, 1, V)
  params = SamplingParams.make(B, temperature=[0.0, 0.8] * (B // 2),
                               top_k=5)
  ks = keys(B, 13)
  out = run(target, np.zeros((B, 0)), np.zeros(B), params, ks, impl=impl)
  assert out.tokens.shape == (B, 1)
  noise_keys, _ = spec.stream_keys(ks, B)
  want = run_sample(jnp.asarray(target[:, 0]), params, noise_keys,
                    positions=jnp.zeros(B, jnp.int32))
  np.testing.assert_array_equal(out.tokens[:, 0], want.tokens)
  np.testing.assert_array_equal(out.num_accepted, 0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_empty_batch(impl):
  for key in (jax.random.key(0), keys(0)):
    out, m = spec.rejection_sample(
        jnp.zeros((0, 3, 8)), jnp.zeros((0, 2), jnp.int32),
        jnp.zeros((0,), jnp.int32), SamplingParams.make(0), key,
        draft_logits=jnp.zeros((0, 2, 8)), return_mask=True,
        config=SamplerConfig(implementation=impl, max_mask_ids=5))
    assert out.tokens.shape == (0, 3) and out.tokens.dtype == jnp.int32
    assert out.num_accepted.shape == (0,)
    assert out.logprobs.shape == (0, 3) and out.logprobs.dtype == jnp.float32
    for i in range(3):
      assert_mask_types(slot(m, i), 0, 5)
    assert m.to_json() == [] and m.to_json(num_tokens=np.zeros(0, int)) == []


@pytest.mark.parametrize("impl", REFERENCE_ONLY)
def test_bf16_logits_equal_their_fp32_upcast(impl):
  r = np.random.default_rng(15)
  target = jnp.asarray(logits(15, B, K + 1, V, scale=3.0), jnp.bfloat16)
  draft = jnp.asarray(logits(16, B, K, V, scale=3.0), jnp.bfloat16)
  drafts = r.integers(0, V, (B, K))
  params = SamplingParams.make(B, temperature=[0.0, 0.7, 1.0, 1.5] * (B // 4),
                               top_k=[0, 5] * (B // 2))
  n = r.integers(0, K + 1, B)
  low = run(target, drafts, n, params, keys(B), draft_logits=draft, impl=impl)
  high = run(target.astype(jnp.float32), drafts, n, params, keys(B),
             draft_logits=draft.astype(jnp.float32), impl=impl)
  assert_same(low, high)
  assert 0 < low.num_accepted.sum() < n.sum()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_SLOW_KERNELS)
def test_batch_invariance_with_per_request_keys(impl):
  r = np.random.default_rng(16)
  target = logits(16, B, K + 1, V, scale=2.0)
  draft = target[:, :K] + logits(17, B, K, V)
  drafts = np.argmax(draft, -1)
  n = r.integers(0, K + 1, B)
  pos = r.integers(0, 10**6, B)
  params = make_params(B, temperature=r.choice([0.0, 0.6, 1.0], B),
                       top_k=r.choice([0, 4], B),
                       top_p=r.choice([1.0, 0.7], B))
  ks = keys(B, 10)

  def sub(idx):
    return run(target[idx], drafts[idx], n[idx],
               jax.tree.map(lambda a: a[idx], params), ks[idx],
               draft_logits=draft[idx], positions=pos[idx], impl=impl)

  full = sub(np.arange(B))
  assert 0 < full.num_accepted.sum() < n.sum()
  perm = r.permutation(B)
  assert_same(jax.tree.map(lambda a: a[perm], full), sub(perm))
  for b in (0, 5, 11):
    assert_same(jax.tree.map(lambda a: a[[b]], full), sub(np.array([b])))


def test_stream_keys_are_fold_ins():
  ks = keys(5, 21)
  fold = lambda k, i: jax.random.key_data(jax.random.fold_in(k, i))
  for got, i in zip(spec.stream_keys(ks, 5), (0, 1)):
    np.testing.assert_array_equal(got, [fold(k, i) for k in ks])
  key = jax.random.key(22)
  noise, accept = spec.stream_keys(jax.random.key_data(key), 5)
  for b in range(5):
    request = jax.random.fold_in(key, b)
    np.testing.assert_array_equal(noise[b], fold(request, 0))
    np.testing.assert_array_equal(accept[b], fold(request, 1))


@pytest.mark.parametrize("impl", REFERENCE_ONLY)
def test_batch_key_is_fold_in_per_request_and_raw_equals_typed(impl):
  r = np.random.default_rng(17)
  target = logits(17, B, K + 1, V)
  drafts = r.integers(0, V, (B, K))
  args = (target, drafts, np.full(B, K), SamplingParams.make(B))
  kw = dict(draft_logits=target[:, :K] + 0.5 * logits(18, B, K, V), impl=impl)
  key = jax.random.key(18)
  one = run(*args, key, **kw)
  per = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(B))
  assert_same(one, run(*args, per, **kw))
  if impl == "xla":  # key handling precedes the dispatch to the kernels
    assert_same(one, run(*args, jax.random.key_data(per), **kw))
    assert_same(one, run(*args, jax.random.key_data(key), **kw))


@pytest.mark.parametrize("impl", REFERENCE_ONLY)
def test_jit_equals_eager_and_clamps_out_of_range(impl):
  r = np.random.default_rng(19)
  target = logits(19, B, K + 1, V)
  drafts = r.integers(0, V, (B, K))
  n = r.integers(0, K + 1, B)
  params = SamplingParams.make(B, temperature=[0.0, 1.0] * (B // 2))
  kw = dict(draft_logits=logits(20, B, K, V), impl=impl)
  eager = run(target, drafts, n, params, keys(B), jit=False, **kw)  # zero positions
  assert_same(eager, run(target, drafts, n, params, keys(B), **kw))
  wild_n = np.where(n == K, 99, np.where(n == 0, -3, n))
  wild_d = np.where(drafts == 0, -7, np.where(drafts == V - 1, 10**6, drafts))
  assert (drafts == 0).any() and (drafts == V - 1).any()
  assert_same(eager, run(target, wild_d, wild_n, params, keys(B), **kw))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_SLOW_KERNELS)
def test_fp64_gumbel_bonus_is_the_fp64_plain_sample(impl):
  target = logits(21, 8, 2, 64)
  params = SamplingParams.make(8, temperature=0.9)
  ks = keys(8, 12)
  with jax.enable_x64(True):  # jitted (eager: every op compiled alone)
    out = run(target, np.zeros((8, 1)), np.zeros(8), params, ks,
              use_fp64_gumbel=True, impl=impl)
  noise_keys, _ = spec.stream_keys(ks, 8)
  want = run_sample(jnp.asarray(target[:, 0]), params, noise_keys, fp64=True,
                    positions=jnp.zeros(8, jnp.int32))
  np.testing.assert_array_equal(out.tokens[:, 0], want.tokens)


def _bad(**over):
  b, k, v = 2, 3, 8
  args = dict(target_logits=jnp.zeros((b, k + 1, v)),
              draft_tokens=jnp.zeros((b, k), jnp.int32),
              num_draft=jnp.full((b,), k, jnp.int32),
              params=SamplingParams.make(b), key=jax.random.key(0))
  args.update(over)
  return args


@pytest.mark.parametrize("over,match", [
    (dict(target_logits=jnp.zeros((2, 8))), "target_logits"),
    (dict(target_logits=jnp.zeros((2, 4, 8), jnp.int32)), "floating"),
    (dict(target_logits=jnp.zeros((2, 4, 0))), "vocabulary"),
    (dict(draft_tokens=jnp.zeros((2, 2), jnp.int32)), "draft_tokens"),
    (dict(draft_tokens=jnp.zeros((2, 3))), "draft_tokens"),
    (dict(num_draft=jnp.zeros((3,), jnp.int32)), "num_draft"),
    (dict(num_draft=jnp.int32([0, 4])), r"num_draft must be in \[0, k=3\]"),
    (dict(num_draft=jnp.int32([-1, 0])), r"num_draft must be in"),
    (dict(draft_logits=jnp.zeros((2, 3, 7))), "draft_logits"),
    (dict(draft_logits=jnp.zeros((2, 4, 8))), "draft_logits"),
    (dict(synthetic_rates=jnp.zeros((4,))), "synthetic_rates"),
    (dict(positions=jnp.zeros((2,))), "positions"),
    (dict(params=SamplingParams.make(3)), "batch size"),
    (dict(key=keys(3)), "per-request keys"),
])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_inputs_raise_value_error(over, match, impl):
  with pytest.raises(ValueError, match=match):
    spec.rejection_sample(**_bad(**over),
                          config=SamplerConfig(implementation=impl))


def test_module_is_exported():
  assert jaxsample._src.spec is spec
