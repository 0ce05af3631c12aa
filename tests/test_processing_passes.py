"""The sparse logits processing and the top-n by runs, bit for bit against
the dense formulas they replaced (``processors.apply_processors``,
``rowwise.top_k``, ``logprobs.token_logprobs``; ``docs/processing.md``,
"Cost"), and the compiled program's ``[B, V]`` temporaries."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample as js
from jaxsample._src import logprobs, processors as procs, rowwise

BATCH, VOCAB = 16, 100  # V not a multiple of 32: a partial bitmask word


# ---------------------------------------------------------------------------
# The dense formulas (the library's code before the sparse passes): the
# oracles here, not in the library.
# ---------------------------------------------------------------------------


def _columns(ids, vocab):
  ids = jnp.asarray(ids, jnp.int32)
  return (jax.lax.broadcasted_iota(jnp.int32, ids.shape, 0),
          jnp.where((ids >= 0) & (ids < vocab), ids, vocab))


def _dense_marks(ids, batch, vocab):
  return jnp.zeros((batch, vocab), bool).at[_columns(ids, vocab)].set(
      True, mode="drop")


def rounded(*values):
  """``values`` computed (rounded to fp32) before any later use: without
  it XLA may fuse a product into the subtraction after it (a fused
  multiply-add, one rounding), by fusion and not by formula."""
  return jax.lax.optimization_barrier(values)


@jax.jit
def dense_apply(logits, processors):
  """Bias, then ``[B, V]`` int32 counts and bool marks and an elementwise
  pass of the penalties (each product rounded, as the library computes
  them), then the masks."""
  batch, vocab = logits.shape
  p = processors.canonical()
  z = logits.astype(jnp.float32)
  if p.bias_ids is not None:
    z = z.at[_columns(p.bias_ids, vocab)].add(p.bias_values, mode="drop")
  if p.penalizes:
    counts = jnp.zeros((batch, vocab), jnp.int32)
    if p.output_ids is not None:
      counts = counts.at[_columns(p.output_ids, vocab)].add(1, mode="drop")
    if p.repetition_penalty is not None:
      rep = p.repetition_penalty[:, None]
      seen = counts > 0
      if p.prompt_ids is not None:
        seen = seen | _dense_marks(p.prompt_ids, batch, vocab)
      z = jnp.where(seen, jnp.where(z > 0, z / rep, z * rep), z)
    terms = [penalty[:, None] * weight.astype(jnp.float32)
             for penalty, weight in ((p.frequency_penalty, counts),
                                     (p.presence_penalty, counts > 0))
             if penalty is not None]
    z, terms = rounded(z, terms)
    for term in terms:
      z = z - term
  keep = None
  if p.allowed_ids is not None:
    has_list = jnp.any((p.allowed_ids >= 0) & (p.allowed_ids < vocab), axis=1)
    keep = _dense_marks(p.allowed_ids, batch, vocab) | ~has_list[:, None]
  if p.bitmask is not None:
    bits = procs.bitmask_allows(p.bitmask, vocab)
    keep = bits if keep is None else keep & bits
  if keep is not None:
    z = jnp.where(keep, z, -jnp.inf)
  banned = [] if p.banned_ids is None else [p.banned_ids]
  if p.min_tokens is not None:
    held = p.output_count() < p.min_tokens
    banned.append(jnp.where(held[:, None], p.stop_ids, -1))
  for ids in banned:
    z = z.at[_columns(ids, vocab)].set(-jnp.inf, mode="drop")
  return z


@functools.partial(jax.jit, static_argnames="num_top")
def dense_top_logprobs(logits, tokens, num_top):
  """``raw_logprobs``' values as one ``jax.nn.log_softmax`` over the row,
  ranks, and ``lax.top_k`` over the whole row."""
  x = logits.astype(jnp.float32)
  valid = jnp.isfinite(jnp.max(jnp.where(jnp.isnan(x), jnp.inf, x), axis=-1,
                               keepdims=True))
  values = jnp.where(valid, jax.nn.log_softmax(jnp.where(valid, x, 0.0)),
                     -jnp.inf)
  token = jnp.take_along_axis(values, tokens[:, None], axis=-1)
  top_values, top_ids = jax.lax.top_k(values, num_top)
  return (token[:, 0], jnp.sum(values >= token, axis=-1, dtype=jnp.int32),
          top_ids, top_values)


def assert_same_bits(got, want):
  """Equal fp32 bits, NaN included; a zero may differ in sign (the dense
  pass subtracted ``penalty * 0`` from every entry: ``-0 - (-0) = +0``)."""
  got, want = (np.where(a == 0, np.float32(0), a).astype(np.float32)
               for a in (np.asarray(got), np.asarray(want)))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# ---------------------------------------------------------------------------
# Penalties at the history ids alone.
# ---------------------------------------------------------------------------


def history_case(rng, batch=BATCH, vocab=VOCAB, history=32):
  """Logits with zeros of both signs, -inf, +inf and NaN entries, and
  processors whose histories (``history`` output ids, ``history // 4``
  prompt ids) repeat a few ids many times (with -1 padding and ids outside
  ``[0, V)``), penalties of both signs (one frequency large enough that
  ``frequency * count`` overflows), masks on some rows, distinct bias ids
  (a GPU adds repeated ones in any order)."""
  logits = rng.normal(size=(batch, vocab)).astype(np.float32)
  logits[rng.random(logits.shape) < 0.1] = 0.0
  logits[rng.random(logits.shape) < 0.1] = -0.0
  logits[rng.random(logits.shape) < 0.05] = -np.inf
  hot = rng.integers(0, vocab, 6)  # a few ids, repeated
  # Rows 9 and 10 list no allowed ids and pass the bitmask: a NaN logit,
  # and -inf at a hot id where frequency * count overflows to -inf.
  logits[0, 3], logits[9, 5], logits[10, hot[0]] = np.inf, np.nan, -np.inf

  def ids(width, pad):
    out = np.where(rng.random((batch, width)) < 0.7,
                   rng.choice(hot, (batch, width)),
                   rng.integers(-3, vocab + 3, (batch, width)))
    out[rng.random(out.shape) < pad] = -1
    return jnp.asarray(out, jnp.int32)

  def rows(low, high):
    return jnp.asarray(rng.uniform(low, high, batch), jnp.float32)

  frequency = np.array(rows(-1, 1))
  frequency[[2, 10]] = -3e38  # frequency * count overflows to -inf
  allowed = np.full((batch, 5), -1, np.int32)
  allowed[:batch // 2] = rng.choice(hot, (batch // 2, 5))  # other rows: all
  words = rng.integers(-2**31, 2**31, (batch, procs.bitmask_width(vocab)))
  words[rng.random(words.shape) < 0.5] = -1
  words[9:11] = -1
  bias_ids = np.argsort(rng.random((batch, vocab)), axis=1)[:, :4]
  bias_ids[rng.random(bias_ids.shape) < 0.2] = -1
  processors = js.LogitsProcessors(
      repetition_penalty=rows(0.5, 2.0), presence_penalty=rows(-1, 1),
      frequency_penalty=jnp.asarray(frequency),
      bias_ids=jnp.asarray(bias_ids, jnp.int32),
      bias_values=rows(-3, 3)[:, None] * jnp.ones((1, 4)),
      allowed_ids=jnp.asarray(allowed), banned_ids=ids(2, 0.5),
      bitmask=jnp.asarray(words, jnp.int32),
      min_tokens=jnp.asarray(rng.integers(0, 40, batch), jnp.int32),
      stop_ids=ids(2, 0.0), prompt_ids=ids(history // 4, 0.2),
      output_ids=ids(history, 0.3))
  return logits, processors


SUBSETS = {  # which fields each case keeps (each is two compiles)
    "all": None,
    "penalties, no mask": ("repetition_penalty", "presence_penalty",
                           "frequency_penalty", "prompt_ids", "output_ids"),
    "repetition on the prompt alone": ("repetition_penalty", "prompt_ids"),
    "presence and frequency (prompt unused)": (
        "presence_penalty", "frequency_penalty", "prompt_ids", "output_ids"),
}


@pytest.mark.parametrize("dtype,subsets", [(jnp.float32, tuple(SUBSETS)),
                                           (jnp.bfloat16, ("all",))])
def test_sparse_penalties_equal_the_dense_pass(dtype, subsets):
  """Subsets of the processors (each path of the penalties), fp32 and bf16
  logits: the same bits as the dense counts-and-marks pass."""
  logits, processors = history_case(np.random.default_rng(17))
  logits = jnp.asarray(logits, dtype)
  apply = jax.jit(procs.apply_processors)
  nan = []
  for name in subsets:
    kept = SUBSETS[name]
    subset = processors if kept is None else js.LogitsProcessors(
        **{k: getattr(processors, k) for k in kept})
    got = apply(logits, subset)
    want = np.asarray(dense_apply(logits, subset))
    assert_same_bits(got, want)
    assert (want == 0).any() and np.isneginf(want).any(), name
    nan.append(np.isnan(want).any())
  assert all(nan)  # NaN given, or -inf - (-inf) from the overflow


def test_histories_repeat_ids_and_reach_masked_entries():
  """The case's histories count ids many times and list masked ids."""
  _, p = history_case(np.random.default_rng(17))
  out = np.asarray(p.output_ids)
  counts = [np.bincount(row[(row >= 0) & (row < VOCAB)]).max() for row in out]
  assert min(counts) >= 3
  masked = ~np.asarray(procs.bitmask_allows(p.bitmask, VOCAB))
  assert masked[np.arange(BATCH)[:, None], np.clip(out, 0, VOCAB - 1)].any()


def test_compiled_processing_has_no_dense_counts():
  """The compiled processing program holds no ``[B, V]`` int32 and, beyond
  the allowed marks, no ``[B, V]`` bool: penalties, bias and banned ids
  touch only their ids."""
  _, p = history_case(np.random.default_rng(17))
  no_allowed = js.LogitsProcessors(**{
      k: v for k, v in vars(p).items() if k != "allowed_ids"})
  hlo = jax.jit(procs.apply_processors).lower(
      jnp.zeros((BATCH, VOCAB), jnp.bfloat16), no_allowed).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]  # the program's values, not fusions'
  entry = entry[:entry.index("\n}")]
  assert f"f32[{BATCH},{VOCAB}]" in entry
  for dtype in ("s32", "pred", "u32"):
    assert f"{dtype}[{BATCH},{VOCAB}]" not in entry, dtype


# ---------------------------------------------------------------------------
# Top-n by runs.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_top_k_by_runs_equals_lax_top_k(dtype):
  """Rows of many ties (logits rounded to a few values, bf16 too), -inf,
  NaN, -NaN and signed zeros, runs shorter than ``k`` and a short last run:
  the same values and ids as ``lax.top_k`` over the whole row."""
  rng = np.random.default_rng(3)
  vocab = 203  # 12 runs of 16, a last run of 11
  values = np.round(rng.normal(size=(6, vocab)) * 2) / 2
  values[0] = 1.0  # one value throughout
  values[1, rng.random(vocab) < 0.5] = -np.inf
  values[2] = -np.inf
  values[3, ::7] = np.nan
  values[4, ::3], values[4, 1::3] = 0.0, -0.0  # +0 ranks above -0
  values[5, ::5] = -np.nan  # below -inf
  values = jnp.asarray(values, dtype)
  for k, chunk in ((1, 16), (5, 16), (20, 8), (20, 64)):  # 8: runs < k
    got = jax.jit(rowwise.top_k, static_argnums=(1, 2))(values, k, chunk)
    want = jax.lax.top_k(values, k)
    np.testing.assert_array_equal(got[1], want[1], err_msg=f"{k} {chunk}")
    assert_same_bits(np.asarray(got[0], np.float32),
                     np.asarray(want[0], np.float32))
    assert got[1].dtype == jnp.int32


def raw_rows(rng, vocab: int) -> np.ndarray:
  """fp32 ``[6, vocab]`` logits: rows with ties, -inf, NaN (invalid) and
  fp32 logits that differ by less than the log-softmax's rounding (values
  that collapse to ties), within one run and across runs (row 4: larger
  logits at larger ids, so the ties put the smaller ids first), and signed
  zero maxima."""
  logits = rng.normal(size=(6, vocab)).astype(np.float32)
  logits[0] = np.round(logits[0] * 2) / 2
  logits[1, rng.random(vocab) < 0.3] = -np.inf
  logits[2, 7] = np.nan
  logits[3, :64] = 3.0 + np.arange(64, dtype=np.float32) * 2e-7
  logits[4] = logits[4] * 0.5 - 6.0  # 21 logits 1 ulp apart at 0.25
  logits[4, 3:21 * 128:128] = 0.25 + np.arange(21) * 2.0**-25  # 1 a run
  logits[5] = -np.inf
  logits[5, [5, 300, 2000, 2600]] = 0.0, -0.0, -1.0, -0.0
  return logits


def check_raw_top_logprobs(logits, tokens, num_top):
  """``token_logprobs`` in ``raw_logprobs`` mode: the token's value and rank
  and the top-n, bit for bit as one ``log_softmax`` over the row and
  ``lax.top_k`` (``dense_top_logprobs``); returns it."""
  params = js.SamplingParams.make(logits.shape[0])
  got = jax.jit(logprobs.token_logprobs, static_argnames=("num_top", "mode"))(
      logits, params, tokens, num_top=num_top, mode="raw_logprobs")
  want = dense_top_logprobs(logits, tokens, num_top)
  for a, b in zip((got.token_values, got.token_ranks, got.top_ids,
                   got.top_values), want):
    if a.dtype == jnp.float32:
      assert_same_bits(a, b)
    else:
      np.testing.assert_array_equal(a, b)
  return got


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_raw_top_logprobs_equal_the_dense_log_softmax(dtype):
  """Raw top-n logprobs over runs of ids (``logprobs.raw_logprobs``: the
  run keys come from the logits' run maxima) on ``raw_rows``, bit for bit
  (``check_raw_top_logprobs``)."""
  rng = np.random.default_rng(5)
  vocab = 20 * rowwise.TOP_K_CHUNK + 99  # num_top 20 takes the runs
  logits = jnp.asarray(raw_rows(rng, vocab), dtype)
  tokens = jnp.asarray(rng.integers(0, vocab, 6), jnp.int32)
  got = check_raw_top_logprobs(logits, tokens, 20)
  if dtype == jnp.float32:  # the near-equal logits tie after rounding
    for row in (3, 4):
      top = np.asarray(got.top_values[row])
      assert (top[1:] == top[:-1]).any()
    # Across runs the ties reverse the logits' order.
    assert (np.diff(np.asarray(got.top_ids[4])) > 0).any()


@pytest.mark.gpu
def test_raw_top_logprobs_of_tied_rows_on_a_gpu(require_gpu):
  """``raw_rows`` at V = 151936 on the GPU, fp32 and bf16, top-5 and
  top-20: bit for bit as one ``log_softmax`` and ``lax.top_k``, the
  token's value and rank included (XLA:GPU's fusions round the same)."""
  rng = np.random.default_rng(7)
  vocab = 151936
  logits = raw_rows(rng, vocab)
  tokens = np.asarray(rng.integers(0, vocab, 6), np.int32)
  tokens[3], tokens[4] = 10, 3 + 5 * 128  # tokens among the near ties
  for dtype in (jnp.float32, jnp.bfloat16):
    for num_top in (5, 20):
      check_raw_top_logprobs(jnp.asarray(logits, dtype), jnp.asarray(tokens),
                             num_top)


@pytest.mark.gpu
def test_sparse_processing_and_top_n_on_a_gpu(require_gpu):
  """At the bench's shape (B = 128, V = 151936, 1,024-token histories) on
  the GPU, fp32 and bf16: the processed row bit for bit as the dense pass,
  and raw top-20 logprobs as one ``log_softmax`` and ``lax.top_k``."""
  batch, vocab = 128, 151936
  logits, processors = history_case(np.random.default_rng(40), batch, vocab,
                                    1024)
  tokens = jnp.asarray(np.random.default_rng(41).integers(0, vocab, batch),
                       jnp.int32)
  params = js.SamplingParams.make(batch)
  top = jax.jit(logprobs.token_logprobs, static_argnames=("num_top", "mode"))
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(logits, dtype)
    assert_same_bits(jax.jit(procs.apply_processors)(x, processors),
                     dense_apply(x, processors))
    got = top(x, params, tokens, num_top=20, mode="raw_logprobs")
    want = dense_top_logprobs(x, tokens, 20)
    for a, b in zip((got.token_values, got.token_ranks, got.top_ids,
                     got.top_values), want):
      assert_same_bits(np.asarray(a).astype(np.float32),
                       np.asarray(b).astype(np.float32))
