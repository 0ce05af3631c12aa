"""The report's non-JAX peers (``jaxsample.bench.peers``, ``vllm_peers``;
FlashInfer's: ``test_flashinfer_peer.py``).

On CPU: the vLLM loader's source resolution, the stand-in ``vllm.*`` modules
and the launch binding of vLLM's Triton dispatchers.  On a GPU (the
``gpu``-marked tests at the end): torch's sort sampler and vLLM's Triton
kernels loaded from a local copy of vLLM's source (``.peers/vllm`` or
``$JAXSAMPLE_VLLM_SRC``; skipped without torch on CUDA or, the vLLM tests,
without the copy): the vLLM sampler keeps exactly the top token under
filters that keep one token and samples a small row's distribution (total
variation bounded by the sample count)."""

import json
import os
import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import peers as helpers_peers
from jaxsample.bench import cli, peers, vllm_peers


def _source_tree(root, files=vllm_peers.FILES.values()):
  return helpers_peers.source_tree(root, files)


def test_resolve_source_names_the_fix(tmp_path, monkeypatch):
  monkeypatch.delenv(vllm_peers.ENV_VAR, raising=False)
  with pytest.raises(vllm_peers.VllmSourceError, match="--vllm-src PATH or set JAXSAMPLE"):
    vllm_peers.resolve_source(None)
  with pytest.raises(vllm_peers.VllmSourceError, match="no such folder"):
    vllm_peers.resolve_source(tmp_path / "absent")
  partial = _source_tree(tmp_path / "partial", list(vllm_peers.FILES.values())[:1])
  with pytest.raises(vllm_peers.VllmSourceError) as error:
    vllm_peers.resolve_source(partial)
  assert vllm_peers.FILES["gumbel"] in str(error.value)
  assert vllm_peers.FILES["topk_topp"] not in str(error.value)
  full = _source_tree(tmp_path / "full")
  assert vllm_peers.resolve_source(full) == full
  monkeypatch.setenv(vllm_peers.ENV_VAR, str(full))  # the environment variable stands in
  assert vllm_peers.resolve_source(None) == full
  assert vllm_peers.source_commit(full) is None
  (full / "COMMIT").write_text("vllm 0.33.0 (commit 4ba787ec9)\nmore lines\n")
  assert vllm_peers.source_commit(full) == "vllm 0.33.0 (commit 4ba787ec9)"


@pytest.mark.skipif(peers.torch_module() is not None, reason="torch with CUDA is here")
def test_load_without_torch_says_what_it_needs(tmp_path):
  with pytest.raises(RuntimeError, match="torch and Triton with a CUDA GPU"):
    vllm_peers.load(_source_tree(tmp_path))


def test_shim_modules_stand_in_for_the_imported_helpers():
  shims = vllm_peers.shim_modules()
  # Every vllm.* import of the three files (vLLM 0.33.0).
  wanted = {
      "vllm.platforms": ("current_platform",),
      "vllm.utils.gpu_sync_debug": ("gpu_sync_allowed",),
      "vllm.utils.math_utils": ("next_power_of_2",),
      "vllm.utils.platform_utils": ("num_compute_units",),
      "vllm.model_executor.warmup.jit_warmup": ("WarmupChoices", "WarmupIntRange", "_when"),
      "vllm.model_executor.warmup.jit_warmup_triton_helper": (
          "DispatchSpec", "TritonWarmupTensor", "triton_kernel_dispatcher_with_warmup"),
  }
  for module, names in wanted.items():
    assert all(name in vars(shims[module]) for name in names), module
  # tl and triton come on first use (Triton is optional): the name resolves lazily
  assert isinstance(shims["vllm.triton_utils"].HAS_TRITON, bool)
  math_utils = shims["vllm.utils.math_utils"]
  assert [math_utils.next_power_of_2(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [
      1, 1, 2, 4, 8, 64, 128]
  with shims["vllm.utils.gpu_sync_debug"].gpu_sync_allowed():
    pass
  platform = shims["vllm.platforms"].current_platform
  assert platform.is_cuda_alike() and platform.is_cuda() and platform.device_type == "cuda"
  with pytest.raises(AttributeError, match="stand-in"):
    shims["vllm.triton_utils"].tldevice
  with pytest.raises(NotImplementedError):
    shims["vllm.model_executor.warmup.jit_warmup"].WarmupChoices(1, 2)


def test_shims_leave_sys_modules_as_they_were():
  sentinel = types.ModuleType("vllm")
  saved = sys.modules.get("vllm")
  sys.modules["vllm"] = sentinel
  try:
    with vllm_peers.shims_installed():
      assert sys.modules["vllm"] is not sentinel
      assert "vllm.utils.math_utils" in sys.modules
    assert sys.modules["vllm"] is sentinel and "vllm.utils.math_utils" not in sys.modules
  finally:
    if saved is None:
      sys.modules.pop("vllm")
    else:
      sys.modules["vllm"] = saved


class _Tensor:
  def __init__(self, strides):
    self.strides = strides

  def stride(self, dim):
    return self.strides[dim]


# The argument names of vLLM 0.33.0's _topk_topp_kernel, in order.
TOPK_TOPP_ARGS = ("LOGITS", "LOGITS_STRIDE_0", "BUFFER", "PERCENTILE_TO_STD_TABLE",
                  "NORMAL_CDF_TO_SIGMA_TABLE", "K", "P", "BATCH_SIZE", "VOCAB_SIZE",
                  "MASK_VALUE", "BLOCK_SIZE", "BLOCK_SIZE_TRUNC", "TOPK_ENABLED",
                  "TOPP_ENABLED", "SPLIT_COVERS_PONLY")


def test_bind_launch_follows_the_dispatcher_naming_rule():
  logits, buffer, k = _Tensor((4096, 1)), _Tensor((4096, 1)), _Tensor((1,))
  inputs = dict(logits=logits, buffer=buffer, percentile_to_std_table="pct",
                normal_cdf_to_sigma_table="cdf", k=k, p=None, mask_value=-1.0, num_sm=132)
  launch = dict(K=k, P=logits, BATCH_SIZE=2, VOCAB_SIZE=4096, BLOCK_SIZE=8192,
                BLOCK_SIZE_TRUNC=4096, TOPK_ENABLED=True, TOPP_ENABLED=False,
                SPLIT_COVERS_PONLY=False, num_warps=8)
  bound = vllm_peers.bind_launch(TOPK_TOPP_ARGS, inputs, launch)
  assert bound["LOGITS"] is logits and bound["BUFFER"] is buffer
  assert bound["LOGITS_STRIDE_0"] == 4096 and bound["MASK_VALUE"] == -1.0
  assert bound["P"] is logits  # set by the dispatcher: the input p=None does not replace it
  assert (bound["PERCENTILE_TO_STD_TABLE"], bound["NORMAL_CDF_TO_SIGMA_TABLE"]) == ("pct", "cdf")
  assert "num_sm" not in bound and bound["num_warps"] == 8
  assert set(TOPK_TOPP_ARGS) <= set(bound)
  # lower-case pointers and strides without a dimension (gumbel-style names)
  lower = vllm_peers.bind_launch(("logits_ptr", "logits_stride", "out_ptr", "out_stride_1"),
                                 dict(logits=_Tensor((7, 1)), out=_Tensor((5, 3))), {})
  assert lower["logits_stride"] == 7 and lower["out_stride_1"] == 3


def test_dispatcher_launches_the_kernel_with_the_bound_arguments():
  launched = []

  class Kernel:
    arg_names = ("X", "X_STRIDE_0", "N", "BLOCK")

    def __getitem__(self, grid):
      return lambda **kwargs: launched.append((grid, kwargs))

  helper = vllm_peers.shim_modules()["vllm.model_executor.warmup.jit_warmup_triton_helper"]

  @helper.triton_kernel_dispatcher_with_warmup(kernel=Kernel(), warmup_inputs=None)
  def dispatch(x, n, scale=2):
    return (n * scale,), dict(BLOCK=128), "outputs"

  x = _Tensor((64, 1))
  assert dispatch(x, 3) == "outputs"
  assert launched == [((6,), dict(BLOCK=128, X=x, N=3, X_STRIDE_0=64))]
  with pytest.raises(NotImplementedError, match="kernel="):
    helper.triton_kernel_dispatcher_with_warmup(warmup_inputs=None)


# ---------------------------------------------------------------------------
# On a GPU: torch's sort sampler and vLLM's kernels (module docstring).
# ---------------------------------------------------------------------------


ROOT = pathlib.Path(__file__).resolve().parents[1]
VLLM_SRC = os.environ.get(vllm_peers.ENV_VAR) or str(ROOT / ".peers" / "vllm")
VOCAB = 151936


@pytest.fixture(scope="module")
def kernels(torch):
  return helpers_peers.load_copy(vllm_peers, VLLM_SRC)


def _peaked_rows(batch: int, vocab: int, dtype, seed: int):
  """``2 N(0, 1)`` rows with one token 8 above the rest at a random id, and its ids."""
  key_x, key_id = jax.random.split(jax.random.key(seed))
  x = 2 * jax.random.normal(key_x, (batch, vocab), jnp.float32)
  ids = jax.random.randint(key_id, (batch,), 0, vocab)
  x = x.at[jnp.arange(batch), ids].set(jnp.max(x, axis=-1) + 8)
  return x.astype(dtype), np.asarray(ids)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch", [4, 100])  # <= 64: vLLM's split top-p pipeline
@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=0.5),
                                     dict(top_k=50, top_p=1e-6)], ids=str)
def test_vllm_sampler_keeps_only_the_top_token(kernels, torch, filters, batch, dtype):
  x, top = _peaked_rows(batch, VOCAB, dtype, seed=batch)
  sample = vllm_peers.sampler(kernels, torch, batch, filters, 0.7, plain=False)
  tokens = sample(torch.from_dlpack(jax.block_until_ready(x))).cpu().numpy()
  np.testing.assert_array_equal(tokens, top)


@pytest.mark.gpu
def test_vllm_samplers_draw_the_row_distribution(kernels, torch):
  """Many rows of one small distribution, each with its own seed: plain
  (``gumbel_sample`` alone and the whole path) and top-k 4 frequencies within
  a total-variation bound of the exact probabilities."""
  vocab, rows, temperature = 16, 8192, 0.7
  logits = np.linspace(-2.0, 1.5, vocab, dtype=np.float32)
  x = jnp.broadcast_to(jnp.asarray(logits), (rows, vocab))
  tensor = torch.from_dlpack(jax.block_until_ready(x))
  bound = 3 * np.sqrt(vocab / rows)
  for filters, plain in (({}, True), ({}, False), (dict(top_k=4), False)):
    sample = vllm_peers.sampler(kernels, torch, rows, filters, temperature, plain)
    tokens = sample(tensor).cpu().numpy()
    want = np.exp((logits - logits.max()) / temperature)
    if filters:
      want[:-4] = 0
      assert set(np.unique(tokens)) <= set(range(vocab - 4, vocab))
    want /= want.sum()
    got = np.bincount(tokens, minlength=vocab) / rows
    assert 0.5 * np.abs(got - want).sum() < bound, (filters, plain, got, want)


@pytest.mark.gpu
def test_time_torch_replays_a_graph(torch):
  rows = [_peaked_rows(8, VOCAB, jnp.float32, seed)[0] for seed in range(3)]
  result = peers.time_torch(peers.torch_sort_sampler(torch, dict(top_k=50, top_p=0.9), 0.7),
                            rows, iters=4, repeats=2)
  assert result["graph"], result
  assert result["us"] > 0 and result["wall_us"] > 0


@pytest.mark.gpu
def test_report_times_every_peer(kernels, tmp_path):
  out = tmp_path / "report"
  assert cli.main(["report", "--out", str(out), "--batch", "1,100", "--vocab", str(VOCAB),
                   "--dtypes", "bfloat16", "--settings", "plain,top_p0.95,min_p0.05",
                   "--quick", "--no-spec", "--peers", "jax,torch,vllm",
                   "--vllm-src", str(kernels.root), "--no-progress"]) == 0
  doc = json.loads((out / "report.json").read_text())
  assert doc["peers"]["failures"] == [] and doc["peers"]["vllm"]["commit"] == kernels.commit
  for setting in ("plain", "top_p0.95", "min_p0.05"):
    for batch in (1, 100):
      found = {r["op"]: r for r in doc["rows"] if r["setting"] == setting and
               r["batch"] == batch}
      for name in (vllm_peers.SAMPLER, vllm_peers.GUMBEL, peers.TORCH_SORT):
        assert found[name]["graph"] and found[name]["us"] > 0, (setting, batch, name)
  md = (out / "report.md").read_text()
  assert vllm_peers.SAMPLER in md and str(kernels.commit) in md
