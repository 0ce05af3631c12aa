"""Issue 36's edges: logprobs at every accepted temperature on every path
(items 1), a randomized bad-input test, and interpret mode compiling once
(item 6).  Small V throughout: none of these properties depends on V."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import spec

from conftest import LLVM_FAST_COMPILE
from helpers.child_env import compile_cache_env
from helpers.oracle import FP32_EPS
from helpers.parametrize import IMPLEMENTATIONS_SLOW_KERNELS, slow_case

# From the smallest positive fp32 (make accepts it) to 1e3; below
# MIN_TEMPERATURE = 1e-5 rows are greedy.
TEMPERATURES = [1e-45, 1e-38, 1e-20, 1e-10, 1e-8, 9.99e-6, 1e-5, 3e-5, 1e-4,
                1e-3, 0.01, 0.72, 1.0, 10.0, 1e3]
FILTERS = [dict(), dict(top_p=0.9), dict(top_k=5, min_p=0.05)]
KINDS = ("flat", "peaked", "tied", "wide")
VOCAB = 96


def sweep_batch(dtype, seed=0):
  """Every temperature x row kind x filter: logits ``[B, VOCAB]`` of
  ``dtype`` and their params.  Kinds: flat (all equal), peaked (``randn * 3``
  with heads 25.0 / 24.5, the issue's rows), tied (``round(randn * 2)``: many
  ties, two at the max), wide (``randn * 50``)."""
  r = np.random.default_rng(seed)
  rows, temps, filters = [], [], []
  for t in TEMPERATURES:
    for kind in KINDS:
      for f in FILTERS:
        x = {"flat": np.zeros(VOCAB),
             "peaked": r.standard_normal(VOCAB) * 3,
             "tied": np.round(r.standard_normal(VOCAB) * 2),
             "wide": r.standard_normal(VOCAB) * 50}[kind]
        if kind == "peaked":
          x[3], x[7] = 25.0, 24.5
        if kind == "tied":
          x[[11, 40]] = x.max() + 1
        rows.append(x)
        temps.append(t)
        filters.append(f)
  params = SamplingParams.make(
      len(rows), temperature=temps,
      top_k=[f.get("top_k", 0) for f in filters],
      top_p=[f.get("top_p", 1.0) for f in filters],
      min_p=[f.get("min_p", 0.0) for f in filters])
  return jnp.asarray(np.stack(rows), dtype), params


def tempered(x, temperature):
  """``y`` of the reference on this (CPU) platform: ``x * (1 / T)`` in fp32
  for ``T >= 1e-5``, ``x`` for greedy rows (``reference.divide``)."""
  x = np.asarray(jnp.asarray(x, jnp.float32))
  t = np.float32(temperature)
  return x if not t >= np.float32(1e-5) else (
      x * (np.float32(1) / t)).astype(np.float32)


def logsumexp64(y):
  y = np.asarray(y, np.float64)
  m = y.max()
  return m + np.log(np.exp(y - m).sum())


def check_rows(x, params, result, m=None, *, approximate=False):
  """Every row valid with a finite logprob <= 0, greedy below 1e-5 (argmax,
  logprob 0); untruncated rows' logprobs match float64 ``log_softmax(y)``;
  the mask lists the token and rebuilds its logprob from ``lse``/``logz``.
  Tolerances: 1e-4 plus ulps of the row's largest tempered logit (a few
  for the exact paths, 16 for the kernels' sums, ``approximate``)."""
  ulps = 16 if approximate else 4
  tokens, logprobs = np.asarray(result.tokens), np.asarray(result.logprobs)
  assert np.asarray(result.valid).all()
  temps = np.asarray(params.temperature)
  truncates = ((np.asarray(params.top_k) > 0) | (np.asarray(params.top_p) < 1)
               | (np.asarray(params.min_p) > 0))
  for b in range(x.shape[0]):
    y = tempered(x[b], temps[b])
    ctx = (b, temps[b], tokens[b], logprobs[b])
    assert 0 <= tokens[b] < x.shape[1], ctx
    assert np.isfinite(logprobs[b]) and logprobs[b] <= 0, ctx
    scale = max(1.0, float(np.abs(y).max()))
    tol = 1e-4 + ulps * FP32_EPS * scale
    if not temps[b] >= np.float32(1e-5):
      assert logprobs[b] == 0 and tokens[b] == np.argmax(y), ctx
    elif not truncates[b]:
      want = y[tokens[b]] - logsumexp64(y)
      assert abs(logprobs[b] - want) <= tol, (ctx, want)
    if m is not None:
      count = int(m.count[b])
      listed = np.asarray(m.ids[b])
      if m.truncated[b]:
        assert tokens[b] in listed[:count], (ctx, listed[:count])
      rebuilt = float(y[tokens[b]]) - float(m.lse[b]) - float(m.logz[b])
      assert m.logz[b] <= 0 and abs(rebuilt - logprobs[b]) <= tol, (
          ctx, rebuilt, float(m.lse[b]), float(m.logz[b]))


_sample = jax.jit(jaxsample.sample, static_argnames=("config", "return_mask"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fp64", [False, True])
def test_temperature_sweep_xla(dtype, fp64):
  x, params = sweep_batch(dtype)
  config = SamplerConfig(implementation="xla", use_fp64_gumbel=fp64)
  with jax.enable_x64(True) if fp64 else contextlib.nullcontext():
    result, m = _sample(x, params, jax.random.key(1), config=config,
                        return_mask=True)
  check_rows(np.asarray(x, np.float32), params, result, m)
  alone = jaxsample.extract_sampling_mask(x, params, config=config)
  np.testing.assert_array_equal(np.asarray(alone.count), np.asarray(m.count))


@pytest.mark.parametrize("dtype", [
    pytest.param(jnp.float32, id="float32"),
    slow_case(jnp.bfloat16, id="bfloat16")])
def test_temperature_sweep_kernels(dtype):
  """The kernels in interpret mode, params traced (every route)."""
  x, params = sweep_batch(dtype, seed=1)
  result, m = _sample(x, params, jax.random.key(2), config=SamplerConfig(
      implementation="pallas"), return_mask=True)
  check_rows(np.asarray(x, np.float32), params, result, m, approximate=True)
  want = _sample(x, params, jax.random.key(2), config="xla")
  np.testing.assert_array_equal(np.asarray(result.tokens),
                                np.asarray(want.tokens))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS_SLOW_KERNELS)
def test_temperature_sweep_spec(impl):
  """``spec.rejection_sample``, k = 1: slot 0 accepts (a one-hot draft of
  the argmax) or rejects, and slot 1 (the bonus token) or the residual
  draw is emitted; every emitted logprob is finite and <= 0."""
  x, params = sweep_batch(jnp.float32, seed=2)
  batch = x.shape[0]
  target = jnp.stack([x, x[::-1]], axis=1)
  draft = jnp.argmax(x, axis=-1)[:, None].astype(jnp.int32)
  draft = draft.at[::3].set(0)  # some drafts off the argmax: rejections
  out = spec.rejection_sample(target, draft, jnp.ones(batch, jnp.int32),
                              params, jax.random.key(3), config=impl)
  tokens, lp = np.asarray(out.tokens), np.asarray(out.logprobs)
  emitted = np.arange(2)[None] <= np.asarray(out.num_accepted)[:, None]
  assert np.all((tokens[emitted] >= 0) & (tokens[emitted] < VOCAB))
  assert np.all(np.isfinite(lp[emitted]) & (lp[emitted] <= 0)), lp[emitted]
  # The bonus slot was reached somewhere, at every temperature band.
  bonus = np.asarray(out.num_accepted) == 1
  assert bonus[np.asarray(params.temperature) < 1e-5].any()
  assert bonus[np.asarray(params.temperature) > 1e-5].any()


# ---------------------------------------------------------------------------
# Randomized bad input.
# ---------------------------------------------------------------------------

_SPECIAL_T = np.float32([np.nan, np.inf, -np.inf, -1.0, 0.0, 1e-30, 9e-6,
                         1e-5, 0.3, 1.0, 2.0, 3e38])


def random_case(r, batch, vocab, dtype):
  """Random logits with NaN / +-inf patterns, huge values and all -inf rows,
  and raw params (out-of-range values follow ``canonical``)."""
  x = r.standard_normal((batch, vocab)) * r.choice([1.0, 30.0, 1e4], batch)[
      :, None]
  for b in range(batch):
    pattern = r.integers(8)
    spots = r.choice(vocab, r.integers(1, vocab + 1), replace=False)
    if pattern == 0:
      x[b, spots[:1]] = np.nan
    elif pattern == 1:
      x[b, spots[:1]] = np.inf
    elif pattern == 2:
      x[b, spots] = -np.inf
    elif pattern == 3:
      x[b] = -np.inf
    elif pattern == 4 and dtype == jnp.float32:
      x[b, spots[:2]] = r.choice([3e38, -3e38, 1e34], 2)
  temps = r.choice(_SPECIAL_T, batch)
  top_k = r.choice([-3, 0, 1, 2, vocab - 1, vocab, 2**31 - 1], batch)
  top_p = r.choice(np.float32([np.nan, -1, 0, 1e-6, 0.5, 0.9, 1, 2]), batch)
  min_p = r.choice(np.float32([np.nan, -1, 0, 0.05, 0.5, 1, 5]), batch)
  params = SamplingParams(jnp.asarray(temps), jnp.asarray(top_k, jnp.int32),
                          jnp.asarray(top_p), jnp.asarray(min_p))
  return jnp.asarray(x, dtype), params


def check_invariants(x, params, result):
  """Ids in range; ``valid`` exactly where the documented rule says (the
  logits have no NaN/+inf and a finite max after tempering); valid rows a
  finite logprob <= 0 (0 for greedy rows), invalid rows -inf and the
  argmax token of the sanitized row."""
  x = np.asarray(jnp.asarray(x, jnp.float32))
  tokens, lp = np.asarray(result.tokens), np.asarray(result.logprobs)
  valid = np.asarray(result.valid)
  temps = np.asarray(params.temperature)
  for b in range(x.shape[0]):
    t = temps[b]
    greedy = not (np.isfinite(t) and t >= np.float32(1e-5))
    sanitized = np.where(np.isnan(x[b]), np.inf, x[b])
    with np.errstate(over="ignore", invalid="ignore"):
      y = sanitized if greedy else tempered(sanitized, t)
    ctx = (b, t, tokens[b], lp[b], valid[b])
    assert 0 <= tokens[b] < x.shape[1], ctx
    assert valid[b] == np.isfinite(y.max()), ctx
    if valid[b]:
      assert np.isfinite(lp[b]) and lp[b] <= 0, ctx
      if greedy:
        assert lp[b] == 0 and tokens[b] == np.argmax(y), ctx
    else:
      assert lp[b] == -np.inf and tokens[b] == np.argmax(y), ctx


def test_random_bad_input_xla():
  r = np.random.default_rng(36)
  for case in range(10):
    batch, vocab = int(r.integers(1, 6)), int(r.choice([1, 2, 5, 33, 130]))
    dtype = r.choice([jnp.float32, jnp.bfloat16, jnp.float16])
    x, params = random_case(r, batch, vocab, dtype)
    per_request = bool(r.integers(2))
    key = (jax.random.split(jax.random.key(case), batch) if per_request
           else jax.random.key(case))
    result = _sample(x, params, key, config="xla",
                     positions=jnp.arange(batch) if per_request else None)
    check_invariants(x, params, result)


@pytest.mark.parametrize("dtype", [
    pytest.param(jnp.float32, id="float32"),
    slow_case(jnp.bfloat16, id="bfloat16")])
def test_random_bad_input_kernels(dtype):
  """Params traced; the program of ``test_temperature_sweep_kernels`` (its
  shape and config, masks returned): one interpret-mode compile per dtype."""
  r = np.random.default_rng(37)
  batch = sweep_batch(jnp.float32)[0].shape[0]
  for case in range(3):
    x, params = random_case(r, batch, VOCAB, dtype)
    result, _ = _sample(x, params, jax.random.key(case), config=SamplerConfig(
        implementation="pallas"), return_mask=True)
    check_invariants(x, params, result)


TILE = 2048  # the kernels' philox tile (rng.PHILOX_TILE; threefry's is 1024)


def neg_inf_tile_batch():
  """Rows over three tiles (V = 3 x TILE) with all ``-inf`` tiles: whole rows
  (plain and top-p), the middle tile (plain and top-p), one finite entry in
  the last tile (plain; at -3e38 with top-k; greedy) and the first two
  tiles (min-p)."""
  vocab, r = 3 * TILE, np.random.default_rng(47)
  x = np.full((8, vocab), -np.inf, np.float32)
  x[[2, 3]] = r.standard_normal((2, vocab)) * 3
  x[[2, 3], TILE:2 * TILE] = -np.inf
  x[4, vocab - 5], x[5, vocab - 5], x[7, vocab - 1] = 2.0, -3e38, 1.0
  x[6, 2 * TILE:] = r.standard_normal(TILE) * 3
  params = SamplingParams.make(
      8, temperature=[1.0, 1.0, 1.0, 0.8, 1.0, 1.0, 0.7, 0.0],
      top_k=[0, 0, 0, 0, 0, 3, 0, 0], top_p=[1.0, 0.9, 1.0, 0.9, 1, 1, 1, 1],
      min_p=[0, 0, 0, 0, 0, 0, 0.05, 0])
  return jnp.asarray(x), params


@pytest.mark.kernels
@pytest.mark.parametrize("impl", ["xla", "xla_search", "pallas"])
def test_neg_inf_rows_and_tiles(impl):
  """docs/semantics.md, Bad input: all ``-inf`` rows are invalid with the
  token 0 (the argmax) and logprob ``-inf``; all ``-inf`` tiles are never
  sampled; a lone finite entry in the last tile is sampled with logprob 0.
  Ids stay in ``[0, V)``, per-request keys at several positions."""
  x, params = neg_inf_tile_batch()
  keys = jax.random.split(jax.random.key(47), 8)
  for position in (0, 1, 2**20):
    result = _sample(x, params, keys, positions=jnp.full(8, position),
                     config=SamplerConfig(implementation=impl))
    check_invariants(x, params, result)
    tokens, valid = np.asarray(result.tokens), np.asarray(result.valid)
    np.testing.assert_array_equal(valid, [0, 0, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(tokens[[0, 1, 4, 5, 7]],
                                  [0, 0, x.shape[1] - 5, x.shape[1] - 5,
                                   x.shape[1] - 1])
    assert np.isfinite(np.asarray(x)[np.arange(8), tokens][valid]).all()
    np.testing.assert_allclose(np.asarray(result.logprobs)[[4, 5, 7]], 0,
                               atol=1e-6)


# ---------------------------------------------------------------------------
# Interpret mode compiles once.
# ---------------------------------------------------------------------------

_COMPILE_COUNT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, jaxsample
    from jax import monitoring
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name)
        if name == "/jax/core/compile/backend_compile_duration" else None)
    params = jaxsample.SamplingParams.make(2, temperature=[1.0, 0.0])
    step = jax.jit(lambda x, k: jaxsample.sample(x, params, k,
                                                 config="pallas"))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 64)),
                    jnp.float32)
    counts = []
    for i in range(3):
      jax.block_until_ready(step(x + i, jax.random.key(i)))
      counts.append(len(compiles))
    print(counts, step._cache_size())
""")


def test_interpret_mode_compiles_once():
  """A fresh process (the first interpret-mode call is what used to
  register a trace-context option and recompile): a jitted ``sample`` on
  the kernels compiles on its first call only, with one cache entry."""
  out = subprocess.run([sys.executable, "-c", _COMPILE_COUNT], check=True,
                       capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
  counts, entries = out.rsplit("]", 1)
  counts = [int(c) for c in counts.strip("[ \n").split(",")]
  assert counts[0] > 0 and counts[1] == counts[0] == counts[2], out
  assert int(entries) == 1, out


# ---------------------------------------------------------------------------
# The suite's LLVM level (conftest.LLVM_FAST_COMPILE) keeps results.
# ---------------------------------------------------------------------------

_PROBE = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, jaxsample
    def probe():
      r = np.random.default_rng(0)
      x = jnp.asarray(r.standard_normal((6, 96)) * 4, jnp.float32)
      plain = jaxsample.SamplingParams.make(6, temperature=[1.0, 0.0, 0.7,
                                                            1.3, 2.0, 0.9])
      cut = jaxsample.SamplingParams.make(6, temperature=0.8,
                                          top_k=[0, 5, 0, 9, 0, 3],
                                          top_p=[0.9, 1.0, 0.5, 0.8, 1.0, 1.0],
                                          min_p=[0.0, 0.0, 0.1, 0.0, 0.05, 0.0])
      out = {}
      for name, params, config in (("xla", cut, "xla"),
                                   ("kernel", plain, "pallas")):
        result, mask = jax.jit(lambda x, k, p=params, c=config: jaxsample.sample(
            x, p, k, config=c, return_mask=True))(x, jax.random.key(1))
        out[name] = np.concatenate([np.asarray(result.tokens, np.float32),
                                    np.asarray(result.logprobs),
                                    np.asarray(mask.lse), np.asarray(mask.logz)])
      return out
""")


def test_llvm_level_keeps_results(tmp_path):
  """The sampler at the default XLA:CPU LLVM level (a fresh process, with
  the suite's compile cache: its key holds the level) and at the suite's
  (conftest.LLVM_FAST_COMPILE, when set): the same bits, on the XLA
  reference with filters and the kernels without."""
  if LLVM_FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    pytest.skip("the suite runs XLA at its default LLVM level here")
  script = _PROBE + textwrap.dedent(f"""
      np.savez({str(tmp_path / "default.npz")!r}, **probe())
  """)
  flags = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split()
                   if flag != LLVM_FAST_COMPILE)
  child = subprocess.run([sys.executable, "-c", script], capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                         "XLA_FLAGS": flags,
                                         **compile_cache_env()})
  assert child.returncode == 0, child.stderr
  default = np.load(tmp_path / "default.npz")
  scope = {}
  exec(_PROBE, scope)  # noqa: S102 (the same source as the subprocess's)
  here = scope["probe"]()
  assert sorted(default) == sorted(here)
  for name in here:
    np.testing.assert_array_equal(here[name], default[name], err_msg=name)


# ---------------------------------------------------------------------------
# On the GPU: the rows at V = 32000 (div.full.f32 tempering,
# ex2.approx sums).
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.usefixtures("require_gpu")
@pytest.mark.parametrize("scale", [1.0, 3.0, 50.0])
@pytest.mark.parametrize("filters", [dict(), dict(top_p=0.9),
                                     dict(top_k=50, top_p=0.9)])
def test_small_temperatures_on_the_gpu(scale, filters):
  """Issue 36's report: rows ``randn * scale`` with heads 25.0 / 24.5 at
  V = 32000, T log-uniform in [1e-8, 1]: every row valid, logprobs finite
  and <= 0, kernel tokens equal to the XLA path's, the mask listing the
  token with a consistent logprob."""
  batch, vocab = 64, 32000
  r = np.random.default_rng(int(scale))
  x = (r.standard_normal((batch, vocab)) * scale).astype(np.float32)
  x[:, 3], x[:, 7] = 25.0, 24.5
  temps = np.exp(r.uniform(np.log(1e-8), 0, batch)).astype(np.float32)
  params = SamplingParams.make(batch, temperature=temps, **filters)
  got, m = _sample(jnp.asarray(x), params, jax.random.key(5),
                   config="pallas", return_mask=True)
  want = _sample(jnp.asarray(x), params, jax.random.key(5), config="xla")
  np.testing.assert_array_equal(np.asarray(got.tokens),
                                np.asarray(want.tokens))
  for result in (got, want):
    lp = np.asarray(result.logprobs)
    assert np.asarray(result.valid).all()
    assert np.all(np.isfinite(lp) & (lp <= 0)), lp[~(lp <= 0)]
  m = jax.tree.map(np.asarray, m)
  tokens = np.asarray(got.tokens)
  for b in range(batch):
    y = x[b] / temps[b] if temps[b] >= 1e-5 else x[b]
    assert not m.truncated[b] or tokens[b] in m.ids[b]
    rebuilt = float(y[tokens[b]]) - float(m.lse[b]) - float(m.logz[b])
    tol = 1e-4 + 16 * FP32_EPS * max(1.0, float(np.abs(y).max()))
    assert abs(rebuilt - float(got.logprobs[b])) <= tol, (b, temps[b])
