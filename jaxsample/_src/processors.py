"""Per-request logits processing before the sampler (``docs/processing.md``).

``LogitsProcessors`` is a pytree of per-request arrays; every field is
optional (None: that processor is off and costs nothing; the pytree structure
is static, so jit specializes on which fields are present).  Id lists are
fixed-width ``[B, N]`` int32 arrays padded with -1; ids outside ``[0, V)`` are
ignored.  ``apply_processors(logits, processors)`` returns fp32 logits ``z``:

1. ``x`` = logits in fp32; ``x[b, i] += logit_bias[b, i]`` for each listed
   ``(bias_ids, bias_values)`` pair (repeated ids add up).
2. Penalties (vLLM's ``apply_penalties``), with ``c_i`` the count of id ``i``
   among the output tokens and ``s_i`` whether ``i`` is among the prompt or
   output tokens::

     r_i = x_i / rep   if s_i and x_i > 0
           x_i * rep   if s_i and x_i <= 0
           x_i         otherwise
     z_i = r_i - frequency * c_i - presence * [c_i > 0]

   in fp32, left to right, every operation rounded (a product is rounded
   before it is subtracted: no fused multiply-add).

3. Masks (each sets ``z_i = -inf``): ids outside a row's ``allowed_ids``
   (rows listing no id allow every id), ``banned_ids``, ids whose bit is 0 in
   the grammar ``bitmask`` (bit ``j`` of word ``w`` allows id ``32 w + j``,
   xgrammar's layout; bits past ``V`` are ignored), and ``stop_ids`` while
   ``num_output < min_tokens``.

Order: vLLM v1 applies the grammar bitmask in the model runner, then, in its
sampler, allowed ids, bad words, min tokens, logit bias, penalties, then
temperature and the filters.  The masks only write -inf, which the bias and
the penalties keep (finite biases and penalties), so applying them last gives
vLLM's result; it also makes a masked entry exactly -inf
(``apply_processors`` applies the allowed and bitmask masks in the pass
that makes the fp32 copy and keeps their entries -inf through the bias and
the penalties: the same result, with no pass of their own).  A row with
every entry masked has no finite logit: the sampler marks it invalid (token
0, logprob -inf), its defined result.

Traced values that are out of range get a defined meaning
(``LogitsProcessors.canonical``): a repetition penalty that is not a finite
positive number is off (1); NaN or infinite presence/frequency penalties are
off (0); biases are clipped to ``[-100, 100]`` (OpenAI's range; NaN is 0);
``min_tokens`` < 0 is 0.  ``LogitsProcessors.make`` rejects them instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_BIAS", "NEUTRAL", "LogitsProcessors", "apply_processors",
           "apply_to_slots", "bitmask_allows", "bitmask_width", "maybe_apply",
           "neutral_field", "pack_bitmask", "require_processors", "slot_rows"]

MAX_BIAS = 100.0
"""Biases are clipped to ``[-MAX_BIAS, MAX_BIAS]`` (OpenAI's range)."""

NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "bias_values": 0.0, "min_tokens": 0,
           "num_output": 0, "bias_ids": -1, "allowed_ids": -1,
           "banned_ids": -1, "stop_ids": -1, "prompt_ids": -1,
           "output_ids": -1, "bitmask": -1}
"""Each ``LogitsProcessors`` field's neutral value: a row (or id-list entry)
padded with it changes nothing (-1: no id; a bitmask word of -1 allows all
32 ids).  Float fields are float32, the rest int32."""


def neutral_field(name: str, shape) -> np.ndarray:
  """A numpy ``shape`` array of field ``name``'s neutral value and dtype."""
  fill = NEUTRAL[name]
  return np.full(shape, fill, np.float32 if isinstance(fill, float)
                 else np.int32)


_ROW_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty",
               "min_tokens", "num_output")
_ID_FIELDS = ("bias_ids", "allowed_ids", "banned_ids", "stop_ids",
              "prompt_ids", "output_ids")


def bitmask_width(vocab_size: int) -> int:
  """Words per row of a packed bitmask: ``ceil(V / 32)``."""
  return -(-vocab_size // 32)


def pack_bitmask(allowed) -> jax.Array:
  """``int32 [B, ceil(V / 32)]`` bitmask of bool ``allowed`` ``[B, V]``: bit
  ``j`` of word ``w`` is ``allowed[:, 32 w + j]`` (0 past ``V``)."""
  allowed = jnp.asarray(allowed, bool)
  batch, vocab = allowed.shape
  width = bitmask_width(vocab)
  bits = jnp.pad(allowed, ((0, 0), (0, 32 * width - vocab)))
  bits = bits.reshape(batch, width, 32).astype(jnp.uint32)
  words = jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1,
                  dtype=jnp.uint32)
  return jax.lax.bitcast_convert_type(words, jnp.int32)


def bitmask_allows(bitmask: jax.Array, vocab: int) -> jax.Array:
  """bool ``[B, V]``: bit ``v % 32`` of word ``v // 32`` (fuses into the
  elementwise pass: a broadcast, a shift and a reshape)."""
  words = jax.lax.bitcast_convert_type(bitmask, jnp.uint32)
  bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
  return bits.reshape(bitmask.shape[0], -1)[:, :vocab] != 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsProcessors:
  """Per-request processing (module doc: the exact math); every field None
  (off) or an array with the request axis first.

  Attributes:
    repetition_penalty: ``[B]`` float32, 1 is off.
    presence_penalty: ``[B]`` float32, 0 is off.
    frequency_penalty: ``[B]`` float32, 0 is off.
    bias_ids: ``[B, NB]`` int32 ids (-1 padding); ``bias_values`` ``[B, NB]``
      float32 the biases added to them.
    allowed_ids: ``[B, NA]`` int32; a row listing ids allows only those.
    banned_ids: ``[B, NN]`` int32 ids never sampled.
    bitmask: ``[B, ceil(V / 32)]`` int32 packed grammar bitmask.
    min_tokens: ``[B]`` int32; ``stop_ids`` ``[B, S]`` int32 are banned while
      ``num_output < min_tokens``.
    prompt_ids: ``[B, HP]`` int32 prompt tokens (repetition penalty).
    output_ids: ``[B, HO]`` int32 tokens generated so far (all penalties;
      a request generating more than ``HO`` tokens needs a wider array for
      exact counts: ``append_output`` drops tokens past the width).
    num_output: ``[B]`` int32 tokens generated so far (min tokens); None:
      the count of ids >= 0 in ``output_ids``.
  """

  repetition_penalty: jax.Array | None = None
  presence_penalty: jax.Array | None = None
  frequency_penalty: jax.Array | None = None
  bias_ids: jax.Array | None = None
  bias_values: jax.Array | None = None
  allowed_ids: jax.Array | None = None
  banned_ids: jax.Array | None = None
  bitmask: jax.Array | None = None
  min_tokens: jax.Array | None = None
  stop_ids: jax.Array | None = None
  prompt_ids: jax.Array | None = None
  output_ids: jax.Array | None = None
  num_output: jax.Array | None = None

  @property
  def penalizes(self) -> bool:
    """Whether any penalty field is present (static)."""
    return any(getattr(self, name) is not None for name in
               ("repetition_penalty", "presence_penalty", "frequency_penalty"))

  def check(self, batch_size: int, vocab_size: int | None) -> None:
    """Raises ``ValueError`` naming the field for shapes that do not fit
    ``[B, V]`` logits or missing partners (static checks; jit-safe;
    ``vocab_size`` None: the bitmask's width is not checked)."""
    for name in _ROW_FIELDS + _ID_FIELDS + ("bias_values", "bitmask"):
      value = getattr(self, name)
      if value is None:
        continue
      shape = np.shape(value)
      want_rank = 1 if name in _ROW_FIELDS else 2
      if len(shape) != want_rank or shape[0] != batch_size:
        raise ValueError(
            f"LogitsProcessors.{name} has shape {shape}; for {batch_size} "
            f"rows give [{batch_size}]" + ("" if want_rank == 1 else
                                           ", N] (-1 padding)"))
      kind = jnp.asarray(value).dtype.kind
      if name in _ID_FIELDS + ("min_tokens", "num_output", "bitmask"):
        if kind not in "iu":
          raise ValueError(f"LogitsProcessors.{name} must hold integers; got "
                           f"dtype {jnp.asarray(value).dtype}")
      elif kind not in "iuf":
        raise ValueError(f"LogitsProcessors.{name} must hold numbers; got "
                         f"dtype {jnp.asarray(value).dtype}")
    if (self.bias_ids is None) != (self.bias_values is None) or (
        self.bias_ids is not None and
        np.shape(self.bias_ids) != np.shape(self.bias_values)):
      raise ValueError("LogitsProcessors.bias_ids and bias_values go together "
                       "with equal shapes [B, NB]")
    if (self.min_tokens is None) != (self.stop_ids is None):
      raise ValueError("LogitsProcessors.min_tokens needs stop_ids (and "
                       "stop_ids min_tokens): give both")
    if self.min_tokens is not None and self.output_ids is None and (
        self.num_output is None):
      raise ValueError("LogitsProcessors.min_tokens needs num_output (or "
                       "output_ids) to count the tokens generated; "
                       "LogitsProcessors.make sets it")
    if self.bitmask is not None and vocab_size is not None and np.shape(
        self.bitmask)[1] != bitmask_width(vocab_size):
      raise ValueError(
          f"LogitsProcessors.bitmask has {np.shape(self.bitmask)[1]} words per "
          f"row; V = {vocab_size} needs ceil(V / 32) = "
          f"{bitmask_width(vocab_size)}")

  def canonical(self) -> "LogitsProcessors":
    """Out-of-range values mapped to their defined meaning (module doc)."""
    def floats(a):
      return None if a is None else jnp.asarray(a).astype(jnp.float32)
    rep, pres, freq, bias = map(floats, (
        self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
        self.bias_values))
    if rep is not None:
      rep = jnp.where(jnp.isfinite(rep) & (rep > 0), rep, 1.0)
    pres, freq = (None if a is None else jnp.where(jnp.isfinite(a), a, 0.0)
                  for a in (pres, freq))
    if bias is not None:
      bias = jnp.clip(jnp.nan_to_num(bias, nan=0.0), -MAX_BIAS, MAX_BIAS)
    ints = {name: None if getattr(self, name) is None else jnp.asarray(
        getattr(self, name)).astype(jnp.int32) for name in
            _ID_FIELDS + ("min_tokens", "num_output", "bitmask")}
    if ints["min_tokens"] is not None:
      ints["min_tokens"] = jnp.maximum(ints["min_tokens"], 0)
    return LogitsProcessors(repetition_penalty=rep, presence_penalty=pres,
                            frequency_penalty=freq, bias_values=bias, **ints)

  def output_count(self) -> jax.Array:
    """``[B]`` tokens generated so far (``num_output``, or the listed ids)."""
    if self.num_output is not None:
      return jnp.asarray(self.num_output, jnp.int32)
    return jnp.sum(jnp.asarray(self.output_ids) >= 0, axis=-1,
                   dtype=jnp.int32)

  def append_output(self, tokens: jax.Array, emitted: jax.Array
                    ) -> "LogitsProcessors":
    """After a decode step: ``tokens`` ``[B]`` appended to ``output_ids``
    (at slot ``num_output``) where ``emitted`` ``[B]``; ``num_output``
    advances.  Tokens past the width are counted in ``num_output`` only.
    Processors tracking neither (no ``output_ids``, no ``num_output``) are
    returned as they are; ``make`` sets ``num_output`` wherever outputs
    matter, so a decode loop's carry keeps its structure."""
    if self.output_ids is None and self.num_output is None:
      return self
    count = self.output_count()
    num_output = count + emitted.astype(jnp.int32)
    if self.output_ids is None:
      return dataclasses.replace(self, num_output=num_output)
    rows = jnp.arange(count.shape[0])
    slot = jnp.where(emitted, count, self.output_ids.shape[1])
    output = self.output_ids.at[rows, slot].set(
        tokens.astype(jnp.int32), mode="drop")
    return dataclasses.replace(self, output_ids=output, num_output=num_output)

  @classmethod
  def make(cls, batch_size: int, *,
           repetition_penalty: float | Sequence[float] | None = None,
           presence_penalty: float | Sequence[float] | None = None,
           frequency_penalty: float | Sequence[float] | None = None,
           logit_bias: Sequence[Mapping[int, float] | None] | None = None,
           allowed_token_ids: Sequence[Sequence[int] | None] | None = None,
           banned_token_ids: Sequence[Sequence[int] | None] | None = None,
           min_tokens: int | Sequence[int] | None = None,
           stop_token_ids: Sequence[Sequence[int] | None] | None = None,
           prompt_token_ids: Sequence[Sequence[int] | None] | None = None,
           output_token_ids: Sequence[Sequence[int] | None] | None = None,
           history_width: int | None = None,
           bitmask=None) -> "LogitsProcessors":
    """Validated processors from Python values (per request: a scalar for
    all or one value per request; id lists per request, None for none).
    ``history_width``: the width of ``output_ids`` (room for the tokens a
    decode loop appends; default: the longest list).

    Raises:
      ValueError: naming the field and request, for a repetition penalty
        not finite and > 0, a non-finite presence/frequency penalty, a bias
        outside ``[-100, 100]``, a negative id or min_tokens, or a list
        count that is not ``batch_size``.
    """
    def rows(name, value, dtype, check):
      if value is None:
        return None
      values = [value] * batch_size if np.ndim(value) == 0 else list(value)
      if len(values) != batch_size:
        raise ValueError(f"{name}: got {len(values)} values for batch_size "
                         f"{batch_size}")
      for request, v in enumerate(values):
        if not check(v):
          raise ValueError(f"request {request}: {name}={v!r} is out of range "
                           "(see jaxsample._src.processors)")
      return jnp.asarray(np.asarray(values, dtype))

    def lists(name, value, width=None):
      if value is None:
        return None
      if len(value) != batch_size:
        raise ValueError(f"{name}: got {len(value)} lists for batch_size "
                         f"{batch_size}")
      value = [list(v or ()) for v in value]
      for request, ids in enumerate(value):
        if any(int(i) != i or i < 0 for i in ids):
          raise ValueError(f"request {request}: {name} must be ids >= 0; got "
                           f"{ids}")
      longest = max(map(len, value), default=0)
      width = max(longest, 1) if width is None else width
      if width < longest:
        raise ValueError(f"history_width={width} is shorter than a list of "
                         f"{longest} {name}")
      out = np.full((batch_size, width), -1, np.int32)
      for request, ids in enumerate(value):
        out[request, :len(ids)] = ids
      return jnp.asarray(out)

    bias_ids = bias_values = None
    if logit_bias is not None:
      pairs = [sorted((m or {}).items()) for m in logit_bias]
      for request, items in enumerate(pairs):
        if any(not abs(float(b)) <= MAX_BIAS for _, b in items):
          raise ValueError(f"request {request}: logit_bias values must be in "
                           f"[-{MAX_BIAS}, {MAX_BIAS}]; got {dict(items)}")
      bias_ids = lists("logit_bias", [[i for i, _ in p] for p in pairs])
      values = np.zeros(bias_ids.shape, np.float32)
      for request, items in enumerate(pairs):
        values[request, :len(items)] = [b for _, b in items]
      bias_values = jnp.asarray(values)
    if (min_tokens is None) != (stop_token_ids is None):
      raise ValueError("min_tokens needs stop_token_ids (the ids it holds "
                       "back) and stop_token_ids min_tokens: give both")
    history = output_token_ids
    if history is None and history_width is not None:
      history = [None] * batch_size
    output_ids = lists("output_token_ids", history, history_width)
    num_output = None
    if output_ids is not None:
      num_output = jnp.asarray([len(h or ()) for h in history], jnp.int32)
    elif min_tokens is not None:
      num_output = jnp.zeros((batch_size,), jnp.int32)
    return cls(
        repetition_penalty=rows("repetition_penalty", repetition_penalty,
                                np.float32,
                                lambda v: math.isfinite(v) and v > 0),
        presence_penalty=rows("presence_penalty", presence_penalty,
                              np.float32, math.isfinite),
        frequency_penalty=rows("frequency_penalty", frequency_penalty,
                               np.float32, math.isfinite),
        bias_ids=bias_ids, bias_values=bias_values,
        allowed_ids=lists("allowed_token_ids", allowed_token_ids),
        banned_ids=lists("banned_token_ids", banned_token_ids),
        bitmask=None if bitmask is None else jnp.asarray(bitmask, jnp.int32),
        min_tokens=rows("min_tokens", min_tokens, np.int32,
                        lambda v: int(v) == v and v >= 0),
        stop_ids=lists("stop_token_ids", stop_token_ids),
        prompt_ids=lists("prompt_token_ids", prompt_token_ids),
        output_ids=output_ids, num_output=num_output)


def _scatter_ids(ids: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
  """``(rows, cols)`` scatter indices for ``[B, N]`` ids; ids outside ``[0,
  V)`` (padding) point past the row, for ``mode="drop"``."""
  ids = jnp.asarray(ids, jnp.int32)
  cols = jnp.where((ids >= 0) & (ids < vocab), ids, vocab)
  return jax.lax.broadcasted_iota(jnp.int32, ids.shape, 0), cols


def _marks(ids: jax.Array, batch: int, vocab: int) -> jax.Array:
  """bool ``[B, V]``: True at the listed ids (one sparse scatter)."""
  return jnp.zeros((batch, vocab), bool).at[_scatter_ids(ids, vocab)].set(
      True, mode="drop")


@dataclasses.dataclass(frozen=True)
class _Keep:
  """The masks that keep an entry (allowed ids, bitmask): ``where`` over the
  row, or a lookup at listed ids."""

  allowed: jax.Array | None  # bool [B, V]: listed or the row lists none
  bitmask: jax.Array | None  # int32 [B, ceil(V / 32)]

  def row(self, vocab: int) -> jax.Array:
    """bool ``[B, V]``."""
    masks = [] if self.allowed is None else [self.allowed]
    if self.bitmask is not None:
      masks.append(bitmask_allows(self.bitmask, vocab))
    return functools.reduce(jnp.logical_and, masks)

  def at(self, rows: jax.Array, cols: jax.Array) -> jax.Array:
    """bool: ``row()`` at ``(rows, cols)``, ``cols`` in ``[0, V)``."""
    keep = True
    if self.allowed is not None:
      keep = self.allowed[rows, cols]
    if self.bitmask is not None:
      words = jax.lax.bitcast_convert_type(self.bitmask[rows, cols >> 5],
                                           jnp.uint32)
      keep = keep & ((words >> (cols & 31).astype(jnp.uint32)) & 1 != 0)
    return keep


def apply_processors(logits: jax.Array,
                     processors: LogitsProcessors) -> jax.Array:
  """fp32 ``[B, V]`` processed logits (module doc: the math and the order).

  One elementwise pass over the row (the fp32 copy with the allowed and
  bitmask masks applied), then sparse scatters into it: the bias, the
  penalties at the history ids, the banned ids.  Masking first gives the
  module doc's result: a finite bias keeps -inf, and the penalties write
  -inf where a mask does (``_Keep.at``).  No sort over ``V``; no other
  ``[B, V]`` temporary than the allowed marks.
  """
  batch, vocab = logits.shape
  processors.check(batch, vocab)
  p = processors.canonical()
  z = jnp.asarray(logits).astype(jnp.float32)
  keep = None
  if p.allowed_ids is not None or p.bitmask is not None:
    allowed = None
    if p.allowed_ids is not None:
      has_list = jnp.any((p.allowed_ids >= 0) & (p.allowed_ids < vocab),
                         axis=1)
      allowed = _marks(p.allowed_ids, batch, vocab) | ~has_list[:, None]
    keep = _Keep(allowed, p.bitmask)
    z = jnp.where(keep.row(vocab), z, -jnp.inf)
  if p.bias_ids is not None:
    z = z.at[_scatter_ids(p.bias_ids, vocab)].add(p.bias_values, mode="drop")
  if p.penalizes:
    z = _penalize(z, p, keep)
  banned = [] if p.banned_ids is None else [p.banned_ids]
  if p.min_tokens is not None:
    held = p.output_count() < p.min_tokens
    banned.append(jnp.where(held[:, None], p.stop_ids, -1))
  for ids in banned:
    z = z.at[_scatter_ids(ids, vocab)].set(-jnp.inf, mode="drop")
  return z


def _history(p: LogitsProcessors, vocab: int
             ) -> tuple[jax.Array, jax.Array] | None:
  """The ids the penalties change, per row sorted (``[B, H]`` int32; ids
  outside ``[0, V)`` as ``V``, last), each with ``c``, its count among the
  output ids (``[B, H]`` int32); None if no penalty changes a value.

  The prompt ids count only for the repetition penalty (``s_i``); an id
  listed neither way is unchanged (``r_i = x_i``, ``c_i = 0``).
  """
  lists, prompt = [], []
  if p.output_ids is not None:
    lists.append(p.output_ids)
    prompt.append(jnp.zeros(p.output_ids.shape, jnp.int32))
  if p.repetition_penalty is not None and p.prompt_ids is not None:
    lists.append(p.prompt_ids)
    prompt.append(jnp.ones(p.prompt_ids.shape, jnp.int32))
  if not lists:
    return None
  ids = jnp.concatenate(lists, axis=1)
  # One int32 sort key per entry: its id (V outside [0, V)), then 0 for
  # an output entry, 1 for a prompt entry (2 V + 1 < 2^31).
  keys = jnp.sort(2 * jnp.where((ids >= 0) & (ids < vocab), ids, vocab) +
                  jnp.concatenate(prompt, axis=1), axis=1)
  cols = keys >> 1
  # Runs of equal ids: each one's output entries, added up by run.
  starts = jnp.concatenate([jnp.ones_like(cols[:, :1], bool),
                            cols[:, 1:] != cols[:, :-1]], axis=1)
  run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1
  rows = jax.lax.broadcasted_iota(jnp.int32, cols.shape, 0)
  per_run = jnp.zeros(cols.shape, jnp.int32).at[rows, run].add(1 - (keys & 1))
  counts = per_run[rows, run]
  return cols, counts


def _penalize(z: jax.Array, p: LogitsProcessors,
              keep: _Keep | None) -> jax.Array:
  """Step 2 of the module doc at the history ids alone: their values
  gathered, penalized (every listed id has ``s_i``; repeated ids compute
  the same value) and scattered back, -inf where ``keep`` masks them (a
  masked entry is -inf whatever the penalty: ``-inf - (-inf)`` would be
  NaN)."""
  vocab = z.shape[1]
  history = _history(p, vocab)
  if history is None:
    return z
  cols, counts = history
  rows = jax.lax.broadcasted_iota(jnp.int32, cols.shape, 0)
  inside = jnp.minimum(cols, vocab - 1)
  x = z[rows, inside]
  row = lambda a: None if a is None else a[:, None]
  rep, pres, freq = map(row, (p.repetition_penalty, p.presence_penalty,
                              p.frequency_penalty))
  if rep is not None:
    x = jnp.where(x > 0, x / rep, x * rep)
  terms = [penalty * weight.astype(jnp.float32) for penalty, weight in (
      (freq, counts), (pres, counts > 0)) if penalty is not None]
  # Each product rounds before it is subtracted (no fused multiply-add,
  # which XLA may otherwise form within a fusion): the module doc's
  # formula with every operation rounded, whatever the fusion.
  x, terms = jax.lax.optimization_barrier((x, terms))
  for term in terms:
    x = x - term
  if keep is not None:
    x = jnp.where(keep.at(rows, inside), x, -jnp.inf)
  return z.at[rows, cols].set(x, mode="drop")


def require_processors(processors) -> None:
  """Raises ``ValueError`` unless ``processors`` is ``LogitsProcessors``."""
  if not isinstance(processors, LogitsProcessors):
    raise ValueError(f"processors must be LogitsProcessors or None; got "
                     f"{type(processors).__name__} (e.g. "
                     "LogitsProcessors.make(B, repetition_penalty=1.1))")


def maybe_apply(logits: jax.Array, processors: LogitsProcessors | None
                ) -> jax.Array:
  """``logits`` as is without processors, else ``apply_processors``: the
  hook of ``sample``, ``extract_sampling_mask`` and ``rejection_sample``."""
  if processors is None:
    return logits
  require_processors(processors)
  logits = jnp.asarray(logits)
  if logits.ndim != 2:
    raise ValueError(f"logits must be [B, V]; got shape {logits.shape}")
  return apply_processors(logits, processors)


def slot_rows(processors: LogitsProcessors, draft_tokens: jax.Array,
              slots: int) -> LogitsProcessors:
  """The processors of the ``B * slots`` rows of a speculative step,
  request-major: slot ``i`` scores the token after drafts ``0 .. i - 1``,
  so its output history is the request's plus ``draft_tokens[:, :i]``
  (clipped to ``[0, V)`` by the caller) and ``num_output`` grows by ``i``."""
  batch, k = draft_tokens.shape
  rows = jax.tree.map(lambda a: jnp.repeat(jnp.asarray(a), slots, axis=0),
                      processors)
  if (processors.output_ids is None and not processors.penalizes and
      processors.min_tokens is None):
    return rows
  before = jnp.arange(k) < jnp.arange(slots)[:, None]  # [slots, k]
  drafts = jnp.where(before, draft_tokens[:, None, :].astype(jnp.int32), -1)
  base = (jnp.zeros((batch, 0), jnp.int32) if processors.output_ids is None
          else jnp.asarray(processors.output_ids, jnp.int32))
  count = (processors.output_count() if processors.output_ids is not None or
           processors.num_output is not None else jnp.zeros((batch,),
                                                             jnp.int32))
  return dataclasses.replace(
      rows,
      output_ids=jnp.concatenate([jnp.repeat(base, slots, axis=0),
                                  drafts.reshape(batch * slots, k)], axis=1),
      num_output=(jnp.repeat(count, slots) +
                  jnp.tile(jnp.arange(slots, dtype=jnp.int32), batch)))


def apply_to_slots(processors: LogitsProcessors | None, target_logits,
                   draft_tokens, draft_logits=None):
  """``(target_logits, draft_logits)`` of a speculative step processed
  (``slot_rows``: target slot ``i`` and draft slot ``i`` share slot ``i``'s
  processors), fp32; both as given without processors.  The hook of
  ``spec.rejection_sample``."""
  if processors is None:
    return target_logits, draft_logits
  batch, k1, vocab = target_logits.shape
  d = jnp.clip(jnp.asarray(draft_tokens), 0, vocab - 1)
  rows = slot_rows(processors, d, k1)
  process = lambda logits, m: maybe_apply(
      logits.reshape(batch * m, vocab), jax.tree.map(
          lambda a: a.reshape((batch, k1) + a.shape[1:])[:, :m].reshape(
              (batch * m,) + a.shape[1:]), rows)).reshape(batch, m, vocab)
  return process(target_logits, k1), (
      None if draft_logits is None else process(draft_logits, k1 - 1))
