"""Reference ops timed beside jaxsample in every suite, on the same rows.

* ``jnp.max (one read)``: XLA's row max, the logits read once and nothing
  else: what a plain read costs (the HBM floor's practical counterpart);
* ``jax.random.categorical``: JAX's own sampler on ``x / T`` (no filters);
* ``lax.top_k(K)+categorical``: top-k by ``lax.top_k``, then categorical;
* ``sort top-p(P)+categorical``: a sort-based top-p (argsort, softmax,
  cumsum), then categorical;
* ``torch sort top-k/top-p`` (opt-in): a torch sort-based sampler in the style
  of vLLM's fallback, timed with CUDA events on the same GPU and the same rows
  (shared through DLPack), as CUDA-graph replays (``time_torch``); the report
  also times vLLM's own Triton kernels (``jaxsample.bench.vllm_peers``) and
  FlashInfer's CUDA kernels (``jaxsample.bench.flashinfer_peers``) this way,
  each from a local copy of its source (``resolve_source_copy``).

``K`` and ``P`` are the case's top-k and top-p, or 50 and 0.9 where it has none.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["TORCH_AVAILABLE", "TORCH_SORT", "peer_ops", "resolve_source_copy", "source_commit",
           "time_torch", "torch_module", "torch_peer", "torch_sort_op", "torch_sort_sampler"]

DEFAULT_TOP_K = 50
DEFAULT_TOP_P = 0.9
TORCH_AVAILABLE = importlib.util.find_spec("torch") is not None
TORCH_SORT = "torch sort top-k/top-p"


def _top_k_sample(key, y, k):
  values, indices = jax.lax.top_k(y, k)
  choice = jax.random.categorical(key, values)
  return jnp.take_along_axis(indices, choice[:, None], axis=-1)[:, 0]


def _sort_top_p_sample(key, y, p):
  order = jnp.argsort(-y, axis=-1)
  ys = jnp.take_along_axis(y, order, axis=-1)
  probs = jax.nn.softmax(ys, axis=-1)
  ys = jnp.where(jnp.cumsum(probs, axis=-1) - probs < p, ys, -jnp.inf)
  choice = jax.random.categorical(key, ys)
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def peer_ops(filters: dict, temperature: float, vocab: int) -> dict[str, Callable]:
  """The reference ops, each a jitted function of ``[N, V]`` logits."""
  key = jax.random.key(1)
  t = temperature if temperature > 0 else 1.0
  k = min(filters.get("top_k") or DEFAULT_TOP_K, vocab)
  p = filters.get("top_p", 1.0)
  p = p if p < 1 else DEFAULT_TOP_P
  tempered = lambda x: x.astype(jnp.float32) / t
  return {
      "jnp.max (one read)": jax.jit(lambda x: jnp.max(x, axis=-1)),
      "jax.random.categorical": jax.jit(
          lambda x: jax.random.categorical(key, tempered(x))),
      f"lax.top_k({k})+categorical": jax.jit(lambda x: _top_k_sample(key, tempered(x), k)),
      f"sort top-p({p:g})+categorical": jax.jit(
          lambda x: _sort_top_p_sample(key, tempered(x), p)),
  }


def torch_module():
  """torch, imported on request (optional and heavy), or None without torch or CUDA."""
  if not TORCH_AVAILABLE:
    return None
  torch = importlib.import_module("torch")
  return torch if torch.cuda.is_available() else None


def time_torch(fn: Callable, rows: list, iters: int, repeats: int) -> dict:
  """CUDA-event time per call of a torch sampler over rotating rows.

  ``rows`` are JAX arrays, shared with torch through DLPack (no copy); ``fn``
  must not write them.  ``us``: the median over ``repeats`` replays of a CUDA
  graph of ``iters`` calls (device time without Python's launch gaps, as the
  JAX ops' profiler sums); ``wall_us``: the same median over eagerly launched
  blocks.  Where the graph cannot be captured, ``graph`` is False and ``us`` is
  ``wall_us``.
  """
  torch = torch_module()
  tensors = [torch.from_dlpack(x) for x in jax.block_until_ready(rows)]
  for x in tensors[:2]:  # compiles Triton kernels, fills vLLM's caches
    fn(x)
  torch.cuda.synchronize()

  def median_block_us(run_block) -> float:
    times = []
    for r in range(repeats):
      start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
      start.record()
      run_block(r)
      end.record()
      end.synchronize()
      times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)

  def calls(r):
    for i in range(r * iters, (r + 1) * iters):
      fn(tensors[i % len(tensors)])

  wall_us = median_block_us(calls)
  graph = torch.cuda.CUDAGraph()
  try:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture needs a warm-up on a side stream
      fn(tensors[0])
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
      calls(0)
  except RuntimeError as error:  # e.g. an op that syncs with the host
    return dict(us=wall_us, wall_us=wall_us, graph=False, graph_error=str(error)[:300])
  return dict(us=median_block_us(lambda r: graph.replay()), wall_us=wall_us, graph=True)


def torch_sort_sampler(torch, filters: dict, temperature: float) -> Callable:
  """A torch sort-based top-k/top-p/min-p sampler in the style of vLLM's
  fallback: ``[N, V]`` logits -> ``[N]`` tokens (exponential-race sampling)."""
  k, p, min_p = filters.get("top_k", 0), filters.get("top_p", 1.0), filters.get("min_p", 0.0)
  t = temperature if temperature > 0 else 1.0

  def sample(logits):
    logits = logits.float() / t
    if min_p:
      probs = logits.softmax(-1)
      top = probs.max(-1, keepdim=True).values
      logits = logits.masked_fill(probs < min_p * top, float("-inf"))
    if k or p < 1:
      ordered, index = logits.sort(dim=-1, descending=False)
      if k:
        first = ordered.shape[1] - min(k, ordered.shape[1])  # the k-th largest
        kth = ordered[:, first:first + 1]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
      if p < 1:
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - p
        drop[:, -1] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
      logits = ordered.scatter(1, index, ordered)
    probs = logits.softmax(-1)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(-1)

  return sample


def torch_peer(make_sampler: Callable) -> Callable:
  """A runner peer (``factory(filters, temperature) -> op(rows, iters, repeats)``)
  from ``make_sampler(torch, (batch, V), filters, temperature)``, which returns
  a torch sampler of ``[batch, V]`` logits or None where the setting is not the
  peer's; ``op`` is ``time_torch`` of that sampler on the rows, or None (nothing
  timed) without a sampler or without torch on CUDA."""

  def for_case(filters: dict, temperature: float) -> Callable:
    def op(rows, iters, repeats):
      torch = torch_module()
      if torch is None:
        return None
      sample = make_sampler(torch, tuple(rows[0].shape), filters, temperature)
      return None if sample is None else time_torch(sample, rows, iters, repeats)

    return op

  return for_case


def torch_sort_op(filters: dict, temperature: float) -> Callable:
  """``op(rows, iters, repeats)``: ``time_torch`` of the torch sort-based
  sampler, or None without torch or a CUDA device."""
  make = lambda torch, shape, filters, temperature: torch_sort_sampler(torch, filters, temperature)
  return torch_peer(make)(filters, temperature)


def resolve_source_copy(path: str | os.PathLike | None, *, project: str, option: str,
                        env_var: str, files, how: str, error: type[Exception]) -> pathlib.Path:
  """A local copy of ``project``'s source for its peers: ``path``, else
  ``$env_var``.  Raises ``error`` naming the fix (``option``, ``env_var``,
  ``how``) when neither is given, the folder is absent or lacks any of
  ``files`` (paths inside the copy, as upstream lays them out)."""
  path = path or os.environ.get(env_var, "")
  if not path:
    raise error(f"the {project} peers need a local copy of {project}'s source: pass "
                f"{option} PATH or set {env_var}; {how}")
  root = pathlib.Path(path)
  if not root.is_dir():
    raise error(f"{option} {str(path)!r}: no such folder; {how}")
  missing = [f for f in files if not (root / f).is_file()]
  if missing:
    raise error(f"{option} {str(path)!r} lacks {missing}: copy these files of "
                f"{project}'s source there at the same paths")
  return root


def source_commit(root: pathlib.Path) -> str | None:
  """The first line of a source copy's ``COMMIT`` file (the upstream version), or None."""
  commit = root / "COMMIT"
  return commit.read_text().strip().splitlines()[0] if commit.is_file() else None
