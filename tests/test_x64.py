"""JAX's x64 mode (``jax_enable_x64`` on around the caller's program): every
entry point gives the bits and dtypes it gives with x64 off, on both
backends (the kernels' int32 loop carries and counts stay int32 there)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplingParams

from helpers.cases import (edge_case_batch, extract, run as run_spec,
                           sample_with_mask)
from helpers.parametrize import slow_case
from helpers.sampling import run_sample


def _batch(seed: int, batch: int, vocab: int, *, flat: bool = False):
  """float32 logits with -inf entries, per-request keys and positions, and
  params mixing greedy, plain, top-k, top-p and min-p requests (``flat``:
  ``2 * randn`` rows, top-p 0.95 on all: kept sets past a small
  ``max_candidates``, the large-set route)."""
  r = np.random.default_rng(seed)
  x = (r.standard_normal((batch, vocab)) * (2.0 if flat else 3.0)).astype(
      np.float32)
  if flat:
    params = SamplingParams.make(batch, temperature=1.0, top_p=0.95)
  else:
    x[r.random((batch, vocab)) < 0.05] = -np.inf
    params = SamplingParams.make(
        batch, temperature=r.choice([0.0, 0.7, 1.0], batch),
        top_k=r.choice([0, 3, 40], batch), top_p=r.choice([1.0, 0.9], batch),
        min_p=r.choice([0.0, 0.05], batch))
  keys = jax.random.split(jax.random.key(seed), batch)
  positions = np.arange(batch, dtype=np.int32) * 3
  return x, params, keys, positions


def _spec(impl: str, vocab: int, *, with_draft: bool):
  """``rejection_sample`` with masks on ``edge_case_batch`` (invalid rows,
  all-accepted and rejected groups) under top-k 40 / top-p 0.9 filters."""
  args, kw = edge_case_batch(80, 40, 3, vocab, with_draft=with_draft)
  target, drafts, n, params, keys = args
  params = SamplingParams.make(40, temperature=np.asarray(params.temperature),
                               top_k=40, top_p=0.9)
  return run_spec(target, drafts, n, params, keys, impl=impl,
                  return_mask=True, **kw)


def _sample(seed: int, impl: str, vocab: int, *, batch: int = 8,
            flat: bool = False, **config_kw):
  """``sample(..., return_mask=True)`` on ``_batch``, jitted."""
  x, params, keys, positions = _batch(seed, batch, vocab, flat=flat)
  return sample_with_mask(x, params, keys, impl=impl, positions=positions,
                          **config_kw)


def _eager(impl: str, vocab: int):
  """``sample`` called without ``jit``."""
  x, params, keys, positions = _batch(5, 8, vocab)
  return jax.tree.map(np.asarray, jaxsample.sample(
      x, params, keys, positions=positions, config=impl))


def _fp64_noise(impl: str, vocab: int, x64: bool):
  """``use_fp64_gumbel=True``: jitted under x64 mode, eagerly without it
  (the eager call turns x64 on for itself; under ``jit`` it needs x64)."""
  x, params, keys, positions = _batch(6, 8, vocab)
  return run_sample(x, params, keys, positions=positions, impl=impl,
                    fp64=True, jit=x64)


# name -> f(impl, vocab, x64 on?) -> the outputs as numpy.
_CASES = {
    "sample": lambda impl, vocab, x64: _sample(1, impl, vocab),
    "large_set": lambda impl, vocab, x64: _sample(
        2, impl, vocab, batch=4, flat=True, max_candidates=256),
    "extract_mask": lambda impl, vocab, x64: extract(
        *_batch(3, 8, vocab)[:2], implementation=impl),
    "spec_one_hot": lambda impl, vocab, x64: _spec(impl, vocab,
                                                   with_draft=False),
    "spec_draft_logits": lambda impl, vocab, x64: _spec(impl, vocab,
                                                        with_draft=True),
    "threefry": lambda impl, vocab, x64: _sample(4, impl, vocab,
                                                 rng="threefry"),
    "eager": lambda impl, vocab, x64: _eager(impl, vocab),
    "fp64_noise": _fp64_noise,
}


def _bits(a: np.ndarray) -> np.ndarray:
  return a.view(f"u{a.itemsize}") if a.dtype.kind == "f" else a


def _check_x64_mode(case: str, impl: str, vocab: int):
  before = jax.config.jax_enable_x64
  # The contexts restore the flag on the way out, raised or not.
  with jax.enable_x64(False):
    want = _CASES[case](impl, vocab, False)
  with jax.enable_x64(True):
    got = _CASES[case](impl, vocab, True)
  assert jax.config.jax_enable_x64 == before
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.dtype.itemsize <= 4, (g.dtype, w.dtype)
    np.testing.assert_array_equal(_bits(g), _bits(w))


_SLOW_XLA = ("large_set", "extract_mask", "spec_draft_logits", "threefry",
             "eager", "fp64_noise")


@pytest.mark.parametrize("impl,case", [
    ("xla", "sample"), ("xla", "spec_one_hot"), ("pallas", "sample")] + [
        slow_case("xla", c, id=f"xla-{c}") for c in _SLOW_XLA] + [
        slow_case("pallas", c, id=f"pallas-{c}")
        for c in _CASES if c != "sample"] + [
        slow_case("xla_search", c, id=f"xla_search-{c}")
        for c in ("sample", "extract_mask", "spec_one_hot")])
def test_x64_mode_gives_the_same_bits(impl, case):
  """Tokens, logprobs, masks and accepted drafts under x64 mode: the bits and
  dtypes (tokens int32, logprobs fp32, ...) of the same call with x64 off."""
  _check_x64_mode(case, impl, 2048 if case == "large_set" else 64)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_CASES))
def test_x64_mode_at_production_vocab(case):
  """The kernels compiled at V = 151936 under x64 mode (same check)."""
  _check_x64_mode(case, "pallas", 151936)
