"""Named benchmark cases: shapes, dtype, a params builder and a logits generator.

A ``Case`` is what a suite times and what a test can rebuild: ``[batch, vocab]``
logits of one named distribution in one dtype, and ``SamplingParams`` of one
named setting (every request the same) at one temperature.

Logit distributions (``DISTS``; each row independent, fp32 before the cast):

* ``randn``: ``2 * N(0, 1)``.  The Gumbel kernel's worst case: at T = 0.7
  every tile may hold the winner.
* ``llm``: the ``randn`` bulk plus ``LLM_HEADS`` head tokens at random ids
  with logits uniform in [15, 25] (6 to 16 above the bulk's maximum).
* ``randn_x1`` / ``randn_x5``: ``N(0, 1)`` / ``5 * N(0, 1)`` (flat / peaked).
* ``zipf``: ``-1.1 * log(rank)`` over a random permutation of ranks per row,
  plus ``0.1 * N(0, 1)``.
* ``flat``: every entry equal (buffer ``i`` holds ``0.5 + i``): ties no
  candidate buffer or window holds.
* ``halves``: ``N(0, 1)`` rounded to halves (about 20 distinct values).
* ``heads``: ``3 * N(0, 1)`` plus head logits ``HEADS`` (25, 24.5, 22) at
  random ids: the rows of issue 36 (a peaked LLM row, small kept sets).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.bench.timing import L2_BYTES
from jaxsample._src.params import SamplingParams
from jaxsample._src.processors import bitmask_width

__all__ = ["Case", "DISTS", "HEADS", "LLM_HEADS", "NAMED", "SETTINGS", "buffer_count", "grid",
           "make_logits", "processor_fields", "rotating_inputs"]

DISTS = ("randn", "llm", "randn_x1", "randn_x5", "zipf", "flat", "halves", "heads")
LLM_HEADS = 8
HEADS = (25.0, 24.5, 22.0)

# Filter settings by name: ``SamplingParams.make`` keywords besides temperature.
SETTINGS = {
    "plain": {},
    "top_k50": dict(top_k=50),
    "top_p0.9": dict(top_p=0.9),
    "top_p0.95": dict(top_p=0.95),
    "min_p0.05": dict(min_p=0.05),
    "min_p0.1": dict(min_p=0.1),
    "top_k50+top_p0.9": dict(top_k=50, top_p=0.9),
    # Large top-k (above max_candidates / 2: the window searches).
    "top_k1000": dict(top_k=1000),
    "top_k20000": dict(top_k=20000),
    "top_k150000": dict(top_k=150000),
    "top_k20000+top_p0.9": dict(top_k=20000, top_p=0.9),
}


def make_logits(key, batch: int, vocab: int, dist: str = "randn", index: int = 0):
  """fp32 logits ``[batch, vocab]`` of a named distribution (module doc);
  ``index`` tells rotating buffers of a constant distribution apart."""
  bulk_key, id_key, value_key = jax.random.split(key, 3)
  x = jax.random.normal(bulk_key, (batch, vocab), jnp.float32)
  if dist in ("randn", "llm"):
    x = 2 * x
  if dist in ("llm", "heads"):
    count = LLM_HEADS if dist == "llm" else len(HEADS)
    ids = jax.vmap(lambda k: jax.random.choice(k, vocab, (count,), replace=False))(
        jax.random.split(id_key, batch))
    heads = (jax.random.uniform(value_key, (batch, count), jnp.float32, 15.0, 25.0)
             if dist == "llm" else jnp.broadcast_to(jnp.float32(HEADS), (batch, count)))
    x = x if dist == "llm" else 3 * x
    return x.at[jnp.arange(batch)[:, None], ids].set(heads)
  if dist in ("randn", "randn_x1"):
    return x
  if dist == "randn_x5":
    return 5 * x
  if dist == "zipf":
    ranks = jax.vmap(lambda k: jax.random.permutation(k, jnp.arange(1, vocab + 1)))(
        jax.random.split(id_key, batch))
    return -1.1 * jnp.log(ranks.astype(jnp.float32)) + 0.1 * x
  if dist == "flat":
    return jnp.full_like(x, 0.5 + index)
  if dist == "halves":
    return jnp.round(x * 2) / 2
  raise ValueError(f"unknown distribution {dist!r}; expected one of {DISTS}")


def buffer_count(n_bytes: int, most: int = 64) -> int:
  """How many distinct input buffers exceed 2x the L2 (at least 2, at most ``most``)."""
  return int(min(most, max(2, -(-2 * L2_BYTES // max(n_bytes, 1)))))


def rotating_inputs(batch: int, vocab: int, dtype, seed: int = 0, dist: str = "randn",
                    most: int = 64) -> list:
  """Distinct logits buffers of one distribution, enough to exceed 2x the L2."""
  dtype = jnp.dtype(dtype)
  count = buffer_count(batch * vocab * dtype.itemsize, most)
  keys = jax.random.split(jax.random.key(seed), count)
  return [make_logits(k, batch, vocab, dist, i).astype(dtype) for i, k in enumerate(keys)]


@dataclasses.dataclass(frozen=True)
class Case:
  """One timed configuration: ``batch`` rows of ``vocab`` logits in ``dtype``
  drawn from ``dist``, every request with ``setting`` at ``temperature``."""

  batch: int
  vocab: int
  dtype: str = "float32"
  setting: str = "plain"
  dist: str = "randn"
  temperature: float = 0.7

  def __post_init__(self):
    if self.setting not in SETTINGS:
      raise ValueError(f"unknown setting {self.setting!r}; expected one of {list(SETTINGS)}")
    if self.dist not in DISTS:
      raise ValueError(f"unknown distribution {self.dist!r}; expected one of {DISTS}")

  @property
  def filters(self) -> dict:
    return SETTINGS[self.setting]

  def params(self, **overrides) -> SamplingParams:
    """The batch's ``SamplingParams`` (``overrides``: e.g. ``temperature=0``)."""
    kw = dict(temperature=self.temperature, **self.filters)
    kw.update(overrides)
    return SamplingParams.make(self.batch, **kw)

  def logits(self, seed: int = 0) -> jax.Array:
    """One logits buffer ``[batch, vocab]`` in ``dtype``."""
    return make_logits(jax.random.key(seed), self.batch, self.vocab, self.dist).astype(
        self.dtype)

  def inputs(self, seed: int = 0, most: int = 64) -> list:
    """Rotating logits buffers (``rotating_inputs``)."""
    return rotating_inputs(self.batch, self.vocab, self.dtype, seed, self.dist, most)

  @property
  def logits_bytes(self) -> int:
    return self.batch * self.vocab * jnp.dtype(self.dtype).itemsize

  def label(self) -> dict:
    """The fields a benchmark row records."""
    return dataclasses.asdict(self)


def grid(batches, vocab: int, dtypes, settings, dists, temperature: float) -> list[Case]:
  """Every combination, dtype outermost, then batch, distribution and setting."""
  return [Case(b, vocab, dtype, setting, dist, temperature) for dtype, b, dist, setting in
          itertools.product(dtypes, batches, dists, settings)]


# Case sets shared by the benchmarks (``--cases NAME``) and the tests.
NAMED = {
    # The README's table: B = 1, 32, 128 at V = 151936, fp32 and bf16.
    "main": grid((1, 32, 128), 151936, ("float32", "bfloat16"),
                 ("plain", "top_k50+top_p0.9", "top_p0.95", "min_p0.05"), ("randn",), 0.7),
    # Tiny shapes for CPU tests: every setting that routes differently.
    "smoke": grid((2,), 256, ("float32", "bfloat16"),
                  ("plain", "top_k50+top_p0.9", "top_p0.95", "min_p0.05"), ("randn",), 0.7),
}


def processor_fields(batch: int, vocab: int, history: int = 1024, bias_ids: int = 16,
                     seed: int | None = None) -> dict[str, dict]:
  """Issue 40's processors as ``LogitsProcessors`` fields per kind, random but fixed
  (``seed``, default ``batch``): ``"penalties"`` (repetition 1.1, presence 0.5, frequency
  0.2 over ``history`` output ids per request), ``"bias"`` (``bias_ids`` ids per request,
  biases uniform in [-5, 5]) and ``"bitmask"`` (random packed words)."""
  r = np.random.default_rng(batch if seed is None else seed)
  ids = lambda n: jnp.asarray(r.integers(0, vocab, (batch, n)), jnp.int32)
  rows = lambda v: jnp.full((batch,), v, jnp.float32)
  words = r.integers(-2**31, 2**31, (batch, bitmask_width(vocab)))
  return {
      "penalties": dict(repetition_penalty=rows(1.1), presence_penalty=rows(0.5),
                        frequency_penalty=rows(0.2), output_ids=ids(history),
                        num_output=jnp.full((batch,), history, jnp.int32)),
      "bias": dict(bias_ids=ids(bias_ids),
                   bias_values=jnp.asarray(r.uniform(-5, 5, (batch, bias_ids)), jnp.float32)),
      "bitmask": dict(bitmask=jnp.asarray(words, jnp.int32)),
  }
