"""Sampling parameters (per-request arrays) and sampler configuration (static).

``SamplingParams`` is a pytree of ``[B]`` arrays, so it can be passed through
``jax.jit`` and changed per step without recompiling.  ``SamplerConfig`` is a
frozen, hashable dataclass: changing it recompiles.

Out-of-range values
-------------------
``SamplingParams.make`` rejects bad Python values with ``ValueError``.  Values
that reach the sampler as traced arrays are never rejected; they get this
defined meaning (``SamplingParams.canonical``):

========================  ==================================================
temperature < 1e-5, NaN,  greedy (argmax, no noise); ``MIN_TEMPERATURE``
+-inf
top_k <= 0 or >= V        top-k off
top_p >= 1 or NaN         top-p off
top_p <= 0                keeps only the most probable tie group (the p -> 0+
                          limit)
min_p <= 0 or NaN         min-p off
min_p > 1                 treated as 1 (keeps only the most probable group)
========================  ==================================================

Tiny temperatures
-----------------
Temperatures below ``MIN_TEMPERATURE = 1e-5`` (vLLM's rule) sample greedily:
token ``argmax(x)``, logprob 0, the mask a point mass.  ``SamplingParams.make``
accepts them (clients send 1e-8 to mean "almost greedy").  Below that scale
``x / T`` leaves fp32's precision and range for ordinary logits (an ulp of
``25 / 1e-10`` is 2^14 nats, ``1 / T`` overflows below 3e-39), where above it
a valid row's tempered logits overflow only for ``|x| > 3.4e33``.  At T >=
1e-5 the distribution is ``softmax(x / T)`` with ``x / T`` rounded to fp32
(``reference.temper``), and a valid row keeps ``valid = True``.

Direct construction
-------------------
``SamplingParams(...)`` stores what it is given (it is also the pytree node
JAX rebuilds with tracers).  The samplers read it through ``rows(B)``: each
field a Python or array scalar (the same value for every request) or ``[B]``
numbers, cast to its dtype; anything else raises ``ValueError`` naming the
field.  ``from_arrays`` builds ``[B]`` fields from arrays under ``jax.jit``
(no value checks: the canonical rules apply); ``make`` validates Python
values eagerly.  Continuous batching: ``params[rows]`` (index or slice
requests), ``replace_rows``, ``concatenate``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample._src import rng
from jaxsample._src.tuning import Tuning

__all__ = ["IMPLEMENTATIONS", "MIN_TEMPERATURE", "SamplerConfig",
           "SamplingParams", "as_config", "check_setting"]

IMPLEMENTATIONS: tuple[str, ...] = ("auto", "pallas", "xla_search", "xla")

MIN_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (module doc, Tiny temperatures)."""

_FIELDS = (("temperature", jnp.float32), ("top_k", jnp.int32),
           ("top_p", jnp.float32), ("min_p", jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling parameters, each an array of shape ``[B]``.

  Attributes:
    temperature: float32; 0 means greedy, and so does any T below
      ``MIN_TEMPERATURE`` = 1e-5 (module doc).
    top_k: int32; keep the ``k`` most probable tokens (all ties at the k-th
      value kept); ``<= 0`` or ``>= V`` is off.
    top_p: float32; keep the smallest set of most probable tokens whose mass,
      renormalized after min-p and top-k, reaches ``p``; 1 is off.
    min_p: float32; keep tokens with ``p_i >= min_p * p_max``; 0 is off.
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array

  @property
  def batch_size(self) -> int:
    """``B``, the length of the ``[B]`` fields.

    Raises:
      ValueError: fields of different lengths, or only scalar fields (their
        batch size comes from the logits: ``rows(B)``).
    """
    lengths = {np.shape(getattr(self, name))[:1] for name, _ in _FIELDS
               if np.ndim(getattr(self, name))}
    if len(lengths) != 1:
      raise ValueError(
          "SamplingParams fields have lengths "
          f"{self._shapes()}: give every field [B] values (or scalars, "
          "broadcast by rows(B)), e.g. SamplingParams.make(B, ...)")
    return lengths.pop()[0]

  def _shapes(self) -> dict:
    return {name: np.shape(getattr(self, name)) for name, _ in _FIELDS}

  def rows(self, batch_size: int) -> "SamplingParams":
    """Every field as ``[batch_size]`` values of its dtype (float32, int32,
    float32, float32); scalars broadcast.  Works on traced arrays.

    Raises:
      ValueError: naming the field, for None, a non-numeric value, a float
        ``top_k``, or a shape other than ``()`` or ``[batch_size]``; for
        ``self`` not a ``SamplingParams`` (``SamplingParams.rows(x, B)``).
    """
    if not isinstance(self, SamplingParams):
      raise ValueError(
          f"params must be SamplingParams; got {type(self).__name__} (e.g. "
          f"params=SamplingParams.make({batch_size}, temperature=0.7))")
    fields = {}
    for name, dtype in _FIELDS:
      value = getattr(self, name)
      if value is None or isinstance(value, (str, bytes)):
        raise ValueError(f"SamplingParams.{name} is {value!r}: give a number "
                         f"or [B] numbers (SamplingParams.make(B, {name}=...) "
                         "fills defaults)")
      try:
        value = jnp.asarray(value)
      except TypeError as e:
        raise ValueError(f"SamplingParams.{name} must be a number or [B] "
                         f"numbers; got {type(value).__name__}") from e
      kind = value.dtype.kind
      if kind not in "iuf" or (dtype == jnp.int32 and kind == "f"):
        raise ValueError(
            f"SamplingParams.{name} must hold "
            f"{'integers' if dtype == jnp.int32 else 'numbers'}; got dtype "
            f"{value.dtype}")
      if value.shape not in ((), (batch_size,)):
        got = (f"batch size {value.shape[0]}" if value.ndim == 1 else
               f"shape {value.shape}")
        raise ValueError(
            f"SamplingParams.{name} has {got} but the batch has {batch_size} "
            f"rows: give a scalar or [{batch_size}] values (fields: "
            f"{self._shapes()})")
      fields[name] = jnp.broadcast_to(value.astype(dtype), (batch_size,))
    return SamplingParams(**fields)

  @classmethod
  def from_arrays(cls, temperature: Any = 1.0, top_k: Any = 0,
                  top_p: Any = 1.0, min_p: Any = 0.0) -> "SamplingParams":
    """``[B]`` params from arrays or scalars, also under ``jax.jit`` (no
    value checks: out-of-range values follow ``canonical``).  ``B`` is the
    length of the 1-D fields; scalars broadcast.

    Raises:
      ValueError: as ``rows``, or fields of different lengths.
    """
    params = cls(temperature, top_k, top_p, min_p)
    return params.rows(params._length())

  def _length(self) -> int:
    """The first 1-D field's length, or 1 for scalars alone (``rows`` checks
    the others)."""
    lengths = [s[0] for s in self._shapes().values() if len(s) == 1]
    return lengths[0] if lengths else 1

  def __getitem__(self, index) -> "SamplingParams":
    """Requests ``index`` of every field (``params[i]``: one request's
    scalars; ``params[a:b]`` or an index array: rows)."""
    return jax.tree.map(lambda a: jnp.asarray(a)[index], self)

  def __iter__(self):
    """One request's scalars at a time (``params[i]``)."""
    return (self[i] for i in range(self.batch_size))

  def replace_rows(self, index, other: "SamplingParams") -> "SamplingParams":
    """A copy with requests ``index`` (ints, a slice or a bool mask) set to
    ``other``'s (scalars or rows broadcast as ``.at[index].set``)."""
    batch = self.batch_size
    mine, theirs = self.rows(batch), other
    return SamplingParams(**{
        name: getattr(mine, name).at[index].set(
            jnp.asarray(getattr(theirs, name)).astype(dtype))
        for name, dtype in _FIELDS})

  @classmethod
  def concatenate(cls, params: Sequence["SamplingParams"]) -> "SamplingParams":
    """The requests of ``params`` in order (one request's scalars count as
    one row, e.g. ``params[i]``)."""
    if not params:
      raise ValueError("concatenate needs at least one SamplingParams")
    parts = [p.rows(p._length()) for p in params]
    return cls(**{name: jnp.concatenate([getattr(p, name) for p in parts])
                  for name, _ in _FIELDS})

  @classmethod
  def make(cls,
           batch_size: int,
           *,
           temperature: float | Sequence[float] = 1.0,
           top_k: int | Sequence[int] = 0,
           top_p: float | Sequence[float] = 1.0,
           min_p: float | Sequence[float] = 0.0) -> "SamplingParams":
    """Builds validated parameters from Python scalars or per-request sequences.

    Raises:
      ValueError: naming the request and the field, for a temperature that is
        negative or not finite, top_p outside (0, 1], min_p outside [0, 1], a
        non-integer top_k, or a sequence whose length is not ``batch_size``.
    """
    if isinstance(batch_size, bool) or not isinstance(
        batch_size, (int, np.integer)) or batch_size < 0:
      raise ValueError(f"batch_size must be a non-negative int; got {batch_size!r}")
    if isinstance(batch_size, jax.core.Tracer) or any(
        isinstance(v, jax.core.Tracer)
        for v in jax.tree.leaves((temperature, top_k, top_p, min_p))):
      raise ValueError("SamplingParams.make validates Python values eagerly; "
                       "under jax.jit use SamplingParams.from_arrays")
    fields = {}
    for name, value, dtype in (("temperature", temperature, np.float32),
                               ("top_k", top_k, np.int32),
                               ("top_p", top_p, np.float32),
                               ("min_p", min_p, np.float32)):
      values = _per_request(name, value, batch_size)
      for request, v in enumerate(values):
        check_setting(name, request, v)
      if name == "top_k":  # Any integer is valid; outside int32 it means off.
        values = [int(v) if abs(int(v)) < 2**31 else 0 for v in values]
      fields[name] = jnp.asarray(np.asarray(values, dtype=dtype).reshape(
          batch_size))
    return cls(**fields)

  def canonical(self, vocab_size: int) -> "SamplingParams":
    """The jit-safe canonical form (see the module docstring for the rules).

    In the result: temperature is 0 (greedy) or finite and at least
    ``MIN_TEMPERATURE``; top_k is
    0 (off) or in [1, V - 1]; top_p is in [0, 1] with 1 off; min_p is in
    [0, 1] with 0 off.
    """
    t = self.temperature.astype(jnp.float32)
    t = jnp.where((t >= MIN_TEMPERATURE) & jnp.isfinite(t), t, 0.0)
    k = self.top_k.astype(jnp.int32)
    k = jnp.where((k > 0) & (k < vocab_size), k, 0)
    p = self.top_p.astype(jnp.float32)
    p = jnp.where(jnp.isnan(p) | (p >= 1), 1.0, jnp.maximum(p, 0.0))
    m = self.min_p.astype(jnp.float32)
    m = jnp.where(jnp.isnan(m) | (m <= 0), 0.0, jnp.minimum(m, 1.0))
    return SamplingParams(t, k, p, m)

  def truncates(self) -> jax.Array:
    """``[B]`` bool: whether any filter is on (for canonical parameters)."""
    return (self.top_k > 0) | (self.top_p < 1) | (self.min_p > 0)


def _per_request(name: str, value, batch_size: int) -> list:
  if value is None or isinstance(value, (str, bytes)):
    raise ValueError(f"{name}: expected a number or a sequence; got {value!r}"
                     + (f" (leave {name} out for its default)"
                        if value is None else ""))
  if np.ndim(value) == 0:
    return [value] * batch_size
  if np.ndim(value) != 1:
    raise ValueError(f"{name}: expected a scalar or a 1-D sequence; got shape "
                     f"{np.shape(value)}")
  # Keep the caller's objects (np.asarray would turn True into 1).
  values = list(value) if isinstance(value, (list, tuple)) else list(
      np.asarray(value))
  if len(values) != batch_size:
    raise ValueError(f"{name}: got {len(values)} values for batch_size "
                     f"{batch_size}")
  return values


def check_setting(name: str, request, v) -> None:
  """Raises ``ValueError`` naming ``request`` and the field unless ``v`` is a
  valid ``name`` (temperature, top_k, top_p or min_p): ``SamplingParams.make``'s
  rules, for callers that validate one request's settings (a serving loop)."""
  where = f"request {request}: {name}={v!r}"
  if name == "top_k":
    if isinstance(v, (bool, np.bool_)) or not float(v).is_integer():
      raise ValueError(f"{where} must be an integer (<= 0 means off)")
    return
  v = float(v)
  if name == "temperature" and not (math.isfinite(v) and v >= 0):
    raise ValueError(f"{where} must be finite and >= 0 (0 means greedy)")
  if name == "top_p" and not 0 < v <= 1:
    raise ValueError(f"{where} must be in (0, 1] (1 means off)")
  if name == "min_p" and not 0 <= v <= 1:
    raise ValueError(f"{where} must be in [0, 1] (0 means off)")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Static sampler configuration (hashable; changing it recompiles).

  Attributes:
    rng: counter-based generator, ``"philox"`` (fast) or ``"threefry"``
      (bit-compatible with ``jax.random``); see ``jaxsample._src.rng``.
    use_fp64_gumbel: draw the uniform, the Gumbel noise and compare in fp64
      (under scoped x64); default fp32.
    implementation: ``"auto"`` (Pallas kernels on GPU, ``"xla_search"``
      elsewhere), ``"pallas"`` (kernels; interpret mode off GPU),
      ``"xla_search"`` (XLA without a sort: ``jaxsample._src.xla_search``) or
      ``"xla"`` (the sort-based reference, ``jaxsample._src.reference``); see
      ``docs/backends.md``.
    tuning: launch configs of the Pallas kernels that override the device's
      (``jaxsample._src.tuning``: a kernel left None takes the measured
      entry of the device, else the heuristic); None: none overridden.
    max_mask_ids: ``K_cap``, the static width of ``SamplingMask.ids`` (kept
      ids listed per row; see ``jaxsample._src.mask``), >= 1.
    max_candidates: candidate buffer per row of the truncated-sampling
      kernels (a power of 2 >= 16); rows whose kept set is larger take the
      window and pivot searches (``jaxsample._src.pallas.threshold``).
    kernel_bitmask: on the kernel route, read a grammar bitmask that is the
      only processor changing the logits inside the kernels' passes
      (``jaxsample._src.pallas.bitmask``) instead of the XLA pre-pass; off by
      default until its lowering is checked on a GPU.
    logprobs: ``sample`` returns the sampled tokens' logprobs (default;
      other entry points ignore this field).  False:
      ``SampleResult.logprobs`` is None; the tokens are the same.
    batch_invariant: the kernels plan every batch as one row (vocab splits
      and warps as at B = 1), so a row's logprobs and masks are bit-identical
      at any batch size, index and padding (its tokens always are; the XLA
      backends always are bit-identical).  Off by default: slower at large
      B (an H200, V = 151936 fp32: plain 42.0 against 68.4 us at B = 128,
      ``benchmarks/results/2026-11-29e-h200-batch-invariant-plans``).
  """

  rng: str = "philox"
  use_fp64_gumbel: bool = False
  implementation: str = "auto"
  tuning: Tuning | None = None
  max_mask_ids: int = 1024
  max_candidates: int = 1024
  kernel_bitmask: bool = False
  logprobs: bool = True
  batch_invariant: bool = False

  def __post_init__(self):
    if self.rng not in rng.GENERATORS:
      raise ValueError(f"rng must be one of {rng.GENERATORS}; got {self.rng!r}")
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got "
                       f"{self.implementation!r}")
    if self.max_candidates < 16 or self.max_candidates & (
        self.max_candidates - 1):
      raise ValueError(f"max_candidates must be a power of 2 >= 16; got "
                       f"{self.max_candidates}")
    if self.tuning is not None and not isinstance(self.tuning, Tuning):
      raise ValueError(f"tuning must be a jaxsample._src.tuning.Tuning or "
                       f"None; got {self.tuning!r}")
    if not isinstance(self.kernel_bitmask, bool):
      raise ValueError(f"kernel_bitmask must be a bool; got "
                       f"{self.kernel_bitmask!r}")
    if not isinstance(self.logprobs, bool):
      raise ValueError(f"logprobs must be a bool; got {self.logprobs!r}")
    if not isinstance(self.batch_invariant, bool):
      raise ValueError(f"batch_invariant must be a bool; got "
                       f"{self.batch_invariant!r}")
    if isinstance(self.max_mask_ids, bool) or not isinstance(
        self.max_mask_ids, (int, np.integer)) or self.max_mask_ids < 1:
      raise ValueError(f"max_mask_ids must be an int >= 1; got "
                       f"{self.max_mask_ids!r}")


def as_config(config: SamplerConfig | str | None) -> SamplerConfig:
  """The ``SamplerConfig`` a sampler's ``config`` argument names: None gives
  the default, an implementation name (``"xla"``, ``"pallas"``, ``"auto"``)
  the default with that implementation.

  Raises:
    ValueError: for anything else, naming the accepted forms.
  """
  if config is None:
    return SamplerConfig()
  if isinstance(config, SamplerConfig):
    return config
  if isinstance(config, str) and config in IMPLEMENTATIONS:
    return SamplerConfig(implementation=config)
  raise ValueError(
      f"config must be a SamplerConfig, one of {IMPLEMENTATIONS} or None; got "
      f"{config!r} (e.g. config=SamplerConfig(implementation='xla'))")
