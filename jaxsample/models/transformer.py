"""A small Flax NNX causal transformer with RoPE, RMSNorm, GQA and a KV cache.

The model follows the generation contract of ``jaxsample.serve_loop``
(``docs/generation.md``): ``model(tokens, positions, cache)`` returns
``(logits, cache)`` where ``tokens`` and ``positions`` are ``[B, S]`` int32,
``logits`` is ``[B, S, V]`` fp32 and ``cache`` is a ``KVCache`` (or ``None``
for plain causal training over the ``S`` tokens).

With a cache, each row's ``S`` new keys/values are written at that row's
slots ``positions[b, 0] .. positions[b, 0] + S - 1`` (contiguous positions),
and query ``i`` of row ``b`` attends to cache slots ``j <= positions[b, i]``.
Attention always spans the whole cache length ``T``, so a row's arithmetic
has the same shapes whatever the prompt bucket, the other rows or the step.

The same module covers the Llama 3.x and Qwen2/Qwen2.5 architectures of
Hugging Face checkpoints (``jaxsample.models.hf``): ``qkv_bias`` adds the
query/key/value biases of Qwen2, ``rope_scaling`` the ``llama3`` RoPE
frequency scaling of Llama 3.1+, ``tie_embeddings=False`` a separate head.
With a ``mesh`` the module constrains its activations and cache to the
tensor- and data-parallel layout of ``jaxsample.models.sharding``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsample.models import sharding

__all__ = ["KVCache", "Transformer", "TransformerConfig", "fill_params",
           "rope_frequencies"]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Shape and numerics of a ``Transformer`` (JSON-serializable fields)."""

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  mlp_dim: int
  max_len: int
  rope_base: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  dtype: str = "float32"  # parameters and activations; logits are fp32
  qkv_bias: bool = False  # biases on the query, key and value projections
  # Llama 3.1's "llama3" RoPE scaling: (factor, low_freq_factor,
  # high_freq_factor, original_max_position_embeddings); None: plain RoPE.
  rope_scaling: tuple[float, float, float, float] | None = None

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def __post_init__(self):
    if self.rope_scaling is not None:  # JSON gives a list: keep it hashable
      if len(self.rope_scaling) != 4:
        raise ValueError(
            "rope_scaling must be (factor, low_freq_factor, high_freq_factor, "
            f"original_max_position_embeddings); got {self.rope_scaling!r}")
      object.__setattr__(self, "rope_scaling",
                         tuple(float(v) for v in self.rope_scaling))
    if self.d_model % self.num_heads or self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"d_model ({self.d_model}) must divide by num_heads "
          f"({self.num_heads}), and num_heads by num_kv_heads "
          f"({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Per-layer keys and values, each a tuple of ``[B, T, KV heads, head_dim]``."""

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]

  @classmethod
  def zeros(cls, config: TransformerConfig, batch_size: int,
            length: int) -> "KVCache":
    shape = (batch_size, length, config.num_kv_heads, config.head_dim)
    make = lambda: tuple(jnp.zeros(shape, config.dtype)
                         for _ in range(config.num_layers))
    return cls(make(), make())

  @property
  def length(self) -> int:
    return self.keys[0].shape[1]


def rope_frequencies(head_dim: int, base: float,
                     scaling: tuple[float, float, float, float] | None = None
                     ) -> jax.Array:
  """``[head_dim / 2]`` fp32 rotation frequencies ``base**(-2i/D)``.

  With ``scaling = (factor, low, high, original)`` (Hugging Face's
  ``llama3`` rope type), a frequency whose wavelength ``2 pi / f`` exceeds
  ``original / low`` is divided by ``factor``, one below ``original / high``
  is kept, and one between is interpolated: ``(1 - s) f / factor + s f``
  with ``s = (original / wavelength - low) / (high - low)``.
  """
  half = head_dim // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if scaling is None:
    return freq
  factor, low, high, original = scaling
  wavelength = 2 * math.pi / freq
  smooth = (original / wavelength - low) / (high - low)
  between = (1 - smooth) * freq / factor + smooth * freq
  return jnp.where(wavelength > original / low, freq / factor,
                   jnp.where(wavelength < original / high, freq, between))


def rope(x: jax.Array, positions: jax.Array, base: float,
         scaling: tuple[float, float, float, float] | None = None
         ) -> jax.Array:
  """Rotary embedding of ``x`` ``[B, S, H, D]`` at ``positions`` ``[B, S]``.

  Pairs (``x[..., i]``, ``x[..., i + D/2]``) rotate by ``pos * f_i`` for the
  frequencies ``f`` of ``rope_frequencies(D, base, scaling)`` (Hugging
  Face's ``rotate_half`` layout).
  """
  freq = rope_frequencies(x.shape[-1], base, scaling)
  angle = positions.astype(jnp.float32)[..., None, None] * freq
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def write_rows(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
  """Writes ``new`` ``[B, S, ...]`` into ``cache`` ``[B, T, ...]`` at ``starts``."""
  write = lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=0)
  return jax.vmap(write)(cache, new.astype(cache.dtype), starts)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE; attends over the cache if given."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    dim, hd = config.d_model, config.head_dim
    linear = lambda n_in, n_out, bias=False: nnx.Linear(
        n_in, n_out, use_bias=bias, dtype=config.dtype,
        param_dtype=config.dtype, rngs=rngs)
    self.query = linear(dim, config.num_heads * hd, config.qkv_bias)
    self.key = linear(dim, config.num_kv_heads * hd, config.qkv_bias)
    self.value = linear(dim, config.num_kv_heads * hd, config.qkv_bias)
    self.out = linear(config.num_heads * hd, dim)

  def __call__(self, x, positions, layer_cache):
    c = self.config
    b, s, _ = x.shape
    q = rope(self.query(x).reshape(b, s, c.num_heads, c.head_dim), positions,
             c.rope_base, c.rope_scaling)
    k = rope(self.key(x).reshape(b, s, c.num_kv_heads, c.head_dim), positions,
             c.rope_base, c.rope_scaling)
    v = self.value(x).reshape(b, s, c.num_kv_heads, c.head_dim)
    if layer_cache is None:
      key_positions = positions
    else:
      k = write_rows(layer_cache[0], k, positions[:, 0])
      v = write_rows(layer_cache[1], v, positions[:, 0])
      key_positions = jnp.broadcast_to(jnp.arange(k.shape[1]), (b, k.shape[1]))
    group = c.num_heads // c.num_kv_heads
    q = q.reshape(b, s, c.num_kv_heads, group, c.head_dim)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k,
                        preferred_element_type=jnp.float32)
    scores = scores * (c.head_dim ** -0.5)
    visible = key_positions[:, None, :] <= positions[:, :, None]  # [B, S, T]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    attended = jnp.einsum("bkgst,btkd->bskgd", weights, v)
    out = self.out(attended.reshape(b, s, c.num_heads * c.head_dim))
    return out, (None if layer_cache is None else (k, v))


class MLP(nnx.Module):
  """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    linear = lambda n_in, n_out: nnx.Linear(
        n_in, n_out, use_bias=False, dtype=config.dtype,
        param_dtype=config.dtype, rngs=rngs)
    self.gate = linear(config.d_model, config.mlp_dim)
    self.up = linear(config.d_model, config.mlp_dim)
    self.down = linear(config.mlp_dim, config.d_model)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-norm residual block: attention then MLP."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    norm = lambda: nnx.RMSNorm(config.d_model, epsilon=config.norm_eps,
                               dtype=config.dtype, param_dtype=config.dtype,
                               rngs=rngs)
    self.attention_norm = norm()
    self.attention = Attention(config, rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, positions, layer_cache):
    attended, layer_cache = self.attention(self.attention_norm(x), positions,
                                           layer_cache)
    x = x + attended
    return x + self.mlp(self.mlp_norm(x)), layer_cache


class Transformer(nnx.Module):
  """Decoder-only transformer: ``(tokens, positions, cache) -> (logits, cache)``.

  ``mesh``: None, or a ``jax.sharding.Mesh`` whose axes ``"data"`` and
  ``"model"`` (either may be absent) lay out the activations, the cache and
  the logits (``jaxsample.models.sharding``); the weights' layout is the
  loader's (``sharding.param_spec``).
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs,
               mesh: jax.sharding.Mesh | None = None):
    self.config = config
    self.mesh = mesh
    self.embed = nnx.Embed(config.vocab_size, config.d_model,
                           dtype=config.dtype, param_dtype=config.dtype,
                           embedding_init=nnx.initializers.normal(0.02),
                           rngs=rngs)
    self.blocks = nnx.List([Block(config, rngs=rngs)
                            for _ in range(config.num_layers)])
    self.final_norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps,
                                  dtype=config.dtype,
                                  param_dtype=config.dtype, rngs=rngs)
    if not config.tie_embeddings:
      self.head = nnx.Linear(config.d_model, config.vocab_size,
                             use_bias=False, dtype=config.dtype,
                             param_dtype=config.dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array,
               cache: KVCache | None = None):
    x = self._constrain(self.embed(tokens), sharding.activation_spec())
    keys, values = [], []
    for i, block in enumerate(self.blocks):
      layer_cache = None if cache is None else (cache.keys[i], cache.values[i])
      x, layer_cache = block(x, positions, layer_cache)
      if cache is not None:
        keys.append(layer_cache[0])
        values.append(layer_cache[1])
    x = self.final_norm(x)
    if self.config.tie_embeddings:
      logits = self.embed.attend(x)
    else:
      logits = self.head(x)
    logits = self._constrain(logits.astype(jnp.float32),
                             sharding.activation_spec())
    new_cache = None if cache is None else KVCache(tuple(keys), tuple(values))
    return logits, new_cache

  def init_cache(self, batch_size: int, length: int) -> KVCache:
    cache = KVCache.zeros(self.config, batch_size, length)
    return self._constrain(cache, sharding.cache_spec(self.config, self.mesh))

  def _constrain(self, tree, spec):
    """``tree`` constrained to ``spec`` on ``self.mesh`` (as is without one)."""
    if self.mesh is None:
      return tree
    named = jax.sharding.NamedSharding(
        self.mesh, sharding.fit_spec(spec, self.mesh))
    return jax.tree.map(
        lambda a: jax.lax.with_sharding_constraint(a, named), tree)


def fill_params(model: nnx.Module, load: Any) -> nnx.Module:
  """Sets every ``nnx.Param`` of ``model`` (an ``nnx.eval_shape`` skeleton)
  to ``load(name, shape_dtype)``, ``name`` its ``param_name``, one
  parameter at a time; returns ``model``."""
  state = nnx.state(model, nnx.Param)
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  leaves = [load(param_name(path), leaf) for path, leaf in flat]
  nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))
  return model


def param_name(path) -> str:
  """The dotted name of a state path: the module path, then the Variable's
  ``.value`` (``blocks.0.mlp.up.kernel..value``, the names of the embedded
  models' files)."""
  return ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
