"""Tensor- and data-parallel layouts of a ``Transformer`` on a device mesh.

A mesh with the axis ``"model"`` splits the weights Megatron-style:
column-parallel ``query``/``key``/``value``/``gate``/``up`` (their output
features and biases), row-parallel ``out``/``down`` (their input features),
vocab-parallel ``embed`` and ``head``; norms are replicated.  A mesh with the
axis ``"data"`` splits the batch of the activations, the KV cache and the
logits.  A dimension that the axis size does not divide (e.g. 2 KV heads on
4 devices) stays replicated, so any mesh gives a valid layout; GSPMD inserts
the collectives.  The values are those of one device up to the summation
order of the row-parallel matmuls' all-reduces.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["DATA", "MODEL", "activation_spec", "cache_spec", "fit_spec",
           "param_spec"]

DATA, MODEL = "data", "model"

# Parameter name suffix -> the axis of the parameter split over MODEL and
# the config field whose count that axis must divide (heads, not features,
# so that no attention head straddles two devices).
_SPLITS = {
    "attention.query.kernel": (1, "num_heads"),
    "attention.query.bias": (0, "num_heads"),
    "attention.key.kernel": (1, "num_kv_heads"),
    "attention.key.bias": (0, "num_kv_heads"),
    "attention.value.kernel": (1, "num_kv_heads"),
    "attention.value.bias": (0, "num_kv_heads"),
    "attention.out.kernel": (0, "num_heads"),
    "mlp.gate.kernel": (1, "mlp_dim"),
    "mlp.up.kernel": (1, "mlp_dim"),
    "mlp.down.kernel": (0, "mlp_dim"),
    "embed.embedding": (0, "vocab_size"),
    "head.kernel": (1, "vocab_size"),
}


def _model_size(mesh) -> int:
  return dict(zip(mesh.axis_names, mesh.devices.shape)).get(MODEL, 1)


def param_spec(name: str, ndim: int, config, mesh: jax.sharding.Mesh) -> P:
  """The ``PartitionSpec`` of parameter ``name`` (its dotted NNX path) of a
  ``Transformer`` with ``config`` on ``mesh`` (module doc)."""
  size = _model_size(mesh)
  for suffix, (axis, field) in _SPLITS.items():
    if name.endswith(suffix) and size > 1 and getattr(config, field) % size == 0:
      return P(*(MODEL if i == axis else None for i in range(ndim)))
  return P()


def activation_spec() -> P:
  """Activations ``[B, S, ...]`` and logits: the batch over ``"data"``."""
  return P(DATA)


def cache_spec(config, mesh: jax.sharding.Mesh | None) -> P:
  """Cache leaves ``[B, T, KV heads, head_dim]``: the batch over
  ``"data"``, the KV heads over ``"model"`` where it divides them."""
  if mesh is None:
    return P(DATA)
  size = _model_size(mesh)
  heads = MODEL if size > 1 and config.num_kv_heads % size == 0 else None
  return P(DATA, None, heads, None)


def fit_spec(spec: P, mesh: jax.sharding.Mesh) -> P:
  """``spec`` without the axis names that ``mesh`` lacks."""
  return P(*(axis if axis in mesh.axis_names else None for axis in spec))
