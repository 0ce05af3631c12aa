"""Vocab-parallel sampling (``jaxsample._src.parallel.vocab``): logits split
along the vocabulary on 4 CPU devices (conftest sets ``jax_num_cpu_devices``)
and, ``gpu``-marked at the end, on 2 GPUs at V = 151936 (the kernels, which
interpret mode cannot lower inside ``shard_map`` with ``check_vma=True``).

Every sharded call is compared with the single-device jitted call on the same
inputs and keys: tokens, logprobs, validity and masks bit for bit (the
kernels' logprobs within 1e-5 where the one-device splits differ).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsample
from jaxsample import sharded
from jaxsample._src import reference, spec
from jaxsample._src.parallel.vocab import search_split
from jaxsample._src.tuning import RaceLaunch, Tuning

from helpers.sharding import (VOCAB_SPLIT, assert_same_leaves, require_two_gpus,
                              sample_vocab_parallel, truncating_params,
                              vocab_parallel)


def test_jit_takes_the_vocab_parallel_path_for_vocab_sharded_logits():
  """Logits split along the vocabulary on a 2x2 Explicit mesh, under plain
  jax.jit: sample (one key, masks), extract_sampling_mask and
  rejection_sample (per-request keys, draft logits, masks) equal one
  device bit for bit (xla_search); processors and a vocabulary split over
  two axes are refused by name."""
  x, batches = _mask_inputs()
  params = batches[0]
  config = jaxsample.SamplerConfig(implementation="xla_search",
                                   max_mask_ids=16)
  key = jax.random.key(6)
  target = jnp.stack([x, x[::-1] * 0.5], axis=1)  # [8, k + 1 = 2, 1024]
  draft = jnp.argmax(x, axis=-1)[:, None]
  num, keys = jnp.arange(8) % 2, jax.random.split(key, 8)
  positions = jnp.arange(8) * 3

  def calls(x, target, draft_logits, params, keys):
    return (jaxsample.sample(x, params, key, config=config, return_mask=True),
            jaxsample.extract_sampling_mask(x, params, config=config),
            spec.rejection_sample(target, draft, num, params, keys,
                                  draft_logits=draft_logits,
                                  positions=positions, config=config,
                                  return_mask=True))

  args = (x, target, target[:, :1] * 0.9, params, keys)
  want = jax.jit(calls)(*args)
  mesh = jax.make_mesh((2, 2), ("b", "v"))
  with jax.set_mesh(mesh):
    specs = (P("b", "v"), P("b", None, "v"), P("b", None, "v"), P("b"),
             P("b"))
    got = jax.jit(calls)(*jax.device_put(args, specs))
    assert_same_leaves(want, got)
    banned = jaxsample.LogitsProcessors.make(8, banned_token_ids=[[1]] * 8)
    with pytest.raises(ValueError, match="processors"):
      jax.jit(lambda x: jaxsample.sample(x, params, key, config=config,
                                         processors=banned))(
          jax.device_put(x, P("b", "v")))
    with pytest.raises(ValueError, match="split it over one axis"):
      jax.jit(lambda x: jaxsample.sample(x, params, key, config=config))(
          jax.device_put(x, P(None, ("b", "v"))))


def test_exact_sum_is_order_independent():
  """``reference.exact_sum``: the same bits for any grouping of the terms
  (rows of any batch, split sums added as integers), and within an fp32 ulp
  of the float64 sum."""
  e = jnp.exp(-jnp.abs(jax.random.normal(jax.random.key(3), (16, 5000)) * 4))
  whole = reference.exact_sum(e)
  np.testing.assert_array_equal(whole[3:5], reference.exact_sum(e[3:5]))
  parts = sum(reference.fixed_point_limbs(e[:, i:i + 1250])
              for i in range(0, 5000, 1250))
  np.testing.assert_array_equal(whole, reference.limbs_to_float(parts))
  exact = np.asarray(e, np.float64).sum(-1)
  np.testing.assert_allclose(whole, exact, rtol=2 ** -23)


VOCAB_CASES = [  # impl, generator, fp64, (batch, vocab) mesh, per-request keys
    ("xla", "philox", False, (2, 2), False),
    ("xla", "threefry", False, (4, 1), True),
    ("pallas", "threefry", False, (1, 4), True),
]
# FP64 noise: test_vocab_parallel_truncation_equals_one_device; the kernels
# at V = 155648 (fp32, bf16): the ``gpu``-marked tests at the end.


def _vocab_inputs(batch=8, vocab=8192):
  x = jax.random.normal(jax.random.key(5), (batch, vocab)) * 3
  # -inf prefix, NaN (invalid), all -inf (invalid), ties at the max.
  x = x.at[1, :100].set(-jnp.inf).at[5, 7].set(jnp.nan).at[6].set(-jnp.inf)
  x = x.at[2, 3].set(20.0).at[2, vocab - 100].set(20.0)
  params = jaxsample.SamplingParams.make(
      batch, temperature=[1.0, 0.7, 0.0, 1.3] * (batch // 4))
  return x, params


@pytest.mark.parametrize("impl,generator,fp64,shape,per_request", VOCAB_CASES)
def test_vocab_parallel_equals_one_device(impl, generator, fp64, shape,
                                          per_request):
  """sample_sharded(return_mask=True) on (batch x vocab) meshes: tokens,
  logprobs, validity and masks bit-identical to one device's sample
  (kernel splits aligned with shards)."""
  x, params = _vocab_inputs(vocab=8192 if impl == "pallas" else 1024)
  config = jaxsample.SamplerConfig(
      implementation=impl, rng=generator, use_fp64_gumbel=fp64,
      max_mask_ids=16,
      tuning=Tuning(gumbel=RaceLaunch(num_splits=8)) if impl == "pallas"
      else None)
  key = jax.random.key(3)
  key = jax.random.split(key, x.shape[0]) if per_request else key
  positions = jnp.arange(x.shape[0]) * 7 if per_request else None
  key_spec = P("b") if per_request else P()
  with jax.enable_x64(fp64):
    want = jax.jit(lambda x, p, k, n: jaxsample.sample(
        x, p, k, positions=n, config=config, return_mask=True))(
            x, params, key, positions)
    # Interpret mode cannot lower under check_vma (JAX 0.11.2); without
    # it one batch key would count local rows: per-request keys.
    got = vocab_parallel(
        lambda x, p, k, n: sharded.sample_sharded(
            x, p, k, axis_name="v", positions=n, config=config,
            return_mask=True), shape,
        specs=(VOCAB_SPLIT, P("b"), key_spec, P("b") if per_request else None),
        check_vma=impl != "pallas")(x, params, key, positions)
  assert_same_leaves(want, got)
  assert not np.asarray(got[0].valid)[[5, 6]].any()


def test_vocab_parallel_traced_truncation_gathers_exactly():
  """Traced params with a truncating row: the gathered fallback equals one
  device, top-k / top-p / min-p included."""
  x, _ = _vocab_inputs(vocab=512)
  params = truncating_params(8)
  key = jax.random.key(4)
  config = jaxsample.SamplerConfig(implementation="xla")
  want = jax.jit(lambda x, p: jaxsample.sample(x, p, key, config=config))(
      x, params)
  assert_same_leaves(want, sample_vocab_parallel(key, config, (1, 4))(x, params))


def test_vocab_parallel_kernels_reject_unaligned_shards():
  mesh = jax.make_mesh((1, 4), ("b", "v"), axis_types=(AxisType.Auto,) * 2)
  x = jnp.zeros((4, 4 * 300))
  run = lambda params, impl: jax.shard_map(
      lambda x: sharded.sample_sharded(
          x, params, jax.random.key(0), axis_name="v",
          config=jaxsample.SamplerConfig(implementation=impl)),
      mesh=mesh, in_specs=P(None, "v"), out_specs=P(), check_vma=False)(x)
  with pytest.raises(ValueError, match="multiple of 8192"):
    run(jaxsample.SamplingParams.make(4), "pallas")



def test_split_candidates_are_the_rows_top_k():
  """``Split.top`` over 4 vocab shards (the collectives under ``jax.vmap``'s
  axis name: no devices) is ``lax.top_k`` of the whole rows, ties in id
  order, for a width below the vocabulary and one equal to it (the joined
  shards sorted again, not left shard by shard)."""
  x = jnp.round(jax.random.normal(jax.random.key(2), (3, 64)) * 2)  # ties
  shards = jnp.moveaxis(x.reshape(3, 4, 16), 1, 0)
  for width in (8, 64):
    top = jax.vmap(lambda s, w=width: search_split(
        "v", 64, jax.lax.axis_index("v") * 16).top(s, w), axis_name="v")
    assert_same_leaves(jax.lax.top_k(x, width), jax.tree.map(lambda a: a[0],
                                                       top(shards)))


def test_split_take_moves_values_of_any_width():
  """``Split.take`` over 4 vocab shards (``jax.vmap``'s axis name) returns
  each row's value at a global id bit for bit on every shard, for 16-bit
  logits too (bf16 logits' tokens on the vocab-parallel search: gathered
  widened to 32-bit words)."""
  x = np.random.default_rng(7).normal(size=(3, 64)) * 3
  ids = np.array([0, 37, 63])
  take = jax.jit(jax.vmap(lambda s: search_split(
      "v", 64, jax.lax.axis_index("v") * 16).take(s, ids), axis_name="v"))
  for dtype in (jnp.bfloat16, jnp.float32):
    values = jnp.asarray(x, dtype)
    got = take(jnp.moveaxis(values.reshape(3, 4, 16), 1, 0))
    assert got.dtype == dtype
    assert_same_leaves(np.broadcast_to(values[np.arange(3), ids], got.shape), got)

SEARCH_CASES = [  # generator, fp64, (batch, vocab) mesh, vocab, per-request keys
    ("philox", False, (2, 2), 2048, False),
    ("threefry", True, (1, 4), 1024, True),  # 256 per shard < 1024 candidates
]


@pytest.mark.parametrize("generator,fp64,shape,vocab,per_request",
                         SEARCH_CASES)
def test_vocab_parallel_truncation_equals_one_device(generator, fp64, shape,
                                                     vocab, per_request):
  """Truncating rows on the sort-free search: per-shard candidates, counts
  and digit sums combined by collectives (count and mass searches, the
  whole-row race) equal one device's sample bit for bit."""
  x, _ = _vocab_inputs(vocab=vocab)
  x = x.at[7].set(jnp.linspace(0.0, 0.01, vocab))  # flat: large kept sets
  params = jaxsample.SamplingParams.make(
      8, temperature=[1.0, 0.7, 0.0, 1.3, 1.0, 1.0, 1.0, 0.9],
      top_k=[0, 5, 0, 1500, 0, 50, 0, 0],  # 1500 > 1024: a count search
      top_p=[1.0, 0.9, 1.0, 0.8, 0.995, 1.0, 1.0, 0.5],
      min_p=[0.05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.01, 0.0])
  config = jaxsample.SamplerConfig(implementation="xla_search", rng=generator,
                                   use_fp64_gumbel=fp64)
  key = jax.random.key(6)
  key = jax.random.split(key, 8) if per_request else key
  positions = jnp.arange(8) * 3 if per_request else None
  key_spec = P("b") if per_request else P()
  with jax.enable_x64(fp64):
    want = jax.jit(lambda x, p, k, n: jaxsample.sample(
        x, p, k, positions=n, config=config))(x, params, key, positions)
    got = vocab_parallel(
        lambda x, p, k, n: sharded.sample_sharded(
            x, p, k, axis_name="v", positions=n, config=config), shape,
        specs=(VOCAB_SPLIT, P("b"), key_spec,
               P("b") if per_request else None))(x, params, key, positions)
  assert_same_leaves(want, got)
  assert np.asarray(got.valid).tolist() == [True] * 5 + [False] * 2 + [True]


def test_vocab_parallel_masks_equal_one_device():
  """extract_sampling_mask_sharded on a 2x2 mesh: ids, counts, logz and lse
  bit-identical to one device's extract_sampling_mask (xla_search)."""
  x, _ = _vocab_inputs(vocab=1024)
  params = truncating_params(8)
  config = jaxsample.SamplerConfig(implementation="xla_search",
                                   max_mask_ids=16)
  want = jax.jit(lambda x, p: jaxsample.extract_sampling_mask(
      x, p, config=config))(x, params)
  got = vocab_parallel(lambda x, p: sharded.extract_sampling_mask_sharded(
      x, p, axis_name="v", config=config), (2, 2))(x, params)
  assert_same_leaves(want, got)
  assert np.asarray(got.truncated).any() and np.asarray(got.count).max() > 1
  with pytest.raises(ValueError, match="xla_search"):
    sharded.extract_sampling_mask_sharded(x, params, axis_name="v",
                                          config="xla")


def _mask_inputs():
  """Logits of every row kind (1024 wide: 256 per shard of 4) and two
  batches of params: one with truncating rows (the search's collectives),
  one without (the race's)."""
  x, _ = _vocab_inputs(vocab=1024)
  x = x.at[7].set(jnp.linspace(0.0, 0.01, 1024))  # flat: a large kept set
  truncating = jaxsample.SamplingParams.make(
      8, temperature=[1.0, 0.7, 0.0, 1.3, 1.0, 1.0, 1.0, 0.9],
      top_k=[0, 5, 0, 0, 0, 50, 0, 0],
      top_p=[1.0, 0.9, 1.0, 0.8, 0.995, 1.0, 1.0, 0.5],
      min_p=[0.05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.01, 0.0])
  return x, (truncating, jaxsample.SamplingParams.make(
      8, temperature=[1.0, 0.7, 0.0, 1.3] * 2))


def test_vocab_parallel_sample_masks_equal_one_device():
  """sample_sharded(return_mask=True) on a 2x2 mesh, traced params: the
  truncating batch (search) and the untruncated one (race) run one
  compiled program; tokens, logprobs, validity and masks (ids, count,
  logz, lse) bit-identical to one device's sample(return_mask=True)."""
  x, batches = _mask_inputs()
  config = jaxsample.SamplerConfig(implementation="xla_search",
                                   max_mask_ids=16)
  key = jax.random.key(6)
  one = jax.jit(lambda x, p: jaxsample.sample(x, p, key, config=config,
                                              return_mask=True))
  body = sample_vocab_parallel(key, config, (2, 2), return_mask=True)
  for params in batches:
    want = one(x, params)
    assert_same_leaves(want, body(x, params))
  truncated = np.asarray(want[1].truncated)  # the untruncated batch's
  assert truncated.tolist() == [False, False, True, False] + [False, True,
                                                             True, False]
  # The kernels' truncating batches take this search too (4 vocab shards;
  # params closed over: no kernel compiles).
  pallas = dataclasses.replace(config, implementation="pallas")
  mesh = jax.make_mesh((4,), ("v",), axis_types=(AxisType.Auto,))
  got = jax.jit(jax.shard_map(
      lambda x: sharded.sample_sharded(x, batches[0], key, axis_name="v",
                                       config=pallas, return_mask=True),
      mesh=mesh, in_specs=P(None, "v"), out_specs=P()))(
          jax.device_put(x, NamedSharding(mesh, P(None, "v"))))
  assert_same_leaves(one(x, batches[0]), got)


def test_vocab_parallel_rejection_sample_equals_one_device():
  """rejection_sample_sharded on a 1x4 mesh (per-request keys, threefry,
  masks): greedy and sampled rows, draft-logit drafts and one-hot drafts
  (an invalid draft row), rejections with residual draws, bonus tokens and
  an invalid target row, bit-identical to one device's rejection_sample."""
  batch, k, vocab = 8, 2, 256
  ks = jax.random.split(jax.random.key(11), 3)
  target = jax.random.normal(ks[0], (batch, k + 1, vocab)) * 2
  draft_logits = target[:, :k] + jax.random.normal(ks[1], (batch, k, vocab))
  target = target.at[4, 0].set(jnp.nan)  # an invalid target row
  draft_logits = draft_logits.at[5, 0].set(-jnp.inf)  # one-hot draft slot
  draft = jnp.argmax(draft_logits, axis=-1).at[0, 0].set(3)
  num = jnp.array([2, 2, 1, 0, 2, 2, 2, 1])
  params = jaxsample.SamplingParams.make(
      batch, temperature=[1.0, 0.7, 0.0, 1.3] * 2,
      top_k=[0, 5, 0, 0, 0, 0, 20, 0], top_p=[1.0, 0.9] + [1.0] * 6,
      min_p=[0.0] * 3 + [0.05] + [0.0] * 4)
  config = jaxsample.SamplerConfig(implementation="xla_search", rng="threefry",
                                   max_mask_ids=8)
  keys = jax.random.split(jax.random.key(6), batch)
  positions = jnp.arange(batch) * 5
  args = (target, draft, num, draft_logits, params, keys, positions)
  want = jax.jit(lambda t, d, n, dl, p, key, pos: spec.rejection_sample(
      t, d, n, p, key, draft_logits=dl, positions=pos, config=config,
      return_mask=True))(*args)
  vocab_split = P("b", None, "v")
  got = vocab_parallel(
      lambda t, d, n, dl, p, key, pos: sharded.rejection_sample_sharded(
          t, d, n, p, key, axis_name="v", draft_logits=dl, positions=pos,
          config=config, return_mask=True), (1, 4),
      specs=(vocab_split, P("b"), P("b"), vocab_split, P("b"), P("b"),
             P("b")), out_specs=(P("b"), P(None, "b")))(*args)
  assert_same_leaves(want, got)
  accepted = np.asarray(want[0].num_accepted)
  # Residual draws (sampled rows 1, 5, 7), bonus tokens (0: after 2
  # accepted, 2: greedy, 3: no drafts), the invalid row's stop.
  assert accepted.tolist() == [2, 0, 1, 0, 0, 0, 0, 0]
  assert np.asarray(want[0].logprobs)[4, 0] == -np.inf


# ---------------------------------------------------------------------------
# On 2 GPUs (``gpu``-marked; each skips with fewer): the kernels at V = 151936
# (155648 where the tiles must split evenly).
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vocab_parallel_kernels_equal_one_gpu(dtype):
  require_two_gpus()
  batch, vocab = 128, 155648  # 151936 padded to 2 x 38 philox tiles
  x = (jax.random.normal(jax.random.key(0), (batch, vocab)) * 3).astype(dtype)
  params = jaxsample.SamplingParams.make(
      batch, temperature=[1.0, 0.7, 0.0, 1.3] * (batch // 4))
  key = jax.random.key(1)
  config = jaxsample.SamplerConfig(implementation="pallas")
  want = jax.jit(lambda x, p: jaxsample.sample(x, p, key, config=config))(
      x, params)
  got = sample_vocab_parallel(key, config)(x, params)
  np.testing.assert_array_equal(want.tokens, got.tokens)
  np.testing.assert_array_equal(want.valid, got.valid)
  # Bit for bit where the one-GPU splits fall on the shard boundary.
  np.testing.assert_allclose(want.logprobs, got.logprobs, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_vocab_parallel_search_truncation_equals_one_gpu():
  """Truncating rows on the sort-free XLA search, vocab split over 2 GPUs
  (collectives of counts, digit sums and candidates): bit-identical."""
  require_two_gpus()
  batch, vocab = 64, 151936
  x = jax.random.normal(jax.random.key(4), (batch, vocab)) * 3
  params = jaxsample.SamplingParams.make(
      batch, temperature=[1.0, 0.7, 0.0, 1.3] * (batch // 4),
      top_k=[0, 50, 0, 2000] * (batch // 4),
      top_p=[0.95, 0.9, 1.0, 0.8] * (batch // 4),
      min_p=[0.0, 0.0, 0.0, 0.05] * (batch // 4))
  key = jax.random.key(5)
  config = jaxsample.SamplerConfig(implementation="xla_search")
  want = jax.jit(lambda x, p: jaxsample.sample(x, p, key, config=config))(
      x, params)
  got = sample_vocab_parallel(key, config)(x, params)
  assert_same_leaves(want, got)


@pytest.mark.gpu
def test_vocab_parallel_kernel_masks_equal_one_gpu():
  """sample_sharded(return_mask=True) with the kernels on 2 GPUs: an
  untruncated batch (the Gumbel kernel per shard, finite entries counted)
  against one GPU's kernel path, and a truncating batch (the sort-free
  search split over the shards) against one GPU's xla_search."""
  require_two_gpus()
  batch, vocab = 64, 155648
  x = jax.random.normal(jax.random.key(8), (batch, vocab)) * 3
  x = x.at[1, :1000].set(-jnp.inf)
  plain = jaxsample.SamplingParams.make(
      batch, temperature=[1.0, 0.7, 0.0, 1.3] * (batch // 4))
  truncating = jaxsample.SamplingParams.make(
      batch, temperature=[1.0, 0.7, 0.0, 1.3] * (batch // 4),
      top_k=[0, 50, 0, 2000] * (batch // 4),
      top_p=[0.95, 0.9, 1.0, 0.8] * (batch // 4))
  key = jax.random.key(9)
  config = jaxsample.SamplerConfig(implementation="pallas", max_mask_ids=64)
  search = jaxsample.SamplerConfig(implementation="xla_search",
                                   max_mask_ids=64)
  one = jax.jit(lambda x, p, c: jaxsample.sample(x, p, key, config=c,
                                                 return_mask=True),
                static_argnums=2)
  body = sample_vocab_parallel(key, config, return_mask=True)
  got_plain, got_trunc = body(x, plain), body(x, truncating)
  want = one(x, plain, config)
  for name in ("tokens", "valid"):
    np.testing.assert_array_equal(getattr(want[0], name),
                                  getattr(got_plain[0], name))
  for name in ("ids", "count", "truncated", "overflow"):
    np.testing.assert_array_equal(getattr(want[1], name),
                                  getattr(got_plain[1], name))
  np.testing.assert_allclose(want[0].logprobs, got_plain[0].logprobs,
                             rtol=0, atol=1e-5)
  np.testing.assert_allclose(want[1].lse, got_plain[1].lse, rtol=0,
                             atol=1e-5)
  assert_same_leaves(one(x, truncating, search), got_trunc)


@pytest.mark.gpu
def test_vocab_parallel_rejection_sample_equals_one_gpu():
  """rejection_sample_sharded on 2 GPUs (draft logits, truncating rows,
  masks) against one GPU's rejection_sample on xla_search: bit-identical."""
  require_two_gpus()
  batch, k, vocab = 32, 3, 151936
  ks = jax.random.split(jax.random.key(10), 3)
  target = jax.random.normal(ks[0], (batch, k + 1, vocab)) * 3
  draft_logits = target[:, :k] + jax.random.normal(ks[1], (batch, k, vocab))
  draft = jnp.argmax(draft_logits, axis=-1)
  num = jnp.arange(batch) % (k + 1)
  params = jaxsample.SamplingParams.make(
      batch, temperature=[1.0, 0.7, 0.0, 1.3] * (batch // 4),
      top_k=[0, 50, 0, 0] * (batch // 4),
      top_p=[1.0, 0.9, 1.0, 0.8] * (batch // 4))
  key = jax.random.key(11)
  config = jaxsample.SamplerConfig(implementation="xla_search",
                                   max_mask_ids=32)
  args = (target, draft, num, draft_logits, params)
  want = jax.jit(lambda t, d, n, dl, p: jaxsample.rejection_sample(
      t, d, n, p, key, draft_logits=dl, config=config,
      return_mask=True))(*args)
  split = P("b", None, "v")
  got = vocab_parallel(
      lambda t, d, n, dl, p: sharded.rejection_sample_sharded(
          t, d, n, p, key, axis_name="v", draft_logits=dl,
          config=dataclasses.replace(config, implementation="pallas"),
          return_mask=True),
      specs=(split, P("b"), P("b"), split, P("b")),
      out_specs=(P("b"), P(None, "b")))(*args)
  assert_same_leaves(want, got)
