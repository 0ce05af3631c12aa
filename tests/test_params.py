"""SamplingParams (validation, canonical form, pytree) and SamplerConfig."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src.tuning import RaceLaunch, Tuning

# ---------------------------------------------------------------------------
# SamplingParams.make validation.
# ---------------------------------------------------------------------------

BAD_VALUES = [
    ("temperature", -0.5),
    ("temperature", -1e-30),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -math.inf),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.2),
    ("top_p", math.nan),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", math.nan),
    ("top_k", 2.5),
    ("top_k", math.nan),
]


@pytest.mark.parametrize("field,bad", BAD_VALUES)
@pytest.mark.parametrize("request_index", [0, 2])
def test_make_rejects_bad_value_naming_request_and_field(field, bad,
                                                         request_index):
  good = dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)[field]
  values = [good] * 4
  values[request_index] = bad
  with pytest.raises(ValueError) as info:
    SamplingParams.make(4, **{field: values})
  msg = str(info.value)
  assert f"request {request_index}" in msg
  assert field in msg


@pytest.mark.parametrize("field,bad", BAD_VALUES + [("top_k", True)])
def test_make_rejects_bad_scalar(field, bad):
  with pytest.raises(ValueError, match=field):
    SamplingParams.make(3, **{field: bad})


@pytest.mark.parametrize("field,good", [("temperature", 0.5), ("top_k", 3),
                                        ("top_p", 0.5), ("min_p", 0.5)])
@pytest.mark.parametrize("length", [2, 4, 0])
def test_make_rejects_wrong_sequence_length(field, good, length):
  with pytest.raises(ValueError, match=field):
    SamplingParams.make(3, **{field: [good] * length})


def test_make_rejects_non_1d_values():
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams.make(2, temperature=[[1.0, 1.0]])
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams.make(2, top_p="0.5")


@pytest.mark.parametrize("batch_size", [-1, 2.0, True, None])
def test_make_rejects_bad_batch_size(batch_size):
  with pytest.raises(ValueError, match="batch_size"):
    SamplingParams.make(batch_size)


def test_make_accepts_boundary_values():
  p = SamplingParams.make(5, temperature=[0.0, 1e-6, 1.0, 100.0, 2.0],
                          top_k=[0, -3, 1, 10**6, 7],
                          top_p=[1.0, 1e-6, 0.5, 1.0, 0.999999],
                          min_p=[0.0, 1.0, 0.5, 1e-9, 0.0])
  np.testing.assert_array_equal(np.asarray(p.top_k), [0, -3, 1, 10**6, 7])
  np.testing.assert_array_equal(np.asarray(p.min_p),
                                np.float32([0.0, 1.0, 0.5, 1e-9, 0.0]))


@pytest.mark.parametrize("huge", [2**31])
def test_make_huge_integer_top_k_is_off_or_a_value_error(huge):
  """An integer top_k is valid (``>= V`` means off); one past int32 must be
  either accepted as off or rejected with the documented ValueError naming the
  request and the field, not crash with another exception."""
  try:
    p = SamplingParams.make(2, top_k=[3, huge])
  except ValueError as e:
    assert "request 1" in str(e) and "top_k" in str(e)
  else:
    np.testing.assert_array_equal(np.asarray(p.canonical(1000).top_k), [3, 0])


def test_make_scalars_broadcast_with_dtypes():
  p = SamplingParams.make(4, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05)
  assert p.batch_size == 4
  for name, dtype, value in [("temperature", jnp.float32, 0.7),
                             ("top_k", jnp.int32, 20),
                             ("top_p", jnp.float32, 0.9),
                             ("min_p", jnp.float32, 0.05)]:
    a = getattr(p, name)
    assert a.shape == (4,) and a.dtype == dtype, name
    np.testing.assert_array_equal(np.asarray(a), np.full(4, value, dtype))


def test_make_defaults_are_off():
  p = SamplingParams.make(3)
  np.testing.assert_array_equal(np.asarray(p.temperature), 1.0)
  np.testing.assert_array_equal(np.asarray(p.top_k), 0)
  np.testing.assert_array_equal(np.asarray(p.top_p), 1.0)
  np.testing.assert_array_equal(np.asarray(p.min_p), 0.0)
  assert not np.any(np.asarray(p.canonical(100).truncates()))


def test_make_mixed_scalar_and_sequence():
  p = SamplingParams.make(3, temperature=[0.0, 1.0, 2.0], top_p=0.5,
                          top_k=np.array([1, 2, 3]))
  np.testing.assert_array_equal(np.asarray(p.temperature), [0.0, 1.0, 2.0])
  np.testing.assert_array_equal(np.asarray(p.top_p), np.float32([0.5] * 3))
  np.testing.assert_array_equal(np.asarray(p.top_k), [1, 2, 3])


def test_make_empty_batch():
  p = SamplingParams.make(0)
  assert p.batch_size == 0
  assert all(a.shape == (0,) for a in jax.tree.leaves(p))


# ---------------------------------------------------------------------------
# canonical(): the rules table of the params.py docstring.
# ---------------------------------------------------------------------------

V = 100
NAN, INF = math.nan, math.inf
# (raw value, canonical value) per field, from the docstring's table.
# Temperatures below MIN_TEMPERATURE (1e-5) are greedy; 1e-5 is the least kept.
TEMPERATURE_RULES = [(-1.0, 0.0), (-0.0, 0.0), (NAN, 0.0), (-INF, 0.0),
                     (9.99e-6, 0.0), (1e-5, 1e-5), (0.5, 0.5), (1e-30, 0.0),
                     (3e38, 3e38)]
TOP_K_RULES = [(-3, 0), (0, 0), (1, 1), (V - 1, V - 1), (V, 0), (V + 5, 0),
               (2**31 - 1, 0), (-(2**31), 0), (37, 37)]
TOP_P_RULES = [(NAN, 1.0), (1.0, 1.0), (1.5, 1.0), (INF, 1.0), (0.0, 0.0),
               (-0.5, 0.0), (-INF, 0.0), (0.3, 0.3), (1e-6, 1e-6)]
MIN_P_RULES = [(NAN, 0.0), (0.0, 0.0), (-0.2, 0.0), (-INF, 0.0), (1.5, 1.0),
               (INF, 1.0), (1.0, 1.0), (0.3, 0.3), (1e-9, 1e-9)]


def _rules_params():
  n = len(TEMPERATURE_RULES)
  assert n == len(TOP_K_RULES) == len(TOP_P_RULES) == len(MIN_P_RULES)
  raw = SamplingParams(
      temperature=jnp.array([r for r, _ in TEMPERATURE_RULES], jnp.float32),
      top_k=jnp.array([r for r, _ in TOP_K_RULES], jnp.int32),
      top_p=jnp.array([r for r, _ in TOP_P_RULES], jnp.float32),
      min_p=jnp.array([r for r, _ in MIN_P_RULES], jnp.float32))
  want = dict(
      temperature=np.float32([c for _, c in TEMPERATURE_RULES]),
      top_k=np.int32([c for _, c in TOP_K_RULES]),
      top_p=np.float32([c for _, c in TOP_P_RULES]),
      min_p=np.float32([c for _, c in MIN_P_RULES]))
  return raw, want


@pytest.mark.parametrize("jit", [False, True])
def test_canonical_rules_table(jit):
  raw, want = _rules_params()
  fn = (jax.jit(lambda p: p.canonical(V)) if jit else
        (lambda p: p.canonical(V)))
  got = fn(raw)
  assert isinstance(got, SamplingParams)
  for name, values in want.items():
    a = getattr(got, name)
    assert a.dtype == values.dtype, name
    np.testing.assert_array_equal(np.asarray(a), values, err_msg=name)


def test_canonical_ranges_on_random_values():
  """The documented ranges of the result hold for arbitrary (bad) inputs."""
  r = np.random.default_rng(0)
  n = 2000
  specials = np.float32([NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0])
  def floats():
    x = (r.standard_normal(n) * 3).astype(np.float32)
    special = r.random(n) < 0.3
    x[special] = r.choice(specials, size=int(special.sum()))
    return jnp.asarray(x)
  raw = SamplingParams(floats(), jnp.asarray(r.integers(-200, 300, n), jnp.int32),
                       floats(), floats())
  c = jax.jit(lambda p: p.canonical(V))(raw)
  t, k, p, m = (np.asarray(a) for a in (c.temperature, c.top_k, c.top_p, c.min_p))
  assert np.all(np.isfinite(t)) and np.all(t >= 0)
  assert np.all((k == 0) | ((k >= 1) & (k <= V - 1)))
  assert np.all(np.isfinite(p)) and np.all((p >= 0) & (p <= 1))
  assert np.all(np.isfinite(m)) and np.all((m >= 0) & (m <= 1))
  # In-range values pass through unchanged.
  rt, rk = np.asarray(raw.temperature), np.asarray(raw.top_k)
  ok_t = np.isfinite(rt) & (rt >= np.float32(1e-5))
  np.testing.assert_array_equal(t[ok_t], rt[ok_t])
  ok_k = (rk > 0) & (rk < V)
  np.testing.assert_array_equal(k[ok_k], rk[ok_k])


def test_canonical_is_idempotent():
  raw, _ = _rules_params()
  once = raw.canonical(V)
  twice = once.canonical(V)
  for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(twice)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_truncates():
  p = SamplingParams.make(5, top_k=[0, 3, 0, 0, 0], top_p=[1, 1, 0.5, 1, 1],
                          min_p=[0, 0, 0, 0.1, 0]).canonical(10)
  np.testing.assert_array_equal(np.asarray(p.truncates()),
                                [False, True, True, True, False])
  # top_k >= V is off, so it does not truncate.
  assert not bool(SamplingParams.make(1, top_k=10).canonical(10).truncates()[0])


# ---------------------------------------------------------------------------
# Pytree behaviour.
# ---------------------------------------------------------------------------


def test_sampling_params_is_a_pytree():
  p = SamplingParams.make(4, temperature=[0.1, 0.2, 0.3, 0.4], top_k=[1, 2, 3, 4])
  leaves = jax.tree.leaves(p)
  assert len(leaves) == 4
  doubled = jax.tree.map(lambda a: a * 2, p)
  assert isinstance(doubled, SamplingParams)
  np.testing.assert_array_equal(np.asarray(doubled.top_k), [2, 4, 6, 8])
  sliced = jax.tree.map(lambda a: a[1:3], p)
  assert sliced.batch_size == 2
  np.testing.assert_allclose(np.asarray(sliced.temperature), [0.2, 0.3])


def test_sampling_params_through_jit_without_retracing():
  traces = []

  @jax.jit
  def f(p):
    traces.append(1)
    return p.temperature * 2 + p.top_p, p

  a = SamplingParams.make(3, temperature=[0.5, 1.0, 2.0], top_p=0.5)
  b = SamplingParams.make(3, temperature=[0.1, 0.0, 9.0], top_p=0.25, top_k=7)
  out_a, back = f(a)
  out_b, _ = f(b)
  np.testing.assert_allclose(np.asarray(out_a), [1.5, 2.5, 4.5])
  np.testing.assert_allclose(np.asarray(out_b), [0.45, 0.25, 18.25], rtol=1e-6)
  assert isinstance(back, SamplingParams)
  assert len(traces) == 1  # new values, same shapes: no retrace


def test_sampling_params_is_frozen():
  p = SamplingParams.make(1)
  with pytest.raises(Exception):
    p.temperature = jnp.zeros((1,))


# ---------------------------------------------------------------------------
# SamplerConfig.
# ---------------------------------------------------------------------------


def test_sampler_config_defaults():
  c = SamplerConfig()
  assert c.rng == "philox"
  assert c.implementation == "auto"
  assert c.use_fp64_gumbel is False
  assert c.tuning is None


@pytest.mark.parametrize("kw", [
    dict(rng="mt19937"), dict(rng="Philox"), dict(implementation="cuda"),
    dict(implementation="triton"), dict(max_candidates=100),
    dict(max_candidates=8), dict(tuning="fast")])
def test_sampler_config_rejects_bad_values(kw):
  with pytest.raises(ValueError, match=next(iter(kw))):
    SamplerConfig(**kw)


@pytest.mark.parametrize("kw", [
    dict(rng="threefry"), dict(rng="philox"), dict(implementation="xla"),
    dict(implementation="xla_search"),
    dict(implementation="pallas"), dict(implementation="auto"),
    dict(max_candidates=16), dict(use_fp64_gumbel=True),
    dict(tuning=Tuning(gumbel=RaceLaunch(num_warps=4, num_stages=2)))])
def test_sampler_config_accepts_good_values(kw):
  c = SamplerConfig(**kw)
  for name, value in kw.items():
    assert getattr(c, name) == value


def test_sampler_config_hashable_and_frozen():
  a = SamplerConfig(rng="threefry", tuning=Tuning(gumbel=RaceLaunch(block_size=64)))
  b = SamplerConfig(rng="threefry", tuning=Tuning(gumbel=RaceLaunch(block_size=64)))
  assert a == b and hash(a) == hash(b)
  assert a != SamplerConfig(rng="threefry",
                            tuning=Tuning(gumbel=RaceLaunch(block_size=128)))
  assert len({a, b, SamplerConfig()}) == 2
  with pytest.raises(Exception):
    a.rng = "philox"
