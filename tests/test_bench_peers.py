"""The copied peers' CPU-side logic: the vLLM loader (source resolution, the
stand-in ``vllm.*`` modules, the launch binding of vLLM's Triton dispatchers)
and the FlashInfer peers (source resolution, build flags, the path each setting
takes, registration in the report); the kernels themselves run in
tests/test_gpu_peers.py."""

import sys
import types

import numpy as np
import pytest

from jaxsample.bench import cli, flashinfer_peers, peers, report, vllm_peers


def _source_tree(root, files=vllm_peers.FILES.values()):
  for name in files:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text("# stand-in\n")
  return root


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
    with vllm_peers._shims_installed():
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


def test_flashinfer_resolve_source_names_the_fix(tmp_path, monkeypatch):
  monkeypatch.delenv(flashinfer_peers.ENV_VAR, raising=False)
  with pytest.raises(flashinfer_peers.FlashInferSourceError,
                     match="--flashinfer-src PATH or set JAXSAMPLE_FLASHINFER_SRC"):
    flashinfer_peers.resolve_source(None)
  with pytest.raises(flashinfer_peers.FlashInferSourceError, match="no such folder"):
    flashinfer_peers.resolve_source(tmp_path / "absent")
  partial = _source_tree(tmp_path / "partial", flashinfer_peers.FILES[:2])
  with pytest.raises(flashinfer_peers.FlashInferSourceError) as error:
    flashinfer_peers.resolve_source(partial)
  assert "include/flashinfer/vec_dtypes.cuh" in str(error.value)
  assert "include/flashinfer/sampling.cuh" not in str(error.value)
  full = _source_tree(tmp_path / "full", flashinfer_peers.FILES)
  assert flashinfer_peers.resolve_source(full) == full
  monkeypatch.setenv(flashinfer_peers.ENV_VAR, str(full))
  assert flashinfer_peers.resolve_source(None) == full
  (full / "COMMIT").write_text("fb28d72 flashinfer-ai/flashinfer\n")
  assert flashinfer_peers.source_commit(full) == "fb28d72 flashinfer-ai/flashinfer"


def test_flashinfer_kernels_describe_the_copy_and_the_build(tmp_path):
  kernels = flashinfer_peers.FlashInferKernels(root=tmp_path, commit="fb28d72", module=None,
                                               build_s=93.25)
  assert kernels.describe() == dict(source=str(tmp_path), commit="fb28d72",
                                    files=list(flashinfer_peers.FILES), build_s=93.2)


def test_flashinfer_binding_sources_are_shipped():
  module, *launchers = flashinfer_peers.SOURCES
  assert module.name == "binding.cpp" and "PYBIND11_MODULE" in module.read_text()
  exported = module.read_text().count("m.def(")
  assert len(launchers) == exported == 7
  for source in launchers:
    assert "#include <flashinfer/sampling.cuh>" in source.read_text(), source


def test_flashinfer_build_flags_name_one_architecture():
  flags = flashinfer_peers.build_flags((9, 0))
  assert [f for f in flags if "arch" in f] == ["-gencode=arch=compute_90,code=sm_90"]
  assert "-U__CUDA_NO_HALF_OPERATORS__" in flags and "-U__CUDA_NO_HALF2_OPERATORS__" in flags
  assert "-gencode=arch=compute_100,code=sm_100" in flashinfer_peers.build_flags((10, 0))


@pytest.mark.parametrize("filters,joint,vocab,want", [
    ({}, False, 151936, "logits"),
    (dict(top_k=50, top_p=0.9), False, 151936, "top_k_first"),
    (dict(top_k=256, top_p=0.9), False, 65536, "top_k_first"),
    (dict(top_k=257, top_p=0.9), False, 151936, None),  # FlashInfer's masking fallback
    (dict(top_k=50, top_p=0.9), False, 32000, None),  # below the fast path's vocabulary
    (dict(top_k=50, top_p=0.9), True, 151936, "joint"),
    (dict(top_k=50, top_p=0.9), True, 32000, "joint"),
    (dict(top_p=0.95), False, 151936, "top_p"),
    (dict(top_p=0.95), True, 151936, None),
    (dict(min_p=0.1), False, 151936, "min_p"),
    (dict(top_k=50), False, 151936, "top_k"),
    (dict(top_k=50, min_p=0.1), False, 151936, None),
    (dict(top_p=1.0), False, 151936, "logits"),
], ids=str)
def test_flashinfer_plan_picks_the_api_path(filters, joint, vocab, want):
  assert flashinfer_peers.plan(filters, 0.7, vocab, joint) == want


def test_flashinfer_plan_times_nothing_at_temperature_zero():
  assert flashinfer_peers.plan({}, 0.0, 151936, False) is None
  assert flashinfer_peers.plan(dict(top_k=50, top_p=0.9), 0.0, 151936, True) is None


def test_torch_peer_times_nothing_where_the_sampler_declines(monkeypatch):
  made = []

  def make(torch, shape, filters, temperature):
    made.append((shape, filters, temperature))
    return None

  monkeypatch.setattr(peers, "torch_module", lambda: object())
  rows = [np.zeros((3, 16), np.float32)]
  assert peers.torch_peer(make)({"top_p": 0.9}, 0.7)(rows, 2, 1) is None
  assert made == [((3, 16), {"top_p": 0.9}, 0.7)]
  monkeypatch.setattr(peers, "torch_module", lambda: None)
  assert peers.torch_peer(make)({}, 0.7)(rows, 2, 1) is None and len(made) == 1


def test_report_registers_flashinfer_beside_vllm(tmp_path, monkeypatch):
  assert "flashinfer" in report.PEERS
  opts = cli.parser().parse_args(["report", "--flashinfer-src", str(tmp_path)])
  assert opts.flashinfer_src == str(tmp_path) and opts.vllm_src == ""
  monkeypatch.setattr(peers, "torch_module", lambda: object())  # as on the GPU machine
  monkeypatch.delenv(vllm_peers.ENV_VAR, raising=False)
  assert report._chosen_peers(opts) == {"jax", "torch", "flashinfer"}  # auto: the copy given
  monkeypatch.delenv(flashinfer_peers.ENV_VAR, raising=False)
  bare = cli.parser().parse_args(["report"])
  assert report._chosen_peers(bare) == {"jax", "torch"}
  monkeypatch.setenv(flashinfer_peers.ENV_VAR, str(tmp_path))
  assert report._chosen_peers(bare) == {"jax", "torch", "flashinfer"}


def test_report_records_a_copy_that_fails_to_build(tmp_path, monkeypatch, capsys):
  def broken(path):
    raise RuntimeError("nvcc: error in sampling.cuh")

  monkeypatch.setattr(flashinfer_peers, "load", broken)
  failures = []
  opts = cli.parser().parse_args(["report", "--flashinfer-src", str(tmp_path)])
  assert report._load_copied({"jax", "flashinfer"}, opts, failures) == {}
  assert failures[0]["peer"] == "flashinfer (loading the source copy)"
  assert "nvcc: error in sampling.cuh" in failures[0]["error"]
  assert "left out" in capsys.readouterr().err
