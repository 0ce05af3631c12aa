"""FlashInfer's CUDA sampling kernels as benchmark peers, built at run time.

No FlashInfer code is part of jaxsample.  ``--flashinfer-src PATH`` (or the
environment variable ``JAXSAMPLE_FLASHINFER_SRC``) names a local copy of
FlashInfer's source holding at least ``FILES`` (the header-only kernels of
``include/flashinfer/sampling.cuh`` and the headers it includes) at their
upstream paths, and a ``COMMIT`` file naming the upstream version (recorded in
the report).  ``load`` compiles jaxsample's own binding
(``flashinfer_binding/``: one launcher per entry point of those headers) against
the copy with torch's C++ extension loader (nvcc and ninja; one ``-gencode`` for
the GPU at hand) into a build folder under the temporary directory.

Peers, timed on the case's rows with ``peers.time_torch`` (CUDA-graph replays).
Each times what a user of FlashInfer's Python API (``flashinfer.sampling`` at
the copy's commit, its defaults: ``deterministic=True``, scalar parameters, a
fresh Philox offset per call) calls for the setting, its Python-side torch ops
included; logits are first made fp32 (``.float()``, a copy for bf16 rows), as
its wrappers do:

* ``flashinfer sampling``, by setting:

  - plain: ``sampling_from_logits(x / T)`` (the division is the caller's: the
    logits entry points take no temperature);
  - top-k + top-p: ``top_k_top_p_sampling_from_logits(x / T, k, p)``; with
    the default order ``top_k_first`` at ``k <= 256`` and ``V >= 65536`` that
    API takes its fast path, which is what is timed: the radix top-k
    (``TopKDispatch``, sorted, deterministic), ``torch.softmax`` of the k
    values, ``top_p_sampling_from_probs`` on those k, and a gather of the ids;
    other k (FlashInfer's full-row masking fallback) are not timed;
  - top-p, min-p, top-k alone: ``softmax(x, temperature=T)`` (FlashInfer's
    online softmax; PDL on compute capability >= 9, as its default) then
    ``top_p_sampling_from_probs`` / ``min_p_sampling_from_probs`` /
    ``top_k_sampling_from_probs``;
  - other combinations (e.g. min-p with top-k) and temperature 0: not timed.

* ``flashinfer joint top-k/top-p`` (top-k + top-p settings only): FlashInfer's
  softmax with the temperature, then ``top_k_top_p_sampling_from_probs(probs,
  k, p, filter_apply_order="joint")`` (one rejection-sampling kernel with both
  filters, the path serving engines that pass probabilities take).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pathlib
import tempfile
import time
from collections.abc import Callable

from jaxsample.bench import peers
from jaxsample.bench.peers import source_commit

__all__ = ["ENV_VAR", "FILES", "FlashInferKernels", "FlashInferSourceError", "JOINT", "SAMPLER",
           "SOURCES", "build_flags", "load", "peer_factories", "plan", "resolve_source",
           "source_commit"]

ENV_VAR = "JAXSAMPLE_FLASHINFER_SRC"
# The headers the binding compiles, at their paths in FlashInfer's source tree:
# sampling.cuh and topk.cuh and every header they include.
FILES = tuple(f"include/flashinfer/{name}" for name in (
    "sampling.cuh", "topk.cuh", "topk_common.cuh", "allocator.h", "exception.h", "math.cuh",
    "utils.cuh", "vec_dtypes.cuh"))
# jaxsample's binding: the module (binding.cpp) and one translation unit per launcher,
# so that ninja compiles them side by side.
BINDING = pathlib.Path(__file__).with_name("flashinfer_binding")
SOURCES = (BINDING / "binding.cpp", *sorted(BINDING.glob("launch_*.cu")))
SAMPLER = "flashinfer sampling"
JOINT = "flashinfer joint top-k/top-p"
# FlashInfer's top_k_first fast path: a scalar k in (0, 256] and V >= 65536.
FAST_PATH_MAX_K = 256
FAST_PATH_MIN_VOCAB = 65536
_WORKSPACE_BYTES = 1 << 20  # FlashInfer's softmax workspace and radix row states (1 MiB each)
_SEED = 0x5EED
_HOW = ("copy FlashInfer's FILES (include/flashinfer/...), its LICENSE and a COMMIT file "
        "naming the upstream commit into an ignored folder, e.g. .peers/flashinfer "
        "(docs/benchmarks.md, 'FlashInfer's kernels')")


class FlashInferSourceError(ValueError):
  """The FlashInfer source copy is not given, not found or incomplete."""


def resolve_source(path: str | os.PathLike | None = None) -> pathlib.Path:
  """The FlashInfer source folder: ``path``, else ``$JAXSAMPLE_FLASHINFER_SRC``;
  every file of ``FILES`` must be there."""
  return peers.resolve_source_copy(path, project="FlashInfer", option="--flashinfer-src",
                                   env_var=ENV_VAR, files=FILES, how=_HOW,
                                   error=FlashInferSourceError)


def build_flags(capability: tuple[int, int]) -> list[str]:
  """nvcc flags of the binding for a GPU of compute ``capability``: one
  ``-gencode`` (torch then adds no arch flags of its own), and torch's
  ``__CUDA_NO_HALF*`` macros undefined (FlashInfer's vector types use the
  half and bfloat16 operators)."""
  arch = f"{capability[0]}{capability[1]}"
  return ["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}",
          "--expt-relaxed-constexpr", "-U__CUDA_NO_HALF_OPERATORS__",
          "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
          "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_OPERATORS__"]


@dataclasses.dataclass(frozen=True)
class FlashInferKernels:
  """The built binding (``module``), the source folder, its upstream commit and
  the build's wall time in seconds (a cached build takes about a second)."""

  root: pathlib.Path
  commit: str | None
  module: object
  build_s: float

  def describe(self) -> dict:
    return dict(source=str(self.root), commit=self.commit, files=list(FILES),
                build_s=round(self.build_s, 1))


def load(path: str | os.PathLike | None = None, *, build_dir: str | os.PathLike | None = None,
         verbose: bool = False) -> FlashInferKernels:
  """Compiles and imports the binding against the copy at ``path``
  (``resolve_source``); ``build_dir`` defaults to a folder under the temporary
  directory named after the GPU's architecture (ninja rebuilds only what changed)."""
  root = resolve_source(path)
  torch = peers.torch_module()
  if torch is None:
    raise RuntimeError("the FlashInfer peers need torch with a CUDA GPU and nvcc (the GPU "
                       "machine's python3 has them); leave flashinfer out of --peers elsewhere")
  cpp_extension = importlib.import_module("torch.utils.cpp_extension")  # torch is optional
  if not cpp_extension.is_ninja_available():
    raise RuntimeError("the FlashInfer peers build with torch's extension loader, which needs "
                       "ninja: pip install ninja (or carry its wheel to the GPU machine)")
  capability = torch.cuda.get_device_capability()
  folder = pathlib.Path(build_dir or pathlib.Path(tempfile.gettempdir()) /
                        f"jaxsample-flashinfer-sm{capability[0]}{capability[1]}")
  folder.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  module = cpp_extension.load(
      name="jaxsample_flashinfer_peer", sources=[str(s) for s in SOURCES],
      extra_include_paths=[str(root / "include")], extra_cflags=["-O3"],
      extra_cuda_cflags=build_flags(capability), build_directory=str(folder), verbose=verbose)
  return FlashInferKernels(root=root, commit=source_commit(root), module=module,
                           build_s=time.perf_counter() - start)


def plan(filters: dict, temperature: float, vocab: int, joint: bool) -> str | None:
  """Which FlashInfer path times a setting (module doc): ``"logits"`` (plain),
  ``"top_k_first"`` (the radix fast path), ``"joint"``, ``"top_k"``,
  ``"top_p"``, ``"min_p"``, or None where the peer times nothing."""
  top_k, top_p, min_p = filters.get("top_k"), filters.get("top_p", 1.0), filters.get("min_p")
  kept = frozenset(name for name, on in (("top_k", top_k), ("top_p", top_p < 1),
                                         ("min_p", min_p)) if on)
  if temperature <= 0:
    return None
  if joint:
    return "joint" if kept == {"top_k", "top_p"} else None
  if kept == {"top_k", "top_p"}:
    fast = 0 < top_k <= FAST_PATH_MAX_K and top_k < vocab and vocab >= FAST_PATH_MIN_VOCAB
    return "top_k_first" if fast else None
  if not kept:
    return "logits"
  return next(iter(kept)) if len(kept) == 1 else None


def sampler(kernels: FlashInferKernels, torch, shape: tuple[int, int], filters: dict,
             temperature: float, joint: bool) -> Callable | None:
  """``[batch, vocab]`` (``shape``) logits -> int32 tokens through FlashInfer's
  path for the setting (``plan``), or None."""
  batch, vocab = shape
  path = plan(filters, temperature, vocab, joint)
  if path is None:
    return None
  fi, cuda = kernels.module, torch.device("cuda")
  workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=cuda)
  row_states = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=cuda)
  pdl = torch.cuda.get_device_capability()[0] >= 9
  next_offset = [0]  # a fresh Philox offset per call
  top_k, top_p, min_p = filters.get("top_k"), filters.get("top_p", 1.0), filters.get("min_p")

  def rng(draws: int) -> tuple[int, int]:  # as FlashInfer's get_seed_and_offset advances
    offset = next_offset[0]
    next_offset[0] += (draws + 3) // 4 * 4
    return _SEED, offset

  def tempered(logits):  # the logits entry points take no temperature
    x = logits.float()
    return x if temperature == 1 else x / temperature

  def probs_of(logits):  # flashinfer.sampling.softmax(logits, temperature)
    x = logits.float()
    probs = torch.empty_like(x)
    fi.softmax(x, probs, workspace, temperature, pdl)
    return probs

  def from_probs(launch, probs, *params):
    rows = probs.shape[0]
    tokens = torch.empty(rows, dtype=torch.int32, device=cuda)
    valid = torch.empty(rows, dtype=torch.bool, device=cuda)
    launch(probs, tokens, valid, *params, *rng(rows * 32))
    return tokens

  def plain(logits):
    tokens = torch.empty(batch, dtype=torch.int32, device=cuda)
    fi.sampling_from_logits(tempered(logits), tokens, *rng(batch * vocab))
    return tokens

  def top_k_first(logits):
    indices = torch.empty(batch, top_k, dtype=torch.int32, device=cuda)
    values = torch.empty(batch, top_k, dtype=torch.float32, device=cuda)
    fi.radix_top_k(tempered(logits), indices, values, row_states, True, True)
    local = from_probs(fi.top_p_sampling_from_probs, torch.softmax(values, dim=-1), top_p)
    return indices.long().gather(1, local.view(-1, 1).long()).squeeze(1).to(torch.int32)

  paths = {
      "logits": plain,
      "top_k_first": top_k_first,
      "joint": lambda x: from_probs(fi.top_k_top_p_sampling_from_probs, probs_of(x), top_k,
                                    top_p),
      "top_k": lambda x: from_probs(fi.top_k_sampling_from_probs, probs_of(x), top_k),
      "top_p": lambda x: from_probs(fi.top_p_sampling_from_probs, probs_of(x), top_p),
      "min_p": lambda x: from_probs(fi.min_p_sampling_from_probs, probs_of(x), min_p),
  }
  return paths[path]


def peer_factories(kernels: FlashInferKernels) -> dict[str, Callable]:
  """``{name: factory(filters, temperature) -> op(rows, iters, repeats)}`` for the
  runner's ``external`` peers (``SAMPLER`` and ``JOINT``)."""
  return {name: peers.torch_peer(functools.partial(sampler, kernels, joint=joint))
          for name, joint in ((SAMPLER, False), (JOINT, True))}
