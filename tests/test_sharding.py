"""Batch-parallel sampling: the public calls on a batch split over 4 CPU
devices (conftest sets ``jax_num_cpu_devices``) under jit and ``shard_map``
and, ``gpu``-marked at the end, the kernels on 2 GPUs.  Vocab-parallel
sampling is ``test_vocab_parallel.py``'s.

Every sharded call is compared with the single-device jitted call on the same
inputs and keys: tokens, logprobs, validity and masks bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsample
from jaxsample._src import spec

from helpers.sharding import (assert_same_leaves, require_two_gpus,
                              truncating_params)

B, V, K = 8, 300, 2


def _inputs(seed):
  ks = jax.random.split(jax.random.key(seed), 4)
  logits = jax.random.normal(ks[0], (B, V)) * 3
  logits = logits.at[1, :10].set(-jnp.inf).at[5, 7].set(jnp.nan)
  target = jax.random.normal(ks[1], (B, K + 1, V)) * 3
  draft = jax.random.randint(ks[2], (B, K), 0, V)
  return logits, target, draft, jnp.arange(B) % (K + 1), ks[3]


def _call(fn, impl, closed_params=None):
  """The public call ``fn`` under ``impl`` as a function of ``(x, params,
  draft, num, key)``; with ``closed_params``, of those params instead (the
  kernels' untruncated route alone compiles: interpret mode is slow)."""
  config = jaxsample.SamplerConfig(implementation=impl)

  def run(x, params, draft, num, key):
    params = params if closed_params is None else closed_params
    if fn == "sample":
      return jaxsample.sample(x, params, key, config=config, return_mask=True)
    if fn == "extract":
      return jaxsample.extract_sampling_mask(x, params, config=config)
    return spec.rejection_sample(x, draft, num, params, key, config=config,
                                 return_mask=True)

  return run


CASES = [("xla", "sample", "auto"), ("xla", "extract", "shard_map"),
         ("xla_search", "sample", "shard_map"),
         ("xla_search", "extract", "explicit"),
         ("xla_search", "spec", "shard_map"), ("pallas", "extract", "shard_map")]
# The kernels' sample and rejection_sample per batch shard (interpret mode
# costs minutes of compile): the ``gpu``-marked test at the end.


def test_shard_map_without_masks_or_drafts_equals_one_device():
  """Inside ``shard_map`` as users write it (Auto mesh, traced params and
  per-request keys split with the batch): ``xla_search``'s ``sample`` of a
  batch without filters and without a mask (its no-candidates branch crashed
  XLA:CPU there) and ``rejection_sample`` with ``k = 0`` (its zero-size
  verification arrays crashed it); and a one-device ``jit`` whose key lies
  replicated on the mesh (a barrier of both ``lax.top_k`` outputs aborted
  XLA's TopkDecomposer): all equal the one-device call."""
  logits, target, draft, num, _ = _inputs(4)
  plain = jaxsample.SamplingParams.make(B, temperature=[0.0, 0.8] * (B // 2))
  keys = jax.random.key_data(jax.random.split(jax.random.key(5), B))
  positions = jnp.arange(B, dtype=jnp.int32)
  search, xla = (jaxsample.SamplerConfig(implementation=impl)
                 for impl in ("xla_search", "xla"))
  no_drafts = jnp.zeros((B, 0), jnp.int32), jnp.zeros((B,), jnp.int32)
  calls = [
      (lambda x, p, k, q, d, n: jaxsample.sample(x, p, k, positions=q,
                                                 config=search), logits),
      (lambda x, p, k, q, d, n: spec.rejection_sample(
          x, d, n, p, k, positions=q, config=xla), target[:, :1])]
  mesh = jax.make_mesh((4,), ("b",), axis_types=(AxisType.Auto,))
  for call, x in calls:
    args = (x, plain, keys, positions) + no_drafts
    want = jax.jit(call)(*args)
    got = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P("b"),
                                out_specs=P("b")))(*args)
    assert_same_leaves(want, got)
  verify = jax.jit(lambda k: spec.rejection_sample(
      target, draft, num, truncating_params(B), k, config=search))
  key = jax.random.key(6)
  assert_same_leaves(verify(key),
               verify(jax.device_put(key, NamedSharding(mesh, P()))))


@pytest.mark.parametrize("impl,fn,mode", CASES)
def test_batch_parallel_equals_one_device(impl, fn, mode):
  """Batch split over 4 devices: jit on Auto and Explicit meshes, and inside
  shard_map, equal the one-device call (one batch key: global row counters;
  XLA paths with traced truncating params, kernels with untruncated ones
  closed over)."""
  logits, target, draft, num, key = _inputs(1)
  x = target if fn == "spec" else logits
  params = truncating_params(B)
  if impl == "pallas":  # scalars: they fit a batch shard too
    params = jaxsample.SamplingParams(temperature=0.8, top_k=0, top_p=1.0,
                                      min_p=0.0)
  run = _call(fn, impl, params if impl == "pallas" else None)
  args = (x, jnp.zeros(B) if impl == "pallas" else params, draft, num)
  want = jax.jit(run)(*args, key)
  if mode == "auto":
    mesh = jax.make_mesh((4,), ("b",), axis_types=(AxisType.Auto,))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("b")))
    got = jax.jit(run)(*jax.tree.map(put, args), key)
  else:
    mesh = jax.make_mesh((4,), ("b",))
    with jax.set_mesh(mesh):
      args = jax.device_put(args, P("b"))
      if mode == "explicit":
        got = jax.jit(run)(*args, key)
      else:
        # Interpret mode cannot lower under check_vma (JAX 0.11.2): the GPU
        # test runs the kernels with it.
        body = jax.shard_map(run, in_specs=(P("b"),) * 4 + (P(),),
                             out_specs=P("b") if fn != "spec" else
                             (P("b"), P(None, "b")),
                             check_vma=impl != "pallas")
        got = jax.jit(body)(*args, key)
  assert_same_leaves(want, got)


def test_batch_parallel_kernels_lower_under_check_vma_without_collectives(
    monkeypatch):
  """The kernels' sample (traced truncating params: every route, the conds
  typed by ``rowwise.manual_switch``) inside ``shard_map`` with check_vma on
  a batch split over 2 abstract H100s lowers to Triton IR (interpret mode
  cannot: the run is ``test_batch_parallel_kernels_check_vma_equal_one_gpu``'s),
  and its program holds no collective: no device ever waits on another,
  whatever each one's conds take (a slow 2-GPU run is compile time, not a
  hang)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                                       num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((2,), ("b",), abstract_device=device,
                                   axis_types=(AxisType.Explicit,))
  split = lambda shape, dtype: jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, P("b")))
  params = jaxsample.SamplingParams(
      *(split((B,), d) for d in (jnp.float32, jnp.int32) + (jnp.float32,) * 2))
  body = jax.shard_map(
      lambda x, p: jaxsample.sample(x, p, jax.random.key(0), return_mask=True,
                                    config="pallas"),
      mesh=mesh, in_specs=P("b"), out_specs=P("b"))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(body).trace(split((B, 4096), jnp.float32), params).lower(
        lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 21  # test_threshold's count
  for collective in ("all_reduce", "all_gather", "collective_permute",
                     "all_to_all", "reduce_scatter"):
    assert collective not in text


# ---------------------------------------------------------------------------
# On 2 GPUs (``gpu``-marked; skips with fewer): the kernels under check_vma.
# ---------------------------------------------------------------------------


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


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sample", "extract", "spec"])
def test_batch_parallel_kernels_check_vma_equal_one_gpu(name):
  """sample (with masks), extract_sampling_mask and rejection_sample on a
  batch split over 2 GPUs, under jit (Explicit axes) and shard_map
  (check_vma on): bit-identical to one GPU.  Each call compiles its whole
  kernel path three times (one GPU, jit, shard_map), tens of seconds each;
  the programs hold no collective
  (``test_batch_parallel_kernels_lower_under_check_vma_without_collectives``),
  so nothing can wait on the other GPU."""
  require_two_gpus()
  run, args, out_specs = _batch_parallel_call(name)
  want = jax.jit(run)(*args)
  with jax.set_mesh(jax.make_mesh((2,), ("b",))):
    split = jax.device_put(args, P("b"))
    for fn in (run, jax.shard_map(run, in_specs=P("b"), out_specs=out_specs)):
      assert_same_leaves(want, jax.jit(fn)(*split))
