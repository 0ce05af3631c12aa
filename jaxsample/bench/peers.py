"""Reference ops timed beside jaxsample in every suite, on the same rows.

* ``jnp.max (one read)``: XLA's row max, the logits read once and nothing
  else: what a plain read costs (the HBM floor's practical counterpart);
* ``jax.random.categorical``: JAX's own sampler on ``x / T`` (no filters);
* ``lax.top_k(K)+categorical``: top-k by ``lax.top_k``, then categorical;
* ``sort top-p(P)+categorical``: a sort-based top-p (argsort, softmax,
  cumsum), then categorical;
* ``torch sort top-k/top-p`` (opt-in): a torch sort-based sampler in the style
  of vLLM's fallback, timed with CUDA events on the same GPU.

``K`` and ``P`` are the case's top-k and top-p, or 50 and 0.9 where it has none.
"""

from __future__ import annotations

import importlib
import importlib.util
import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TORCH_AVAILABLE", "peer_ops", "torch_time_us"]

DEFAULT_TOP_K = 50
DEFAULT_TOP_P = 0.9
TORCH_AVAILABLE = importlib.util.find_spec("torch") is not None


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


def torch_time_us(inputs: list, filters: dict, temperature: float, iters: int = 30):
  """Median CUDA-event time (us) of a torch sort-based top-k/top-p/min-p sampler
  on the first 4 inputs, or None without torch or a CUDA device."""
  if not TORCH_AVAILABLE:
    return None
  torch = importlib.import_module("torch")  # optional and heavy: loaded on request
  if not torch.cuda.is_available():
    return None
  k, p, min_p = filters.get("top_k", 0), filters.get("top_p", 1.0), filters.get("min_p", 0.0)
  t = temperature if temperature > 0 else 1.0
  tensors = [torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda() for x in inputs[:4]]
  if inputs[0].dtype == jnp.bfloat16:
    tensors = [x.bfloat16() for x in tensors]

  def sample(logits):
    logits = logits.float() / t
    if min_p:
      probs = logits.softmax(-1)
      top = probs.max(-1, keepdim=True).values
      logits = logits.masked_fill(probs < min_p * top, float("-inf"))
    if k or p < 1:
      ordered, index = logits.sort(dim=-1, descending=False)
      if k:
        kth = ordered.gather(1, torch.full((ordered.shape[0], 1), ordered.shape[1] - k,
                                           device=ordered.device))
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
      if p < 1:
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - p
        drop[:, -1] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
      logits = ordered.scatter(1, index, ordered)
    probs = logits.softmax(-1)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(-1)

  for x in tensors:
    sample(x)
  times = []
  for i in range(iters):
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    sample(tensors[i % len(tensors)])
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) * 1e3)
  return statistics.median(times)
