"""vLLM's own Triton sampling kernels as benchmark peers, loaded at run time.

No vLLM code is part of jaxsample.  ``--vllm-src PATH`` (or the environment
variable ``JAXSAMPLE_VLLM_SRC``) names a local copy of vLLM's source holding
at least ``FILES`` at their upstream paths, and a ``COMMIT`` file naming the
upstream version (recorded in the report).  ``load`` executes those files by
path; the few ``vllm.*`` helpers they import are stand-ins written here
(``shim_modules``), present in ``sys.modules`` only while the files execute.
They need torch and Triton with a CUDA GPU (the GPU machine's ``python3``).

Peers, timed on the case's rows with ``peers.time_torch`` (CUDA-graph replays):

* ``vllm sampler (Triton)``: model runner v2's sampling path
  (``vllm/v1/worker/gpu/sample/sampler.py``): an fp32 copy of the logits, its
  temperature kernel, its min-p kernel (min-p rows), its default GPU top-k /
  top-p (``apply_top_k_top_p_triton``: a pivot search), then ``gumbel_sample``
  (Gumbel-max with murmur3 noise).  As in vLLM, a step at temperature 1 with
  no filter skips the copy.
* ``vllm gumbel_sample``: the Gumbel-max kernel alone on the raw logits, the
  temperature applied inside: vLLM's plain sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import sys
import types
from collections.abc import Callable

from jaxsample.bench import peers
from jaxsample.bench.peers import source_commit

__all__ = ["ENV_VAR", "FILES", "GUMBEL", "SAMPLER", "VllmKernels", "VllmSourceError",
           "bind_launch", "load", "peer_factories", "resolve_source", "sampler",
           "shim_modules", "shims_installed", "source_commit"]

ENV_VAR = "JAXSAMPLE_VLLM_SRC"
# The files executed, by role, at their paths in vLLM's source tree.
FILES = {
    "topk_topp": "vllm/v1/sample/ops/topk_topp_triton.py",
    "gumbel": "vllm/v1/worker/gpu/sample/gumbel.py",
    "min_p": "vllm/v1/worker/gpu/sample/min_p.py",
}
SAMPLER = "vllm sampler (Triton)"
GUMBEL = "vllm gumbel_sample"
_HOW = ("copy vLLM's source (or just FILES and LICENSE) into an ignored folder, e.g. .peers/vllm, "
        "with a COMMIT file naming the upstream commit (docs/benchmarks.md, 'Report')")


class VllmSourceError(ValueError):
  """The vLLM source copy is not given, not found or incomplete."""


def resolve_source(path: str | os.PathLike | None = None) -> pathlib.Path:
  """The vLLM source folder: ``path``, else ``$JAXSAMPLE_VLLM_SRC``; every file
  of ``FILES`` must be there."""
  return peers.resolve_source_copy(path, project="vLLM", option="--vllm-src", env_var=ENV_VAR,
                                   files=FILES.values(), how=_HOW, error=VllmSourceError)


# ---------------------------------------------------------------------------
# Stand-ins for the vllm.* helpers the files import.
# ---------------------------------------------------------------------------


def bind_launch(kernel_args, inputs: dict, launch: dict) -> dict:
  """A Triton launch's keyword arguments from a dispatcher's inputs.

  vLLM's dispatchers (``triton_kernel_dispatcher_with_warmup``) return a grid
  and some kernel arguments; the launcher adds each dispatcher input under the
  kernel argument spelled like it (``name``, ``name_ptr``, ``NAME`` or
  ``NAME_PTR``) unless the dispatcher set that argument, then each unset
  stride argument ``X_STRIDE_d`` / ``x_stride_d`` (``d`` omitted: 0) from the
  bound tensor ``X`` (or ``X_PTR`` / ``x_ptr``).  This is that rule.
  """
  kwargs = dict(launch)
  for name, value in inputs.items():
    spellings = (name, f"{name}_ptr", name.upper(), f"{name}_ptr".upper())
    target = next((s for s in spellings if s in kernel_args), None)
    if target is not None and target not in launch:
      kwargs[target] = value
  for arg in kernel_args:
    match = re.fullmatch(r"(.+)_(stride|STRIDE)_?(\d*)", arg)
    if arg in kwargs or match is None:
      continue
    base, word, dim = match.groups()
    sources = (base, base + ("_PTR" if word == "STRIDE" else "_ptr"))
    source = next((s for s in sources if s in kwargs), None)
    if source is not None:
      kwargs[arg] = kwargs[source].stride(int(dim or 0))
  return kwargs


def _dispatcher(*, warmup_inputs, kernel=None):
  """``triton_kernel_dispatcher_with_warmup``: launches ``kernel`` with the
  decorated dispatch function's spec (``bind_launch``); no warm-up."""
  del warmup_inputs  # compile-ahead inputs: the benchmark warms up by calling
  if kernel is None:
    raise NotImplementedError("the vLLM peers' stand-in dispatcher needs kernel=")

  def decorate(dispatch):
    signature = inspect.signature(dispatch)

    def launch(*args, **kwargs):
      bound = signature.bind(*args, **kwargs)
      bound.apply_defaults()
      spec = dispatch(*args, **kwargs)
      launch_kwargs = bind_launch(tuple(kernel.arg_names), bound.arguments, spec[1])
      chosen = launch_kwargs.pop("kernel", None) or kernel
      chosen[spec[0]](**launch_kwargs)
      return spec[2] if len(spec) == 3 else None

    launch.__name__ = dispatch.__name__
    return launch

  return decorate


def _warmup_only(*args, **kwargs):
  raise NotImplementedError("vLLM's warm-up input builders are not used by the benchmark")


def _num_compute_units(device_id: int = 0) -> int:
  return peers.torch_module().cuda.get_device_properties(device_id).multi_processor_count


def _triton_attribute(name: str):
  """``vllm.triton_utils``'s names, imported on first use (Triton is optional)."""
  if name == "triton":
    return importlib.import_module("triton")
  if name == "tl":
    return importlib.import_module("triton.language")
  if name == "HAS_TRITON":
    return importlib.util.find_spec("triton") is not None
  raise AttributeError(f"module 'vllm.triton_utils' (jaxsample's stand-in) has no {name!r}")


def shim_modules() -> dict[str, types.ModuleType]:
  """Stand-in modules for the ``vllm.*`` names that ``FILES`` import, by name."""
  platform = types.SimpleNamespace(
      is_cuda_alike=lambda: True, is_cuda=lambda: True, is_cpu=lambda: False,
      device_type="cuda", num_compute_units=_num_compute_units)
  contents = {
      "vllm": {},
      "vllm.triton_utils": {"__getattr__": _triton_attribute},
      "vllm.platforms": {"current_platform": platform},
      "vllm.utils": {},
      "vllm.utils.gpu_sync_debug": {"gpu_sync_allowed": contextlib.nullcontext},
      "vllm.utils.math_utils": {
          "next_power_of_2": lambda n: 1 if n < 1 else 1 << (n - 1).bit_length()},
      "vllm.utils.platform_utils": {"num_compute_units": _num_compute_units},
      "vllm.model_executor": {},
      "vllm.model_executor.warmup": {},
      "vllm.model_executor.warmup.jit_warmup": {
          "WarmupChoices": _warmup_only, "WarmupIntRange": _warmup_only, "_when": _warmup_only},
      "vllm.model_executor.warmup.jit_warmup_triton_helper": {
          "DispatchSpec": tuple, "TritonWarmupTensor": _warmup_only,
          "triton_kernel_dispatcher_with_warmup": _dispatcher},
  }
  modules = {}
  for name, attributes in contents.items():
    module = types.ModuleType(name, "jaxsample's stand-in for vLLM's module of this name")
    module.__path__ = []  # a package: its submodules resolve through sys.modules
    module.__dict__.update(attributes)
    modules[name] = module
  return modules


@contextlib.contextmanager
def shims_installed():
  """``shim_modules`` in ``sys.modules``; whatever held those names comes back after."""
  shims = shim_modules()
  saved = {name: sys.modules[name] for name in shims if name in sys.modules}
  sys.modules.update(shims)
  try:
    yield
  finally:
    for name in shims:
      sys.modules.pop(name, None)
    sys.modules.update(saved)


# ---------------------------------------------------------------------------
# Loading and the peers.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VllmKernels:
  """The loaded entry points, the source folder and its upstream commit."""

  root: pathlib.Path
  commit: str | None
  apply_top_k_top_p_triton: Callable
  gumbel_sample: Callable
  apply_temperature: Callable
  apply_min_p: Callable

  def describe(self) -> dict:
    return dict(source=str(self.root), commit=self.commit, files=list(FILES.values()))


def _execute(path: pathlib.Path, name: str) -> types.ModuleType:
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # Triton reads its kernels' source through the module
  spec.loader.exec_module(module)
  return module


def load(path: str | os.PathLike | None = None) -> VllmKernels:
  """Executes ``FILES`` of the vLLM copy at ``path`` (``resolve_source``)."""
  root = resolve_source(path)
  if peers.torch_module() is None or importlib.util.find_spec("triton") is None:
    raise RuntimeError("the vLLM peers need torch and Triton with a CUDA GPU (the GPU "
                       "machine's python3 has them); leave vllm out of --peers elsewhere")
  with shims_installed():
    modules = {role: _execute(root / file, f"_jaxsample_vllm_peer.{role}")
               for role, file in FILES.items()}
  return VllmKernels(root=root, commit=source_commit(root),
                     apply_top_k_top_p_triton=modules["topk_topp"].apply_top_k_top_p_triton,
                     gumbel_sample=modules["gumbel"].gumbel_sample,
                     apply_temperature=modules["gumbel"].apply_temperature,
                     apply_min_p=modules["min_p"].apply_min_p)


def sampler(kernels: VllmKernels, torch, batch: int, filters: dict, temperature: float,
            plain: bool) -> Callable:
  """``[batch, V]`` logits -> tokens through model runner v2's path (module doc);
  ``plain``: ``gumbel_sample`` alone on the raw logits."""
  on_gpu = dict(device="cuda")
  rows = torch.arange(batch, dtype=torch.int32, **on_gpu)  # request i on row i
  temp = torch.full((batch,), temperature, dtype=torch.float32, **on_gpu)
  seeds = torch.arange(1, batch + 1, dtype=torch.int64, **on_gpu) * 0x9E3779B1
  positions = torch.zeros(batch, dtype=torch.int64, **on_gpu)
  top_k, top_p, min_p = filters.get("top_k"), filters.get("top_p", 1.0), filters.get("min_p")
  k = torch.full((batch,), top_k, dtype=torch.int32, **on_gpu) if top_k else None
  p = torch.full((batch,), top_p, dtype=torch.float32, **on_gpu) if top_p < 1 else None
  min_ps = torch.full((batch,), min_p, dtype=torch.float32, **on_gpu) if min_p else None
  processed = temperature != 0 and (temperature != 1 or any(
      v is not None for v in (k, p, min_ps)))

  def gumbel(x, apply_temperature):
    return kernels.gumbel_sample(x, rows, temp, seeds, positions,
                                 apply_temperature=apply_temperature, is_drafting=False)

  def sample(logits):
    if plain or not processed:
      return gumbel(logits, apply_temperature=True)
    x = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
    if temperature != 1:
      kernels.apply_temperature(x, rows, temp)
    if min_ps is not None:
      kernels.apply_min_p(x, rows, min_ps)
    if k is not None or p is not None:
      x = kernels.apply_top_k_top_p_triton(x, k, p, has_topp_only_rows=k is None)
    return gumbel(x, apply_temperature=False)

  return sample


def peer_factories(kernels: VllmKernels) -> dict[str, Callable]:
  """``{name: factory(filters, temperature) -> op(rows, iters, repeats)}`` for the
  runner's ``external`` peers."""

  def op(plain):
    return lambda torch, shape, filters, temperature: sampler(kernels, torch, shape[0],
                                                              filters, temperature, plain)

  return {SAMPLER: peers.torch_peer(op(False)), GUMBEL: peers.torch_peer(op(True))}
