"""The fused rejection-sampling kernels (``jaxsample._src.pallas.spec``) against
the XLA reference (``jaxsample._src.spec``) on fresh random inputs: edge cases,
truncation (kept sets from the threshold kernels), vocab splits, bf16, FP64 noise, and the Triton lowering of every kernel variant.  On CPU
the kernels run in interpret mode; tokens and counts must match exactly,
logprobs within 1e-5 (``cases.assert_same``); the ``gpu``-marked tests at
the end run them compiled at V = 151936.  A separate file from test_spec.py
so that pytest-xdist's per-file scheduling splits the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import spec
from jaxsample._src.tuning import RaceLaunch, SpecStatsLaunch, Tuning

from helpers.cases import (B, K, V, assert_masks_equal, assert_same,
                           edge_case_batch, keys, logits, run, tempered)
from helpers.oracle import oracle_keep
from helpers.parametrize import slow_case
from helpers.programs import outside_conds, sort_operands

# Triton kernels of ``threshold.kept_sets``: stats, bound; compact, pack
# and select of the candidates and of the top-k and top-p windows; two window
# placements and two pivot searches (no race over the large rows).
TRUNCATION_KERNELS = 15


# ---------------------------------------------------------------------------
# The fused kernels against the reference, on fresh random inputs.
# ---------------------------------------------------------------------------


def both(*args, **kw):
  """Runs the kernels and the reference; asserts parity; returns the former."""
  a = run(*args, impl="pallas", **kw)
  assert_same(a, run(*args, impl="xla", **kw))
  assert a.tokens.dtype == np.int32 and a.logprobs.dtype == np.float32
  return a


@pytest.mark.parametrize("k,gen,with_draft", [
    (K, "philox", True), slow_case(K, "philox", False),
    slow_case(K, "threefry", True), (1, "philox", False)])
def test_kernel_edge_cases_match_the_reference(k, gen, with_draft):
  args, kw = edge_case_batch(30 + k, B, k, V, with_draft=with_draft)
  target, drafts, n = args[:3]
  out = both(*args, gen=gen, **kw)
  np.testing.assert_array_equal(out.num_accepted[:8], k)  # all accepted
  assert np.all(out.num_accepted[8:16] == 0)  # first rejected
  assert np.all(out.tokens[8:16, 0] != drafts[8:16, 0])
  if with_draft:  # zero residual: the plain sample, never the draft
    assert np.all(out.num_accepted[16:24] == 0)
    assert np.all(out.tokens[16:24, 0] != drafts[16:24, 0])
  np.testing.assert_array_equal(out.tokens[24:28, 0], [3, 5, 0, 2])
  assert np.all(out.logprobs[24:28, 0] == -np.inf)
  rest = slice(32, None)
  assert 0 < out.num_accepted[rest].sum() < n[rest].sum()  # not vacuous


@pytest.mark.parametrize("with_draft", [True, slow_case(False)])
def test_kernel_synthetic_mode_matches_the_reference(with_draft):
  """Synthetic acceptance, including rejections of a one-hot draft that is
  its row's only finite logit (zero residual: the draft itself)."""
  args, kw = edge_case_batch(40, B, K, V, with_draft=with_draft)
  target, drafts = args[:2]
  target[40:48, 0] = -np.inf
  target[40:48, 0][np.arange(8), drafts[40:48, 0]] = 1.0
  args[2][40:48] = K
  out = both(*args, rates=[0.5, 0.0, 1.0], **kw)
  assert np.all(out.num_accepted <= 1)
  rejected = np.flatnonzero(out.num_accepted[40:48] == 0) + 40
  assert rejected.size and np.all(out.tokens[rejected, 0] ==
                                  drafts[rejected, 0])
  assert np.all(out.logprobs[rejected, 0] == 0)


@pytest.mark.parametrize("gen,vocab,splits", [
    ("threefry", 1007, 4), slow_case("philox", 4100, 3)])
def test_kernel_vocab_splits_match_the_reference(gen, vocab, splits):
  """Several splits and loop steps per row in both passes (64-element loads;
  philox tiles are 2048 wide, so V = 4100 gives its race three splits)."""
  args, kw = edge_case_batch(50, 34, 2, vocab, with_draft=True)
  both(*args, gen=gen, tuning=Tuning(
      spec_stats=SpecStatsLaunch(block_size=64, num_splits=splits),
      spec_emit=RaceLaunch(block_size=64, num_splits=splits)), **kw)


@pytest.mark.slow
def test_kernel_bf16_matches_the_reference():
  args, kw = edge_case_batch(60, B, K, V, with_draft=True)
  args = (jnp.asarray(args[0], jnp.bfloat16),) + args[1:]
  kw["draft_logits"] = jnp.asarray(kw["draft_logits"], jnp.bfloat16)
  both(*args, **kw)


@pytest.mark.slow
def test_kernel_fp64_noise_matches_the_reference():
  """Both branches, one program: an untruncated batch, then a truncating one."""
  with jax.enable_x64(True):
    args, kw = edge_case_batch(70, B, K, V, with_draft=True)
    both(*args, use_fp64_gumbel=True, **kw)
    args, kw = truncating_batch(85, with_draft=True)
    both(*args, use_fp64_gumbel=True, **kw)


def truncating_batch(seed, *, with_draft):
  """The edge-case batch with per-request filters: top-k, top-p and min-p
  alone, combined and off (greedy rows among them), and tied rows: few-valued
  (ties at the threshold) and flat target and draft rows."""
  args, kw = edge_case_batch(seed, B, K, V, with_draft=with_draft)
  target, drafts, n, params = args[:4]
  r = np.random.default_rng(seed)
  target[34:40] = np.round(target[34:40])
  target[40:44] = 0.5
  if with_draft:
    kw["draft_logits"][34:44] = target[34:44, :K]
  n[34:44] = K
  params = SamplingParams.make(
      B, temperature=params.temperature, top_k=r.choice([0, 1, 3, 12], B),
      top_p=r.choice([1.0, 0.5, 0.9], B), min_p=r.choice([0.0, 0.0, 0.05], B))
  return (target, drafts, n, params, args[4]), kw


@pytest.mark.parametrize("gen,with_draft,max_candidates", [
    ("philox", True, 1024), slow_case("threefry", False, 1024),
    slow_case("philox", True, 16)])
def test_kernel_truncating_batches_match_the_reference(gen, with_draft,
                                                       max_candidates):
  """Kept sets from the threshold kernels (``kept_floors``); with 16
  candidates, rows keeping more than 8 ids take ``sample_large``'s searches."""
  args, kw = truncating_batch(80, with_draft=with_draft)
  out = both(*args, gen=gen, max_candidates=max_candidates, **kw)
  truncating = np.asarray(args[3].canonical(V).truncates() &
                          (args[3].temperature > 0))
  rest = truncating.copy()
  rest[:34] = False
  assert 0 < out.num_accepted[rest].sum() < args[2][rest].sum()


# name: (logits dtype, draft logits?, config keywords), for every kernel
# variant.
LOWERING_VARIANTS = {
    "philox-f32-draft": (jnp.float32, True, dict(rng="philox")),
    "threefry-bf16": (jnp.bfloat16, False, dict(rng="threefry")),
    "philox-f32": (jnp.float32, False, dict(rng="philox")),
    "threefry-bf16-draft": (jnp.bfloat16, True, dict(rng="threefry")),
    "fp64-noise-draft": (jnp.float64, True, dict(use_fp64_gumbel=True)),
}


@pytest.mark.slow  # the GPU run compiles these kernels (docs/testing.md, "Tiers")
@pytest.mark.parametrize("name", list(LOWERING_VARIANTS))
def test_kernels_lower_to_triton(monkeypatch, name):
  """Every kernel variant lowers to Triton IR for an abstract H100 (no GPU
  needed; the PTX compile and the run are the GPU suite's): traced params
  lower both branches, without floors (one-hot drafts: the Gumbel kernel;
  draft logits: passes 1 and 2) and after the threshold kernels of the
  target rows and the draft rows (``TRUNCATION_KERNELS`` each:
  ``threshold.kept_sets``) with floors (as many more); no sort.  (The FP64
  variant: fp32 logits with FP64 noise under ``jax.enable_x64``.)"""
  dtype, with_draft, config = LOWERING_VARIANTS[name]
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                                       num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  S = jax.ShapeDtypeStruct
  batch, k, vocab = 4, 3, 151936
  fp64 = dtype == jnp.float64
  dtype = jnp.float32 if fp64 else dtype

  def fn(target, drafts, n, temperature, key, draft):
    params = SamplingParams(temperature, n, temperature, temperature)
    return spec.rejection_sample(
        target, drafts, n, params, key, draft_logits=draft,
        positions=jnp.zeros((batch,), jnp.int32),
        config=SamplerConfig(implementation="pallas", **config))

  args = (S((batch, k + 1, vocab), dtype), S((batch, k), jnp.int32),
          S((batch,), jnp.int32), S((batch,), jnp.float32),
          S((batch, 2), jnp.uint32),
          S((batch, k, vocab), dtype) if with_draft else None)
  with jax.sharding.use_abstract_mesh(mesh), jax.enable_x64(fp64):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert sort_operands(text) == []
  assert text.count("__gpu$xla.gpu.triton") == (
      (1 + with_draft) * (2 + TRUNCATION_KERNELS))


@pytest.mark.parametrize("return_mask", [False, True])
@pytest.mark.parametrize("with_draft", [False, True])
def test_host_round_trips(with_draft, return_mask):
  """Verification with filters sends no predicate to the host where the
  caller's ``jit`` closes over the params (the kept sets of the target and
  draft rows hold no cond), and one with traced params: the cond on the
  batch (does a sampled request truncate?), nothing nested.  With masks,
  the large-set routes of the target and draft rows' kept sets
  (thresholds, counts and ordered ids) run behind one cond (its branch
  holds the mask listing's fallback): one predicate more per call."""
  target = logits(7, B, K + 1, V)
  draft = logits(8, B, K, V) if with_draft else None
  drafts = np.zeros((B, K), np.int32)
  n = np.full((B,), K, np.int32)
  params = SamplingParams.make(B, temperature=1.0, top_p=0.9)
  config = SamplerConfig(implementation="pallas")
  verify = lambda target, draft, params: spec.rejection_sample(
      target, drafts, n, params, jax.random.key(0), draft_logits=draft,
      config=config, return_mask=return_mask)
  closed = outside_conds(jax.make_jaxpr(
      lambda target, draft: verify(target, draft, params))(target,
                                                          draft).jaxpr)
  traced = outside_conds(jax.make_jaxpr(verify)(target, draft, params).jaxpr)
  if return_mask:
    assert (closed["cond"], closed["nested"]) == (1, 1)
    assert (traced["cond"], traced["nested"]) == (1, 2)
    return
  assert (closed["cond"], closed["nested"]) == (0, 0)
  for kernel in ("jaxsample_row_stats", "jaxsample_threshold_window",
                 "jaxsample_pivot_threshold",
                 *(("jaxsample_spec_stats", "jaxsample_spec_emit") if with_draft
                   else ("jaxsample_gumbel_max",))):
    assert closed.get(kernel), kernel
  assert (traced["cond"], traced["nested"]) == (1, 0)


# ---------------------------------------------------------------------------
# On a GPU (``gpu``-marked), at the production vocabulary (V = 151936): both
# passes lower, compile, run and match the XLA reference (tokens and
# ``num_accepted`` identical, logprobs within 1e-5) for untruncated batches
# and for batches whose kept sets come from the threshold kernels.
# ---------------------------------------------------------------------------


VOCAB = 151936


def cast(args, kw, dtype):
  args = (jnp.asarray(args[0], dtype),) + tuple(args[1:])
  if kw.get("draft_logits") is not None:
    kw = dict(kw, draft_logits=jnp.asarray(kw["draft_logits"], dtype))
  return args, kw


def random_case(seed, batch, k, *, with_draft, scale=2.0):
  """Random requests: drafts close to the target (acceptance varies), a few
  greedy rows, random num_draft and positions."""
  r = np.random.default_rng(seed)
  target = logits(seed, batch, k + 1, VOCAB, scale=scale)
  draft = target[:, :k] + 0.3 * logits(seed + 1, batch, k, VOCAB)
  drafts = np.argmax(draft, -1)
  params = SamplingParams.make(
      batch, temperature=r.choice([0.0, 0.7, 1.0], batch) if batch > 1 else 1.0)
  args = (target, drafts, r.integers(0, k + 1, batch), params,
          keys(batch, seed))
  return args, dict(draft_logits=draft if with_draft else None,
                    positions=r.integers(0, 2**31, batch))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,with_draft,gen", [
    (jnp.float32, True, "philox"), (jnp.float32, False, "philox"),
    (jnp.bfloat16, True, "philox"), (jnp.bfloat16, False, "philox"),
    (jnp.float32, True, "threefry")],
    ids=["f32-draft", "f32-one_hot", "bf16-draft", "bf16-one_hot",
         "f32-draft-threefry"])
def test_edge_cases_match_reference(dtype, with_draft, gen):
  """All accepted, first rejected, zero residual, invalid target / draft
  rows, -inf entries, greedy rows (``cases.edge_case_batch``)."""
  args, kw = cast(*edge_case_batch(90, 40, 3, VOCAB, with_draft=with_draft),
                  dtype)
  out = both(*args, gen=gen, **kw)
  np.testing.assert_array_equal(out.num_accepted[:8], 3)
  assert np.all(out.num_accepted[8:16] == 0)
  np.testing.assert_array_equal(out.tokens[24:28, 0], [3, 5, 0, 2])


@pytest.mark.gpu
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "one_hot"])
@pytest.mark.parametrize("batch,k,dtype", [
    (1, 4, jnp.float32), (32, 1, jnp.float32), (8, 8, jnp.float32),
    (128, 4, jnp.float32), (128, 4, jnp.bfloat16)],
    ids=["1x4", "32x1", "8x8", "128x4", "128x4-bf16"])
def test_random_requests_match_reference(batch, k, dtype, with_draft):
  args, kw = cast(*random_case(batch * 10 + k, batch, k,
                               with_draft=with_draft), dtype)
  if batch == 1:  # the single request drafts all k tokens (n = 0: edge cases)
    args = args[:2] + (np.array([k]),) + args[3:]
  out = both(*args, **kw)
  assert np.all((out.tokens >= -1) & (out.tokens < VOCAB))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,with_draft", [
    (jnp.float32, True), (jnp.float32, False), (jnp.bfloat16, True)],
    ids=["f32-draft", "f32-one_hot", "bf16-draft"])
def test_truncating_requests_match_reference(dtype, with_draft):
  """Per-request top-k / top-p / min-p (alone, combined, off; greedy rows
  among them) on random rows, rows of a few values (ties at the thresholds)
  and flat rows (ties wider than any candidate buffer)."""
  batch, k = 64, 3
  args, kw = random_case(21, batch, k, with_draft=with_draft)
  target, drafts, n, params, key = args
  target[:6] = np.round(target[:6])
  target[6:8] = 0.5
  if with_draft:
    kw["draft_logits"][:8] = target[:8, :k]
  r = np.random.default_rng(21)
  params = SamplingParams.make(
      batch, temperature=np.where(np.arange(batch) < 8, 1.0,
                                  params.temperature),
      top_k=r.choice([0, 1, 50, 20000], batch),
      top_p=r.choice([1.0, 0.5, 0.9], batch),
      min_p=r.choice([0.0, 0.0, 0.05], batch))
  args, kw = cast((target, drafts, n, params, key), kw, dtype)
  out = both(*args, **kw)
  assert 0 < out.num_accepted.sum() < n.sum()


@pytest.mark.gpu
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "one_hot"])
def test_slot_masks_match_reference(with_draft):
  """``return_mask=True`` on the device: the result equals the reference's,
  and so does each slot's mask (top-k, top-k + min-p, top-p, greedy and
  untruncated requests; K_cap 64 overflows on the top-p rows): ids, counts
  and flags exactly, logz and lse within 1e-5, except on top-p rows whose
  crossing lies within fp32 rounding of ``p`` (kept sets of ~20000-60000
  ids): there the kernel's count must be one of the oracle's admissible
  sets (the 64 listed ids still equal)."""
  batch, k = 16, 3
  args, kw = random_case(31, batch, k, with_draft=with_draft)
  target, drafts, n, _, key = args
  filters = dict(top_k=np.tile([50, 20, 10, 0, 0, 0, 5, 0], 2),
                 top_p=np.tile([1.0, 1.0, 1.0, 0.9, 0.95, 1.0, 1.0, 1.0], 2),
                 min_p=np.tile([0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 2))
  temps = np.tile([0.7, 1.0, 0.0, 1.3], 4)
  params = SamplingParams.make(batch, temperature=temps, **filters)
  a, a_mask = run(target, drafts, n, params, key, impl="pallas",
                  return_mask=True, max_mask_ids=64, **kw)
  b, b_mask = run(target, drafts, n, params, key, impl="xla",
                  return_mask=True, max_mask_ids=64, **kw)
  assert_same(a, b)
  emitted = np.arange(k + 1)[:, None] <= a.num_accepted
  near = a_mask.count != b_mask.count
  for i, r in np.argwhere(near):
    y = np.sort(tempered(target[r, i], temps[r]))[::-1]
    o = oracle_keep(y, *(f[r] for f in filters.values()))
    assert o.near_boundary and o.admits(y >= y[a_mask.count[i, r] - 1]), (i, r)
  assert near.sum() <= 4
  assert_masks_equal(*(jax.tree.map(lambda f: f[~near], m)
                       for m in (a_mask, b_mask)), exact_floats=False)
  np.testing.assert_array_equal(a_mask.ids, b_mask.ids)
  assert a_mask.overflow[emitted].any() and (~a_mask.truncated).any()
  assert (a_mask.count[~emitted] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "one_hot"])
def test_synthetic_mode_matches_reference(with_draft):
  args, kw = random_case(7, 64, 3, with_draft=with_draft)
  out = both(*args, rates=[0.7, 0.5, 0.9], **kw)
  assert len(set(out.num_accepted.tolist())) > 2


@pytest.mark.gpu
def test_fp64_noise_matches_reference():
  args, kw = edge_case_batch(91, 40, 3, VOCAB, with_draft=True)
  with jax.enable_x64(True):
    both(*args, use_fp64_gumbel=True, **kw)


@pytest.mark.gpu
def test_plan_overrides_match_reference():
  """Other launch plans (splits, pass-1 block, warps) give the same result."""
  args, kw = random_case(8, 16, 2, with_draft=True)
  want = run(*args, impl="xla", **kw)
  for plan in (dict(num_splits=1), dict(num_splits=7, block_size=1024),
               dict(num_warps=8, block_size=8192)):
    tuning = Tuning(spec_stats=SpecStatsLaunch(**plan),
                    spec_emit=RaceLaunch(**plan))
    assert_same(run(*args, impl="pallas", tuning=tuning, **kw), want)


@pytest.mark.gpu
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "one_hot"])
def test_passes_are_triton_kernels(with_draft):
  """Draft logits: passes 1 and 2; one-hot drafts: the Gumbel kernel alone."""
  batch, k = 4, 3
  target = jnp.zeros((batch, k + 1, VOCAB), jnp.bfloat16)
  draft = jnp.zeros((batch, k, VOCAB), jnp.bfloat16) if with_draft else None
  params = SamplingParams.make(batch)
  fn = jax.jit(lambda t, d: spec.rejection_sample(
      t, jnp.zeros((batch, k), jnp.int32), jnp.full((batch,), k, jnp.int32),
      params, keys(batch), positions=jnp.zeros((batch,), jnp.int32),
      draft_logits=d, config=SamplerConfig(implementation="auto")))
  text = fn.lower(target, draft).as_text()
  # Params closed over without filters: the untruncated passes alone.
  assert text.count("__gpu$xla.gpu.triton") == (2 if with_draft else 1)
  assert sort_operands(text) == []
