"""Multi-device sampling with the kernels on GPUs (kind nvidia-h100-x2).

The CPU tests run the kernels in interpret mode, which cannot lower inside
``shard_map`` with ``check_vma=True`` (JAX 0.11.2); here they run on the
devices, with it, at a vocabulary the size of Qwen's padded to 2 shards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxsample
from jaxsample._src.parallel import vocab as sharded

from helpers.cases import sample_vocab_parallel, vocab_parallel

pytestmark = pytest.mark.gpu


def _two_gpus():
  if jax.default_backend() != "gpu" or jax.device_count() < 2:
    pytest.skip("needs 2 GPUs")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vocab_parallel_kernels_equal_one_gpu(dtype):
  _two_gpus()
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


def test_vocab_parallel_search_truncation_equals_one_gpu():
  """Truncating rows on the sort-free XLA search, vocab split over 2 GPUs
  (collectives of counts, digit sums and candidates): bit-identical."""
  _two_gpus()
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
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _batch_parallel_call(name):
  """``(run, args, out_specs)`` of one public call with the kernels and
  traced truncating params on a batch of 64 rows."""
  batch, vocab, k = 64, 32768, 2
  params = jaxsample.SamplingParams.make(
      batch, temperature=[1.0, 0.7, 0.0, 1.3] * (batch // 4),
      top_k=[0, 50, 0, 0] * (batch // 4),
      top_p=[1.0, 0.9, 1.0, 0.8] * (batch // 4))
  key = jax.random.key(3)
  config = jaxsample.SamplerConfig(implementation="pallas")
  if name == "spec":
    target = jax.random.normal(jax.random.key(6), (batch, k + 1, vocab)) * 3
    draft = jax.random.randint(jax.random.key(7), (batch, k), 0, vocab)
    return (lambda t, d, n, p: jaxsample.rejection_sample(
        t, d, n, p, key, config=config, return_mask=True),
            (target, draft, jnp.arange(batch) % (k + 1), params),
            (P("b"), P(None, "b")))
  x = jax.random.normal(jax.random.key(2), (batch, vocab)) * 3
  if name == "sample":
    return (lambda x, p: jaxsample.sample(x, p, key, config=config,
                                          return_mask=True), (x, params),
            P("b"))
  return (lambda x, p: jaxsample.extract_sampling_mask(x, p, config=config),
          (x, params), P("b"))


@pytest.mark.parametrize("name", ["sample", "extract", "spec"])
def test_batch_parallel_kernels_check_vma_equal_one_gpu(name):
  """sample (with masks), extract_sampling_mask and rejection_sample on a
  batch split over 2 GPUs, under jit (Explicit axes) and shard_map
  (check_vma on): bit-identical to one GPU.  Each call compiles its whole
  kernel path three times (one GPU, jit, shard_map), tens of seconds each;
  the programs hold no collective (test_sharding's
  ``test_batch_parallel_kernels_lower_under_check_vma_without_collectives``),
  so nothing can wait on the other GPU."""
  _two_gpus()
  run, args, out_specs = _batch_parallel_call(name)
  want = jax.jit(run)(*args)
  with jax.set_mesh(jax.make_mesh((2,), ("b",))):
    split = jax.device_put(args, P("b"))
    for fn in (run, jax.shard_map(run, in_specs=P("b"), out_specs=out_specs)):
      got = jax.jit(fn)(*split)
      for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vocab_parallel_kernel_masks_equal_one_gpu():
  """sample_sharded(return_mask=True) with the kernels on 2 GPUs: an
  untruncated batch (the Gumbel kernel per shard, finite entries counted)
  against one GPU's kernel path, and a truncating batch (the sort-free
  search split over the shards) against one GPU's xla_search."""
  _two_gpus()
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
  for a, b in zip(jax.tree.leaves(one(x, truncating, search)),
                  jax.tree.leaves(got_trunc), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vocab_parallel_rejection_sample_equals_one_gpu():
  """rejection_sample_sharded on 2 GPUs (draft logits, truncating rows,
  masks) against one GPU's rejection_sample on xla_search: bit-identical."""
  _two_gpus()
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
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
