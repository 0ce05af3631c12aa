"""``generate``: prefill plus a ``jax.lax.while_loop`` of decode steps.

Bucket policy (shapes are static, so each bucket compiles once):

* slots: the batch is padded to ``max(8, next_pow2(B))`` slots (padding
  slots start finished);
* prompt length: prompts are left-aligned in ``max(16, next_pow2(L_max))``
  columns (capped at the cache length);
* new tokens: the output buffers have ``max(16, next_pow2(N_max))`` columns
  for ``N_max = max(max_new_tokens)``;
* stop tokens: ``max(4, next_pow2(most stop ids of a request))`` per slot;
* processors' id lists (bias, allowed, banned and min-tokens stop ids):
  ``max(4, next_pow2(longest list))`` columns each;
* cache: ``cache_len`` positions (default: the model's ``max_len``) whatever
  the prompts, so decode steps have one shape.

Sampling parameters, keys, prompt contents and lengths, budgets, stop ids and
processor values are traced: changing them never recompiles (which processor
fields are present is static: the program specializes on them).  A request's
tokens depend only on its prompt, key, parameters, budget, stop ids and
processors, not on its slot, the other requests or the buckets
(``tests/test_serve_loop.py``, ``tests/test_generate_processors.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.generation.lm import LanguageModel, as_language_model
from jaxsample.generation.step import (DecodeState, StepOutput, decode_step,
                                       prefill, raw_keys)
from jaxsample._src.mask import SamplingMask
from jaxsample._src.params import SamplerConfig, SamplingParams
from jaxsample._src.processors import (NEUTRAL, LogitsProcessors, neutral_field,
                                       require_processors)

__all__ = ["Generation", "bucket", "generate"]

MIN_SLOTS, MIN_PROMPT, MIN_NEW, MIN_STOPS, MIN_IDS = 8, 16, 16, 4, 4
FINISH_REASONS = ("stop", "length", "invalid")


def bucket(n: int, minimum: int) -> int:
  """``max(minimum, next power of two >= n)``."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Generation:
  """The result of ``generate`` for ``B`` requests and ``N`` token columns.

  Attributes:
    tokens: ``[B, N]`` int32; request ``b``'s generated tokens are
      ``tokens[b, :num_tokens[b]]`` (a final stop token included), -1 after.
    logprobs: ``[B, N]`` fp32 per-token log-probabilities under each
      request's processed distribution (0 after the end).
    num_tokens: ``[B]`` int32.
    finish_reason: ``[B]`` int32 index into ``FINISH_REASONS``: 0 a stop
      token, 1 the budget (``max_new_tokens`` or the cache), 2 invalid logits.
    masks: ``SamplingMask`` with a leading token axis ``[N, B, ...]``
      (``return_masks``), else None.
  """

  tokens: jax.Array
  logprobs: jax.Array
  num_tokens: jax.Array
  finish_reason: jax.Array
  masks: SamplingMask | None = None

  def to_openai(self, tokenizer=None) -> list[dict]:
    """Per request, an OpenAI-like choice: ``token_ids``, ``logprobs``,
    ``finish_reason`` (``"stop"``, ``"length"`` or ``"invalid"``), ``text``
    (with a ``tokenizer`` that has ``decode``), and with masks
    ``sampling_mask`` (per token the kept ids, None where nothing was
    truncated, or past ``max_mask_ids`` the overflow dict; as
    ``SamplingMask.to_json``) and ``logz`` (per token)."""
    host = jax.device_get(self)
    counts = np.asarray(host.num_tokens)
    choices = []
    for b, n in enumerate(counts):
      ids = np.asarray(host.tokens[b, :n]).tolist()
      choice = {"token_ids": ids,
                "logprobs": np.asarray(host.logprobs[b, :n]).tolist(),
                "finish_reason": FINISH_REASONS[int(host.finish_reason[b])]}
      if tokenizer is not None:
        choice["text"] = tokenizer.decode(ids)
      choices.append(choice)
    if host.masks is not None:
      pairs = host.masks.to_lists(num_tokens=counts)
      for choice, request in zip(choices, pairs):
        choice["sampling_mask"] = [ids for ids, _ in request]
        choice["logz"] = [logz for _, logz in request]
    return choices


def generate(model, prompts: Sequence[Sequence[int]], *,
             params: SamplingParams, keys, max_new_tokens,
             stop_tokens=None, config: SamplerConfig | None = None,
             return_masks: bool = False, cache_len: int | None = None,
             processors: LogitsProcessors | None = None) -> Generation:
  """Generates up to ``max_new_tokens`` tokens for each prompt.

  Args:
    model: a Flax NNX module or a ``(LanguageModel, weights)`` pair
      (``jaxsample.generation.lm``).
    prompts: ``B`` non-empty sequences of token ids.
    params: ``SamplingParams`` of batch size ``B``.
    keys: ``B`` per-request keys (``[B]`` typed or ``[B, 2]`` uint32).
    max_new_tokens: an int or ``B`` ints >= 0 (capped so every request fits
      in the cache: ``cache_len - len(prompt)``).
    stop_tokens: None, one sequence of ids for every request, or ``B``
      sequences; generation of a request stops after it emits one of them.
    config: static ``SamplerConfig`` (backend, RNG, mask width).
    return_masks: also return per-token sampling masks.
    cache_len: KV cache positions (default: the model's ``max_len``).
    processors: per-request ``LogitsProcessors`` of batch size ``B``
      (``LogitsProcessors.make``; ``docs/processing.md``) applied before
      sampling at every step, or None.  The loop feeds the history: the
      prompts for the repetition penalty, the generated tokens for all
      penalties and ``min_tokens`` (leave ``prompt_ids`` and
      ``output_ids`` None).  ``min_tokens`` holds back the processors'
      ``stop_ids`` (usually the same ids as ``stop_tokens``).  A
      ``bitmask`` is static (the same every step); a grammar that changes
      per token needs ``ServeLoop``'s ``bitmask_fn``.  Rows with neutral
      values (``make``'s defaults) are sampled exactly as without
      processors.

  Raises:
    ValueError: naming the argument, for an empty prompt, a prompt that does
      not fit the cache, ids outside the vocabulary, or mismatched sizes;
      naming the ``LogitsProcessors`` field for processors of the wrong
      batch size, shape or dtype, or carrying a history.
  """
  lm, weights = as_language_model(model)
  batch = len(prompts)
  if params.batch_size != batch:
    raise ValueError(f"params has batch size {params.batch_size} but there "
                     f"are {batch} prompts")
  cache_len = cache_len or lm.max_len
  if not cache_len:
    raise ValueError("cache_len is required for a model without max_len")
  lengths = [len(p) for p in prompts]
  for b, n in enumerate(lengths):
    if not 1 <= n < cache_len:
      raise ValueError(f"prompts[{b}] has {n} tokens; each prompt needs 1 to "
                       f"{cache_len - 1} tokens (cache_len {cache_len})")
  high = lm.vocab_size or 2**31 - 1
  for b, prompt in enumerate(prompts):
    ids = np.asarray(prompt)
    if not np.issubdtype(ids.dtype, np.integer) or np.any(
        (ids < 0) | (ids >= high)):
      raise ValueError(f"prompts[{b}] must hold token ids in the vocabulary "
                       f"[0, {high}); got {list(prompt)[:8]}...")
  budgets = np.broadcast_to(np.asarray(max_new_tokens), (batch,))
  if not np.issubdtype(budgets.dtype, np.integer) or np.any(budgets < 0):
    raise ValueError(f"max_new_tokens must be an int or {batch} ints >= 0; "
                     f"got {max_new_tokens!r}")
  budgets = np.minimum(budgets, cache_len - np.asarray(lengths, np.int64))
  stops = _stop_lists(stop_tokens, batch)

  slots = bucket(batch, MIN_SLOTS)
  width = min(bucket(max(lengths), MIN_PROMPT), cache_len)
  steps = bucket(int(budgets.max(initial=0)), MIN_NEW)
  stop_width = bucket(max(map(len, stops), default=0), MIN_STOPS)
  tokens = np.zeros((slots, width), np.int32)
  for b, prompt in enumerate(prompts):
    tokens[b, :lengths[b]] = np.asarray(prompt, np.int32)
  stop_ids = np.full((slots, stop_width), -1, np.int32)
  for b, ids in enumerate(stops):
    stop_ids[b, :len(ids)] = ids
  pad = lambda a, fill: np.concatenate(
      [np.asarray(a), np.full((slots - batch,) + np.shape(a)[1:], fill,
                              np.asarray(a).dtype)])
  padded_params = SamplingParams(*(pad(f, 0) for f in (
      params.temperature, params.top_k, params.top_p, params.min_p)))
  key_data = pad(raw_keys(keys, batch), 0)
  slot_lengths = pad(lengths, 1).astype(np.int32)
  processors = _loop_processors(processors, batch, lm.vocab_size, tokens,
                                slot_lengths, steps)
  result = _generate(lm, config, return_masks, cache_len, steps, weights,
                     tokens, slot_lengths, padded_params, key_data, stop_ids,
                     pad(budgets, 0).astype(np.int32), processors)
  masks = (None if result.masks is None else
           jax.tree.map(lambda a: a[:, :batch], result.masks))
  return Generation(result.tokens[:batch], result.logprobs[:batch],
                    result.num_tokens[:batch], result.finish_reason[:batch],
                    masks)


def _stop_lists(stop_tokens, batch: int) -> list[list[int]]:
  if stop_tokens is None:
    return [[] for _ in range(batch)]
  stop_tokens = list(stop_tokens)
  if all(isinstance(s, (int, np.integer)) for s in stop_tokens):
    return [list(map(int, stop_tokens)) for _ in range(batch)]
  if len(stop_tokens) != batch:
    raise ValueError(f"stop_tokens must be one list of ids or {batch} lists; "
                     f"got {len(stop_tokens)} lists")
  return [list(map(int, s)) for s in stop_tokens]


# The neutral value of each field (padding rows and columns): it changes
# nothing (``jaxsample._src.processors``: ids -1 are ignored, all bits allow).
_ID_LISTS = ("bias_ids", "bias_values", "allowed_ids", "banned_ids",
             "stop_ids")


def _loop_processors(processors: LogitsProcessors | None, batch: int,
                     vocab_size: int | None, tokens: np.ndarray,
                     lengths: np.ndarray, steps: int
                     ) -> LogitsProcessors | None:
  """``processors`` checked and padded to the loop's shapes: ``tokens.shape
  [0]`` rows (the padding neutral), id lists ``bucket(width, MIN_IDS)``
  wide, plus the histories the loop feeds: ``prompt_ids`` from ``tokens``
  (repetition penalty), ``output_ids`` ``steps`` wide (penalties) and
  ``num_output`` (penalties, min tokens)."""
  if processors is None:
    return None
  require_processors(processors)
  processors.check(batch, vocab_size)
  if processors.prompt_ids is not None:
    raise ValueError("LogitsProcessors.prompt_ids must be None: generate "
                     "feeds the prompts to the repetition penalty")
  for name, empty in (("output_ids", -1), ("num_output", 0)):
    history = getattr(processors, name)
    if history is not None and np.any(np.asarray(history) != empty):
      raise ValueError(f"LogitsProcessors.{name} must be None (or empty): "
                       "generate counts the tokens it generates")
  slots = tokens.shape[0]
  fields = {}
  for name, fill in NEUTRAL.items():
    value = getattr(processors, name)
    if value is None or name in ("prompt_ids", "output_ids", "num_output"):
      continue
    value = np.asarray(value).astype(np.float32 if isinstance(fill, float)
                                     else np.int32)
    widths = [(0, slots - batch)]
    if name in _ID_LISTS:
      widths.append((0, bucket(value.shape[1], MIN_IDS) - value.shape[1]))
    elif value.ndim == 2:  # the bitmask: ceil(V / 32) words
      widths.append((0, 0))
    fields[name] = np.pad(value, widths, constant_values=fill)
  if processors.repetition_penalty is not None:
    columns = np.arange(tokens.shape[1])
    fields["prompt_ids"] = np.where(columns < lengths[:, None], tokens, -1)
  if processors.penalizes:
    fields["output_ids"] = neutral_field("output_ids", (slots, steps))
  if processors.penalizes or processors.min_tokens is not None:
    fields["num_output"] = neutral_field("num_output", slots)
  return LogitsProcessors(**fields)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _generate(lm: LanguageModel, config, return_masks: bool, cache_len: int,
              steps: int, weights, tokens, lengths, params, keys, stop_ids,
              budgets, processors) -> Generation:
  cache = lm.init_cache(weights, tokens.shape[0], cache_len)
  state = DecodeState(
      tokens=tokens, positions=lengths - 1, keys=keys, params=params,
      finished=budgets <= 0, stop_tokens=stop_ids, remaining=budgets,
      cache=cache, processors=processors)
  state, first = prefill(lm, weights, state, config=config,
                         return_mask=return_masks)

  def record(buffers, out: StepOutput, t):
    write = lambda buf, value: buf.at[t].set(value)
    return jax.tree.map(write, buffers, (out.tokens, out.logprobs, out.valid,
                                         out.mask))

  empty = jax.tree.map(lambda a: jnp.zeros((steps,) + a.shape, a.dtype),
                       (first.tokens, first.logprobs, first.valid, first.mask))
  buffers = record(empty, first, 0)

  def cond(carry):
    t, state, _ = carry
    return (t < steps) & ~jnp.all(state.finished)

  def body(carry):
    t, state, buffers = carry
    state, out = decode_step(lm, weights, state, config=config,
                             return_mask=return_masks)
    return t + 1, state, record(buffers, out, t)

  _, state, (out_tokens, out_logprobs, valid, masks) = jax.lax.while_loop(
      cond, body, (jnp.int32(1), state, buffers))
  num_tokens = valid.sum(axis=0, dtype=jnp.int32)
  last_token = jnp.take_along_axis(
      out_tokens, jnp.maximum(num_tokens - 1, 0)[None], axis=0)[0]
  stopped = (num_tokens > 0) & jnp.any(stop_ids == last_token[:, None], axis=1)
  exhausted = num_tokens >= budgets
  reason = jnp.where(stopped, 0, jnp.where(exhausted, 1, 2)).astype(jnp.int32)
  return Generation(tokens=jnp.where(valid, out_tokens, -1).T,
                    logprobs=jnp.where(valid, out_logprobs, 0.0).T,
                    num_tokens=num_tokens, finish_reason=reason, masks=masks)
