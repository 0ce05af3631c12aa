"""jaxsample._src.spec.rejection_sample: speculative sampling (spec.py docstring),
on both backends (``implementation="xla"`` and ``"pallas"``; on CPU the fused
kernels of ``jaxsample._src.pallas.spec`` run in interpret mode): the theorem,
the synthetic mode's rates, the random layout and the masks.

Statistics: the token emitted at slot ``i`` (given the request reached ``i``)
is distributed as the processed target distribution (numpy float64 oracle of
helpers/oracle.py), over many independent requests with per-request keys.
Bit-level checks pin the random layout: the bonus / fallback draw is
``jaxsample.sample``'s with the noise keys, the acceptance uniform is the
documented stream's, the residual draw is Gumbel-max on the residual.

Edge cases (padding, zero-probability drafts, invalid rows, k = 0, empty
batches, dtypes, keys, FP64) and API errors: test_spec_edges.py.
Kernel coverage: test_spec_kernels.py compares the kernels with the reference
on fresh random inputs (edge cases, truncation, splits, dtypes, generators,
FP64) and lowers every kernel variant for an abstract H100 (Triton IR, no GPU
needed).

Tokens must match exactly across programs; logprobs within 1e-5 (XLA:CPU
reductions may differ in the last ulp between programs, as in test_sample.py).
Most tests share the shape ``[B, k + 1, V] = [64, 4, 16]`` to reuse
compilations; Pallas runs of large batches go in slices of ``PALLAS_SLICE``
requests (one compilation; exact, since per-request keys make every request
independent of its batch).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import rng, spec

from helpers.cases import (PALLAS_SLICE, REFERENCE_ONLY, B, K, V, assert_mask_types,
                           assert_masks_equal, assert_padding, assert_same, extract,
                           keys, logits, mask_kept, probs_np, rebuilt_logprob, run,
                           slot, tempered)
from helpers.parametrize import slow_case
from helpers.sampling import run_sample
from helpers.stats import assert_chi2_fits


def assert_rate(hits, n, p, sigmas=4.0):
  """Binomial check: ``hits`` of ``n`` trials at probability ``p``."""
  assert abs(hits / n - p) <= sigmas * math.sqrt(p * (1 - p) / n), (hits, n, p)



# ---------------------------------------------------------------------------
# The speculative-sampling theorem, statistically.
# ---------------------------------------------------------------------------

N, SK = 8192, 2  # requests per case, draft slots
CASES = {
    "plain": dict(temperature=1.0),
    "truncated": dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.02),
    "top_p_hot": dict(temperature=1.6, top_p=0.7),
}
FULL = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


@pytest.fixture(scope="module",
                params=[("draft_logits", "xla"), ("one_hot", "xla"),
                        slow_case(("draft_logits", "pallas"))],
                ids=lambda p: "-".join(p))
def theorem(request):
  """N requests per case on fixed logits; drafts sampled by numpy.  Pallas:
  the untruncated case with draft logits (interpret mode is slow; the
  truncating cases and one-hot drafts are pinned to the reference bit for bit
  by the parity tests)."""
  mode, impl = request.param
  r = np.random.default_rng(7)
  target = logits(7, SK + 1, V, scale=2.5)
  draft = target[:SK] + logits(8, SK, V)
  with_logits = mode == "draft_logits"
  cases = CASES if impl == "xla" else {"plain": CASES["plain"]}
  expect, ds, cols = {}, [], {f: [] for f in FULL}
  for name, cfg in cases.items():
    cfg = dict(FULL, **cfg)
    pt = [probs_np(target[i], **cfg) for i in range(SK + 1)]
    # With draft logits the drafts follow the processed draft distribution;
    # one-hot drafts may follow any distribution: the untruncated cold target.
    pd = [probs_np(draft[i], **cfg) if with_logits else
          probs_np(target[i], temperature=0.5) for i in range(SK)]
    ds.append(np.stack([r.choice(V, size=N, p=p) for p in pd], axis=1))
    expect[name] = (pt, pd)
    for f in cols:
      cols[f] += [cfg[f]] * N
  batch = N * len(cases)
  res = run(np.broadcast_to(target, (batch, SK + 1, V)), np.concatenate(ds),
            np.full(batch, SK), SamplingParams.make(batch, **cols),
            keys(batch, 11),
            draft_logits=np.broadcast_to(draft, (batch, SK, V))
            if with_logits else None, impl=impl)
  out = {name: jax.tree.map(lambda a: a[c * N:(c + 1) * N], res)
         for c, name in enumerate(cases)}
  return with_logits, out, expect, (target, draft, np.concatenate(ds),
                                     keys(batch, 11))


def test_emitted_tokens_follow_the_target_distribution(theorem):
  with_logits, outs, expect, _ = theorem
  for name, out in outs.items():
    check_theorem(out, *expect[name], with_logits)


def check_theorem(out, pt, pd, with_logits):
  """The emitted tokens of one case follow the processed target ``pt``."""
  assert_padding(out, out.num_accepted)
  for i in range(SK + 1):
    rows = out.num_accepted >= i
    assert rows.sum() >= 300, (i, rows.sum())  # enough draws to test
    tok = out.tokens[rows, i]
    assert_chi2_fits(tok, pt[i])
    np.testing.assert_allclose(out.logprobs[rows, i], np.log(pt[i][tok]),
                               rtol=0, atol=2e-5)
  # Acceptance at slot 0: sum min(p_t, p_d), or E_{d ~ q}[p_t(d)] one-hot.
  alpha = (np.minimum(pt[0], pd[0]).sum() if with_logits else pd[0] @ pt[0])
  assert_rate(int((out.num_accepted >= 1).sum()), N, alpha)
  counts = np.bincount(out.num_accepted, minlength=SK + 1)
  assert np.all(counts >= 200), counts  # rejections at every slot: not vacuous


def test_residual_draw_is_gumbel_max_on_the_residual(theorem):
  """After a rejection at slot 0 ("plain" case): argmax(log max(p_t - p_d, 0)
  + g), g the Gumbel noise of stream (fold_in(r_b, 0), position 0)."""
  with_logits, out, expect, (target, draft, drafts, ks) = theorem
  pt, pd = expect["plain"][0][0], probs_np(draft[0])
  rejected = np.flatnonzero(out["plain"].num_accepted == 0)[:400]
  assert rejected.size == 400
  noise_keys, _ = spec.stream_keys(ks[rejected], rejected.size)
  streams, _ = rng.row_streams(noise_keys, jnp.zeros(rejected.size, jnp.int32),
                               rejected.size, V)
  g = np.asarray(rng.gumbel_noise("philox", streams, V), np.float64)
  ties = 0
  for row, b in enumerate(rejected):
    p_d = pd if with_logits else np.eye(V)[drafts[b, 0]]
    with np.errstate(divide="ignore"):
      race = np.log(np.maximum(pt - p_d, 0)) + g[row]
    top2 = np.sort(race)[-2:]
    if top2[1] - top2[0] < 1e-4:  # too close to call in fp32
      ties += 1
    else:
      assert out["plain"].tokens[b, 0] == np.argmax(race), b
  assert ties <= 2


@pytest.mark.parametrize("impl", REFERENCE_ONLY)
def test_greedy_rows_accept_while_draft_is_the_argmax(impl):
  r = np.random.default_rng(3)
  target = r.integers(0, 4, (B, K + 1, V)).astype(np.float32)  # many ties
  am = np.argmax(target, axis=-1)
  drafts = np.where(r.random((B, K)) < 0.7, am[:, :K],
                    r.integers(0, V, (B, K)))
  num_draft = r.integers(0, K + 1, B)
  temps = np.where(np.arange(B) % 4 == 3, 0.9, 0.0)  # mixed with sampled rows
  # Filters change nothing for greedy rows (pallas: off, so kernels run).
  trunc = dict(top_k=2, top_p=0.5) if impl == "xla" else {}
  params = SamplingParams.make(B, temperature=temps, **trunc)
  out = run(target, drafts, num_draft, params, keys(B),
            draft_logits=logits(3, B, K, V), impl=impl)
  for b in np.flatnonzero(temps == 0):
    j = 0
    while j < num_draft[b] and drafts[b, j] == am[b, j]:
      j += 1
    want = list(drafts[b, :j]) + [am[b, j]] + [-1] * (K - j)
    np.testing.assert_array_equal(out.tokens[b], want, err_msg=str(b))
    assert out.num_accepted[b] == j
    np.testing.assert_array_equal(out.logprobs[b], 0.0)
  assert len(set(out.num_accepted[temps == 0])) == K + 1


# ---------------------------------------------------------------------------
# Synthetic acceptance.
# ---------------------------------------------------------------------------

SYN = 4096  # requests in the synthetic-mode batch


@pytest.mark.parametrize("impl", REFERENCE_ONLY)
def test_synthetic_rates_are_the_conditional_acceptance_rates(impl):
  rates = [0.85, 0.5, 0.25]
  syn = SYN if impl == "xla" else 2 * PALLAS_SLICE
  r = np.random.default_rng(5)
  target = logits(5, syn, K + 1, V, scale=2.0)
  draft = target[:, :K] * 0.5
  drafts = r.integers(0, V, (syn, K))
  temps = np.where(np.arange(syn) % 8 == 0, 0.0, 1.0)
  out = run(target, drafts, np.full(syn, K),
            SamplingParams.make(syn, temperature=temps), keys(syn, 2),
            draft_logits=draft, rates=rates, impl=impl)
  assert_padding(out, out.num_accepted)
  for i, rate in enumerate(rates):
    reached = out.num_accepted >= i
    assert_rate(int((out.num_accepted[reached] > i).sum()), int(reached.sum()),
                rate)
  # Rejected sampled rows emit from the residual max(p_t - p_d, 0), with the
  # token's target logprob; accepted drafts keep theirs.
  sampled = temps > 0
  for b in np.flatnonzero((out.num_accepted == 0) & sampled)[:100]:
    pt, pd = probs_np(target[b, 0]), probs_np(draft[b, 0])
    t = out.tokens[b, 0]
    assert pt[t] > pd[t]
    assert out.logprobs[b, 0] == pytest.approx(math.log(pt[t]), abs=2e-5)
  for b in np.flatnonzero((out.num_accepted >= 1) & sampled)[:100]:
    assert out.logprobs[b, 0] == pytest.approx(
        math.log(probs_np(target[b, 0])[drafts[b, 0]]), abs=2e-5)


@pytest.mark.parametrize("impl", REFERENCE_ONLY)
def test_synthetic_rates_zero_and_one(impl):
  syn = SYN if impl == "xla" else PALLAS_SLICE
  r = np.random.default_rng(6)
  target = logits(6, syn, K + 1, V)
  drafts = r.integers(0, V, (syn, K))
  params = SamplingParams.make(syn, temperature=[0.0, 1.0] * (syn // 2))
  n = r.integers(0, K + 1, syn)
  kw = dict(draft_logits=target[:, :K], impl=impl)
  out = run(target, drafts, n, params, keys(syn), rates=[1.0, 1.0, 1.0], **kw)
  assert_padding(out, n)
  real = np.arange(K)[None] < n[:, None]
  np.testing.assert_array_equal(out.tokens[:, :K][real], drafts[real])
  out = run(target, drafts, n, params, keys(syn), rates=[0.0, 1.0, 1.0], **kw)
  assert_padding(out, np.zeros(syn, int))


# ---------------------------------------------------------------------------
# Bit-level definitions: plain-sampling draws and the random layout.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("gen,impl", [("philox", "xla"), ("threefry", "xla"),
                                      slow_case("philox", "pallas")])
def test_zero_drafts_emit_the_plain_sample(gen, impl):
  r = np.random.default_rng(8)
  target = logits(8, B, K + 1, V, scale=2.0)
  target[r.random(target.shape) < 0.2] = -np.inf
  params = SamplingParams.make(
      B, temperature=r.choice([0.0, 0.7, 1.2], B),
      top_k=r.choice([0, 5], B), top_p=r.choice([1.0, 0.8], B))
  pos = r.integers(0, 2**31 - 1, B)
  pos[0] = 2**31 - 1
  ks = keys(B, 4)
  out = run(target, r.integers(0, V, (B, K)), np.zeros(B), params, ks,
            draft_logits=logits(9, B, K, V), positions=pos, gen=gen,
            impl=impl)
  assert_padding(out, np.zeros(B, int))
  noise_keys, _ = spec.stream_keys(ks, B)
  want = run_sample(jnp.asarray(target[:, 0]), params, noise_keys,
                    positions=jnp.asarray(pos, jnp.int32), rng=gen)
  np.testing.assert_array_equal(out.tokens[:, 0], want.tokens)
  np.testing.assert_allclose(out.logprobs[:, 0], want.logprobs, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("cfg,impl", [
    (dict(temperature=1.0), "xla"),
    (dict(temperature=0.5, top_k=4), "xla"),
    (dict(temperature=2.0, top_p=0.6, min_p=0.1), "xla"),
    slow_case(dict(temperature=1.0), "pallas"),
])
def test_all_accepted_when_draft_equals_target(cfg, impl):
  """q_t == q_d: the ratio is exactly 1 > u; the bonus is the plain sample at
  position p + n."""
  r = np.random.default_rng(9)
  target = logits(9, B, K + 1, V, scale=1.5)
  full = dict(FULL, **cfg)
  drafts = np.array([[r.choice(V, p=probs_np(target[b, i], **full))
                      for i in range(K)] for b in range(B)])
  n = r.integers(0, K + 1, B)
  pos = r.integers(0, 10**6, B)
  params = SamplingParams.make(B, **cfg)
  ks = keys(B, 5)
  out = run(target, drafts, n, params, ks, draft_logits=target[:, :K],
            positions=pos, impl=impl)
  assert_padding(out, n)
  real = np.arange(K)[None] < n[:, None]
  np.testing.assert_array_equal(out.tokens[:, :K][real], drafts[real])
  noise_keys, _ = spec.stream_keys(ks, B)
  rows = np.arange(B)
  want = run_sample(jnp.asarray(target[rows, n]), params, noise_keys,
                    positions=jnp.asarray(pos + n, jnp.int32))
  np.testing.assert_array_equal(out.tokens[rows, n], want.tokens)
  np.testing.assert_allclose(out.logprobs[rows, n], want.logprobs, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("gen,impl", [
    ("philox", "xla"), ("threefry", "xla"), ("philox", "pallas"),
    slow_case("threefry", "pallas")])
def test_acceptance_uniforms_follow_the_documented_stream(gen, impl):
  """u_i is vocab index 0 of stream (fold_in(r_b, 1), p + i); one-hot drafts
  accept iff log u_i < log q_t(d_i)."""
  r = np.random.default_rng(10)
  target = logits(10, B, K + 1, V)
  target[:, :K] = target[:, :1]  # the same q_t(d) at every slot
  drafts = np.repeat(r.integers(0, V, (B, 1)), K, axis=1)
  pos = r.integers(0, 1000, B) * (gen == "philox")  # threefry: position 0
  ks = keys(B, 6)
  out = run(target, drafts, np.full(B, K), SamplingParams.make(B), ks,
            positions=pos, gen=gen, impl=impl)
  accept_keys = jax.random.key_data(
      jax.vmap(jax.random.fold_in, (0, None))(ks, 1))
  lt = np.float32([math.log(probs_np(target[b, 0])[drafts[b, 0]])
                   for b in range(B)])
  u = []
  for i in range(K):
    streams, _ = rng.row_streams(accept_keys, jnp.asarray(pos + i, jnp.int32),
                                 B, V)
    u.append(np.asarray(rng.uniform(rng.tile_bits(gen, streams, 0,
                                                   jnp.uint32(0))[0][1])))
  u = np.stack(u, axis=1)
  if gen == "threefry":  # position 0 is jax.random's own uniform
    u0 = [float(jax.random.uniform(jax.random.wrap_key_data(a), (1,),
                                   minval=rng.FP32_TINY, maxval=1.0)[0])
          for a in accept_keys]
    np.testing.assert_array_equal(u[:, 0], u0)
  near = np.abs(np.log(u) - lt[:, None]) < 1e-5
  assert near.sum() <= 1
  want = np.sum(np.cumprod(np.log(u) < lt[:, None], axis=1), axis=1)
  ok = ~near.any(axis=1)
  np.testing.assert_array_equal(out.num_accepted[ok], want[ok])
  assert 0 < want.sum() < K * B


# ---------------------------------------------------------------------------
# Sampling masks: one per slot (return_mask).
# ---------------------------------------------------------------------------

MB, MV = 4, 256  # the mask batch: [MB, K + 1, MV]
MASK_PARAMS = dict(temperature=[0.8, 1.2, 0.0, 1.0], top_k=[5, 0, 3, 0],
                   top_p=[1.0, 0.8, 1.0, 1.0], min_p=[0.05, 0.0, 0.0, 0.0])


@pytest.fixture(scope="module",
                params=[("draft_logits", "xla"), ("one_hot", "xla"),
                        ("synthetic", "xla"),
                        slow_case(("draft_logits", "pallas"))],
                ids=lambda p: "-".join(p))
def masked(request):
  """``rejection_sample(..., return_mask=True)`` on a batch of a top-k +
  min-p, a top-p, a greedy (top-k ignored) and an untruncated request (-inf
  entries): ``(mode, impl, target, params, out, mask)``.  Drafts: the draft
  logits' argmax; in synthetic mode the target's argmin, outside the kept
  sets.  Pallas: draft logits (interpret mode is slow; the masks come from
  the target rows' kept sets whatever the drafts)."""
  mode, impl = request.param
  target = logits(23, MB, K + 1, MV, scale=2.0)
  target[3, :, ::7] = -np.inf
  draft = target[:, :K] + logits(24, MB, K, MV)
  synthetic = mode == "synthetic"
  params = SamplingParams.make(MB, **MASK_PARAMS)
  n = np.array([K, 2, K, 1])
  verify = functools.partial(
      run, target, np.argmin(target[:, :K], axis=-1) if synthetic else
      np.argmax(draft, axis=-1), n, params, keys(MB, 23),
      draft_logits=None if mode == "one_hot" else draft,
      rates=[0.9, 0.6, 0.3] if synthetic else None, impl=impl)
  out, m = verify(return_mask=True)
  if impl == "xla":  # the mask shares its processing (the kernels: unchanged)
    assert_same(out, verify())
  assert 0 < out.num_accepted.sum() < n.sum()  # accepted and rejected drafts
  return mode, impl, target, params, out, m


def test_slot_masks_are_the_target_rows_masks(masked):
  """Slot i of request b: ``extract_sampling_mask(target[:, i])``'s row b
  while emitted (i <= num_accepted[b]), blank after."""
  _, impl, target, params, out, m = masked
  for i in range(K + 1):
    assert_mask_types(slot(m, i), MB, SamplerConfig().max_mask_ids)
    emitted = i <= out.num_accepted
    got, want = (jax.tree.map(lambda a: a[emitted], mi)
                 for mi in (slot(m, i), extract(target[:, i], params)))
    assert_masks_equal(got, want, exact_floats=False)
    if impl == "xla":  # the same processing, in another program: an ulp
      for f in ("logz", "lse"):
        np.testing.assert_allclose(getattr(got, f), getattr(want, f),
                                   rtol=1e-6, atol=1e-6, err_msg=f)
    blank = jax.tree.map(lambda a: a[~emitted], slot(m, i))
    assert np.all(blank.ids == -1) and np.all(blank.count == 0)
    assert blank.truncated.all() and not blank.overflow.any()
    assert np.all(blank.logz == -np.inf) and np.all(blank.lse == -np.inf)
  listing = m.truncated[0] & (m.count[0] > 1)  # top-k + min-p, top-p
  np.testing.assert_array_equal(listing, [True, True, False, False])
  assert m.truncated[0, 2] and m.count[0, 2] == 1  # greedy
  assert not m.truncated[0, 3]
  assert m.count[0, 3] == (target[3, 0] > -np.inf).sum()


def test_emitted_tokens_lie_in_their_slot_masks(masked):
  """Every emitted token lies in its slot's kept set with logprob ``y_t -
  lse - logz`` (0 for greedy rows, ``y = x``); in synthetic mode an accepted
  draft may lie outside it, with logprob -inf."""
  mode, _, target, params, out, m = masked
  temps = np.asarray(params.temperature)
  outside = 0
  for b in range(MB):
    for i in range(out.num_accepted[b] + 1):
      y, token = tempered(target[b, i], temps[b]), out.tokens[b, i]
      if mask_kept(slot(m, i), b, y)[token]:
        np.testing.assert_allclose(rebuilt_logprob(slot(m, i), b, y, token),
                                   out.logprobs[b, i], rtol=1e-5, atol=1e-5,
                                   err_msg=f"request {b} slot {i}")
      else:
        outside += 1
        assert mode == "synthetic" and out.logprobs[b, i] == -np.inf, (b, i)
  assert (outside > 0) == (mode == "synthetic")


def test_to_json_keeps_the_emitted_tokens(masked):
  """``to_json(num_tokens=num_accepted + 1)``: request b's first
  num_accepted[b] + 1 slots; ``ValueError`` for bad ``num_tokens``."""
  _, _, _, _, out, m = masked
  num_tokens = out.num_accepted + 1
  js = m.to_json(num_tokens=num_tokens)
  assert [len(e) for e in js] == num_tokens.tolist()
  every = m.to_json()
  assert all(len(e) == K + 1 for e in every)
  assert js == [e[:n] for e, n in zip(every, num_tokens)]
  assert m.to_lists(num_tokens) == [e[:n] for e, n in zip(m.to_lists(),
                                                          num_tokens)]
  for bad in (num_tokens[:-1], np.full(MB, K + 2), np.full(MB, -1),
              num_tokens.astype(np.float32)):
    with pytest.raises(ValueError, match="num_tokens"):
      m.to_json(num_tokens=bad)
  with pytest.raises(ValueError, match="token axis"):
    slot(m, 0).to_json(num_tokens=num_tokens)
