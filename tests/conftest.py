"""Shared fixtures and helpers for the jaxsample test suite.

The helpers here are independent re-implementations of the documented
semantics (``jaxsample/reference.py`` and ``jaxsample/params.py`` docstrings)
in numpy float64; they never call the code under test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import math
import os
import re
import shutil
import statistics
import tempfile

import jax

# Must run before any JAX backend is initialised (sharding tests use 4 CPU
# devices).  conftest.py is imported before every test module.
jax.config.update("jax_num_cpu_devices", 4)

# XLA:CPU compiles dominate the CPU suite (interpret-mode kernels are large
# programs; a truncating ``sample`` on the kernels took 4x longer to compile
# at the default LLVM level than at 0, with the same run time on these small
# shapes).  LLVM's optimisation level does not change results (XLA:CPU
# compiles without fast-math; ``test_edges.test_llvm_level_keeps_results``
# compares both levels bit for bit), so CPU-only runs compile at level 0.
# Not with a GPU plugin installed (the flag also applies to XLA:GPU, whose
# speed the GPU tests measure); JAXSAMPLE_TEST_XLA_OPT=default opts out.
LLVM_FAST_COMPILE = "--xla_backend_optimization_level=0"
_GPU_PLUGIN = any(dist.metadata["Name"].lower().startswith(("jax-cuda",
                                                            "jax_cuda"))
                  for dist in importlib.metadata.distributions())
if ((os.environ.get("JAX_PLATFORMS") == "cpu" or not _GPU_PLUGIN) and
    os.environ.get("JAXSAMPLE_TEST_XLA_OPT") != "default" and
    LLVM_FAST_COMPILE not in os.environ.get("XLA_FLAGS", "").split()):
  # (pytest-xdist workers inherit the controller's flags: add it once.)
  os.environ["XLA_FLAGS"] = " ".join(
      filter(None, (os.environ.get("XLA_FLAGS"), LLVM_FAST_COMPILE)))

# The persistent compilation cache: a program that another test, worker or
# earlier run already compiled is loaded instead of compiled again (XLA's
# compile is most of an interpret-mode kernel's first call; tracing and
# lowering are still paid).  JAXSAMPLE_TEST_JAX_CACHE picks it:
#   DIR          kept across runs (``scripts/dev test`` passes
#                ${XDG_CACHE_HOME:-~/.cache}/jaxsample/test-compiles), at most
#                JAXSAMPLE_TEST_JAX_CACHE_MB megabytes: JAX's LRU cache evicts
#                the least recently used entries (needs ``filelock``);
#   tmp (unset)  one for this run, removed when the run ends; the
#                pytest-xdist workers share it (the controller imports this
#                file first and the workers inherit _RUN_CACHE_VAR);
#   off          none.
# JAX's key (jax/_src/cache_key.py ``get``) hashes the program's StableHLO
# (debug info stripped), the jaxlib version, the backend's platform version,
# XLA_FLAGS and the compile options: an entry that the code or the stack no
# longer produces is never loaded, only evicted.
CACHE_MB_DEFAULT = 1024
_RUN_CACHE_VAR = "JAXSAMPLE_TEST_RUN_CACHE"
_CACHE = os.environ.get("JAXSAMPLE_TEST_JAX_CACHE") or "tmp"
_OWN_CACHE = None  # a per-run cache this process made (the controller's)
if _CACHE == "tmp" and _RUN_CACHE_VAR in os.environ:  # a worker
  _CACHE = os.environ[_RUN_CACHE_VAR]
elif _CACHE == "tmp":
  _CACHE = _OWN_CACHE = tempfile.mkdtemp(prefix="jaxsample-test-compiles-")
  os.environ[_RUN_CACHE_VAR] = _CACHE
elif _CACHE != "off":
  _CACHE_MB = os.environ.get("JAXSAMPLE_TEST_JAX_CACHE_MB",
                             str(CACHE_MB_DEFAULT))
  if not _CACHE_MB.isdigit() or int(_CACHE_MB) < 1:
    raise ValueError(f"JAXSAMPLE_TEST_JAX_CACHE_MB must be a whole number of "
                     f"megabytes >= 1; got {_CACHE_MB!r} (unset it for "
                     f"{CACHE_MB_DEFAULT})")
  if importlib.util.find_spec("filelock") is None:
    raise ImportError(f"JAXSAMPLE_TEST_JAX_CACHE={_CACHE} keeps a capped "
                      "cache, which needs the filelock package: install the "
                      "test extra (pip install -e '.[test]'), or set "
                      "JAXSAMPLE_TEST_JAX_CACHE=tmp")
  jax.config.update("jax_compilation_cache_max_size",
                    int(_CACHE_MB) * 2**20)
if _CACHE != "off":
  jax.config.update("jax_compilation_cache_dir", _CACHE)
  # 0.1 s, not 0.5: warm, test_mask.py took 39.1 CPU-s against 47.4
  # (benchmarks/results/2026-11-27n-cpu-suite-warm/threshold/).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jaxsample  # noqa: E402
from jaxsample.models import EMBEDDED_DIR, load_embedded  # noqa: E402

# JAXSAMPLE_TEST_COMPILE_LOG=FILE: per-test compile accounting (the hook).
from helpers.compile_log import pytest_runtest_protocol  # noqa: E402,F401

IMPLEMENTATIONS = ("xla", "pallas")
GENERATORS = ("philox", "threefry")
FP32_EPS = float(np.finfo(np.float32).eps)


# ---------------------------------------------------------------------------
# Test order.
# ---------------------------------------------------------------------------

# Modules by CPU time, most first (worker-seconds, --durations on 2 cores:
# interpret-mode compiles dominate).  ``scripts/dev test`` hands whole
# modules to workers in collection order (``--dist loadfile
# --no-loadscope-reorder``), so the longest start first and the short ones
# fill the gaps at the end.
_SLOWEST_MODULES = (
    "test_docs.py", "test_sample.py", "test_serve_loop.py", "test_threshold.py",
    "test_xla_search.py", "test_sharding.py", "test_spec_kernels.py",
    "test_threshold_search.py", "test_spec.py", "test_mask_kernels.py",
    "test_race_kernel.py", "test_spec_serving.py", "test_mask.py",
    "test_truncated_sampling.py", "test_batch_invariance.py", "test_edges.py", "test_spec_edges.py",
    "test_fp64_gumbel.py", "test_bench.py", "test_serving.py",
    "test_model.py")


def pytest_unconfigure(config):
  if _OWN_CACHE is not None and not hasattr(config, "workerinput"):
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The compatibility tier (``scripts/dev compat``: jax 0.12, a wheel without
# extras) runs these besides the ``compat``-marked files: one interpret-mode
# case per kernel family (the Gumbel race, the threshold search with its
# final select, the speculative verifier), each already in the default tier.
# Cold, an interpret-mode program costs 20-60 CPU-seconds: keep it short
# (docs/testing.md, "Compatibility tier").
COMPAT_TESTS = (
    "tests/test_sample.py::test_pallas_matches_xla[1x1007-float32-philox-fp32]",
    "tests/test_threshold.py::test_kept_sets_match_oracle[1007]",
    "tests/test_spec_kernels.py::test_kernel_edge_cases_match_the_reference[1-philox-False]",
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_SLOWEST_MODULES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
  for item in items:
    if item.nodeid in COMPAT_TESTS:
      item.add_marker(pytest.mark.compat)


# ---------------------------------------------------------------------------
# Fixtures.
# ---------------------------------------------------------------------------


def _skip_without_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip(f"needs a GPU; jax.default_backend() is "
                f"{jax.default_backend()!r}")


def pytest_runtest_setup(item):
  """Every ``gpu``-marked test (or case) skips, with the reason, off a GPU."""
  if item.get_closest_marker("gpu") is not None:
    _skip_without_gpu()


def slow_case(*values, id=None):
  """A parametrization case outside the default CPU suite (marked ``slow``):
  more interpret-mode kernel time than its coverage is worth on every CPU
  run; ``scripts/dev test --all`` and the GPU run take it."""
  return pytest.param(*values, marks=pytest.mark.slow, id=id)


# ``IMPLEMENTATIONS`` with the kernel case ``slow``: for tests whose kernel
# path other tests of the default suite already pin to the reference.
IMPLEMENTATIONS_SLOW_KERNELS = ("xla", slow_case("pallas", id="pallas"))


# ``GENERATORS`` for kernel-only tests with the threefry case ``slow``, and
# ``(impl, gen)`` pairs with the kernels' threefry case ``slow``: the
# kernels' threefry noise is pinned to the reference by the default parity
# cases of test_sample and test_rng.
GENERATORS_SLOW_THREEFRY = ("philox", slow_case("threefry", id="threefry"))
IMPLEMENTATIONS_BY_GENERATOR = (
    pytest.param("xla", "philox", id="xla-philox"),
    pytest.param("xla", "threefry", id="xla-threefry"),
    pytest.param("pallas", "philox", id="pallas-philox"),
    slow_case("pallas", "threefry", id="pallas-threefry"))


def on_gpu(*values, id=None):
  """A parametrization case that runs on a GPU only (marked ``gpu``): the
  shapes and models interpret mode is too slow for.  Tests with such cases
  are marked ``kernels``: their other cases run on every backend, and the
  GPU run (``-m "gpu or kernels or slow"``) takes them all."""
  return pytest.param(*values, marks=pytest.mark.gpu, id=id)


@pytest.fixture
def require_gpu():
  """Skips the test unless JAX runs on a GPU (use only in gpu-marked tests)."""
  _skip_without_gpu()


@pytest.fixture(scope="session")
def embedded():
  """``(Transformer, tokenizer)``: the embedded model, loaded once."""
  if not (EMBEDDED_DIR / "config.json").exists():
    pytest.skip(f"no embedded model in {EMBEDDED_DIR} (scripts/train_model.py)")
  return load_embedded()


@pytest.fixture
def full_precision():
  """fp32 matmuls at full precision while the test runs (a no-op on CPU).
  Under JAX's GPU default (TF32) a model's logits depend on the batch shape
  by ~1e-3, and a serving loop (4 slots) and ``generate`` (8 rows) run
  different shapes: the embedded model's logprobs differed by up to 7.6e-4
  on an H100."""
  with jax.default_matmul_precision("highest"):
    yield


_MAP_COUNT_LIMIT = 40_000  # of the kernel's default vm.max_map_count, 65530


def _memory_map_count() -> int:
  try:
    with open("/proc/self/maps", "rb") as maps:
      return sum(1 for _ in maps)
  except OSError:  # not Linux: no such limit to watch
    return 0


@pytest.fixture(autouse=True)
def release_compiled_code():
  """Drops JAX's compiled code once the process holds many memory maps:
  XLA:CPU maps memory for every executable, and a long module otherwise passes
  the kernel's ``vm.max_map_count`` (65530 maps) and aborts in a compile."""
  yield
  if _memory_map_count() > _MAP_COUNT_LIMIT:
    jax.clear_caches()


def sort_operands(stablehlo: str) -> list[str]:
  """The operand types of every sort in lowered StableHLO text."""
  return re.findall(r"stablehlo\.sort.*?\}\) : \(([^)]*)\)", stablehlo,
                    re.DOTALL)


def outside_conds(jaxpr, found=None, *, nested: bool = False) -> dict:
  """The ``lax.cond``s of a jaxpr outside kernels (``"cond"``: how many run on
  every call, outside any cond's branches; ``"nested"``: how many inside
  branches) and the kernels (by name) that run on every call.  On a GPU
  each cond that runs sends its predicate to the host."""
  found = {"cond": 0, "nested": 0} if found is None else found
  # ``lax.platform_dependent``'s cond picks its branch while compiling (its
  # index is a ``platform_index``): no predicate travels, no nesting.
  platform = {v for eqn in jaxpr.eqns if eqn.primitive.name == "platform_index"
              for v in eqn.outvars}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "pallas_call":
      if not nested:
        found[eqn.params["name"]] = True
      continue
    runtime_cond = name == "cond" and eqn.invars[0] not in platform
    if runtime_cond:
      found["nested" if nested else "cond"] += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
        if hasattr(sub, "eqns"):
          outside_conds(sub, found, nested=nested or runtime_cond)
  return found


# ---------------------------------------------------------------------------
# The public sampler, jitted once per static config (shares compilations).
# ---------------------------------------------------------------------------

_jitted_sample = jax.jit(jaxsample.sample, static_argnames=("config",))


def without_truncation(params, vocab: int) -> bool:
  """Whether no sampled request of concrete ``params`` has a filter on."""
  canon = params.canonical(vocab)
  return not np.any(np.asarray(canon.truncates()) &
                    (np.asarray(canon.temperature) > 0))


_closing_over: dict = {}


def closing_over(params, fn, *static):
  """``jax.jit(fn(params))``, one per params value and ``static`` (cached).

  The kernel path's static-params case (``rowwise.cond``): with params the
  jitted function closes over, a batch without filters compiles the Gumbel
  branch alone; in interpret mode the truncation branch it skips costs ~10 s
  of compile per shape.  Tests of untruncated batches on the kernels use it;
  ``test_sample.test_static_and_traced_params_agree`` pins it to the traced
  path.
  """
  values = tuple((a.dtype.str, a.shape, a.tobytes())
                 for a in map(np.asarray, jax.tree.leaves(params)))
  key = (values,) + static
  if key not in _closing_over:
    _closing_over[key] = jax.jit(fn(params))
  return _closing_over[key]


def run_sample(logits, params, key, *, positions=None, impl="xla",
               rng="philox", fp64=False, jit=True, traced_params=False,
               **config_kw):
  """``jaxsample.sample`` with a config built from the arguments, as numpy.

  Jitted by default (compilations are cached per shape and config; kernel
  runs of batches without filters close over the params, ``closing_over``,
  unless ``traced_params``); the FP64 path runs under
  ``jax.enable_x64(True)`` as the docs require for jit.
  """
  config = jaxsample.SamplerConfig(rng=rng, implementation=impl,
                                   use_fp64_gumbel=fp64, **config_kw)
  fn = functools.partial(_jitted_sample if jit else jaxsample.sample,
                         config=config)
  if (jit and impl == "pallas" and not traced_params and
      without_truncation(params, np.shape(logits)[1])):
    closed = closing_over(params, lambda p: lambda x, k, pos: jaxsample.sample(
        x, p, k, positions=pos, config=config), config)
    fn = lambda x, p, k, positions: closed(x, k, positions)
  with jax.enable_x64(True) if fp64 and jit else contextlib.nullcontext():
    out = fn(logits, params, key, positions=positions)
    return jax.tree.map(np.asarray, jax.device_get(out))


# ---------------------------------------------------------------------------
# Numpy float64 oracle of the kept set (reference.py docstring, step 4).
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class OracleKeep:
  """Oracle result for one row.

  kept: the kept set under exact float64 arithmetic.
  admissible: every kept set reachable when the min-p threshold or the top-p
    target ``p * sum e`` moves within the fp32 rounding margin (always
    contains ``kept``).  More than one entry means the row lies on a rounding boundary
    and fp32 arithmetic may legitimately land on an adjacent threshold.
  """

  kept: np.ndarray
  admissible: "UpwardSets"

  @property
  def near_boundary(self) -> bool:
    return len(self.admissible) > 1

  def admits(self, kept) -> bool:
    """Whether ``kept`` is one of the admissible sets."""
    return self.admissible.holds(np.asarray(kept, bool))

  def probs(self, y) -> np.ndarray:
    """The processed distribution: softmax of ``y`` on ``kept`` (float64)."""
    y = np.asarray(y, np.float64)
    z = np.where(self.kept, y, -np.inf)
    z = np.exp(z - z.max())
    return z / z.sum()


def _oracle_thresholds(ys_desc, finite_desc, k, p, t1, rtol):
  """Thresholds for sorted-descending float64 ``ys``: ``(exact, candidates)``.

  ``candidates`` are the thresholds whose top-p crossing mass lies within
  ``rtol * total`` of the target ``p * total`` (the exact one included).
  """
  ymax = ys_desc[0]
  surv1 = finite_desc & (ys_desc >= t1)
  n1 = int(surv1.sum())
  # top-k among min-p survivors: the k-th largest survivor (ties kept).
  kk = min(k, n1) if k > 0 else n1
  t2 = ys_desc[max(kk - 1, 0)]
  surv = finite_desc & (ys_desc >= t1) & (ys_desc >= t2)
  if p >= 1:
    t = max(t1, t2)
    return t, {t}
  e = np.where(surv, np.exp(ys_desc - ymax), 0.0)
  cum = np.cumsum(e)
  total = cum[-1]
  last = int(surv.sum()) - 1  # survivors are a prefix of the sorted row

  def crossing(target):
    reached = cum >= target
    # Past the total (only with a positive rounding shift): keep all survivors.
    return int(np.argmax(reached)) if reached.any() else last

  j = crossing(p * total)
  j_lo, j_hi = crossing((p - rtol) * total), crossing((p + rtol) * total)
  exact = max(t1, t2, ys_desc[j])
  return exact, {max(t1, t2, ys_desc[i]) for i in range(j_lo, j_hi + 1)}


def top_p_rtol(vocab: int) -> float:
  """The oracle's default top-p margin: ``FP32_EPS * (4 + log2(V) / 8)``
  relative to the survivors' mass (4.5 eps at V = 16, 5.2 at 1007, 6.2 at
  151936; ``oracle_keep`` says why)."""
  return FP32_EPS * (4 + math.log2(max(vocab, 2)) / 8)


def oracle_keep(y, top_k: int, top_p: float, min_p: float, *,
                rtol: float | None = None) -> OracleKeep:
  """Kept set of one row of tempered logits ``y`` per the documented rule.

  min-p (``y >= max + log(min_p)``), then top-k among the survivors (ties at
  the k-th value kept), then top-p on the distribution renormalised over the
  survivors (the crossing token kept), all in float64 on a sort.  Parameters
  take their documented "off" values: ``top_k <= 0`` or ``>= V``, ``top_p >=
  1``, ``min_p <= 0``; ``top_p <= 0`` and ``min_p > 1`` follow the canonical
  rules.  ``top_p`` and ``min_p`` are rounded to fp32 first (the sampler's
  parameter dtype).  ``rtol`` is the relative fp32 rounding margin of the
  top-p mass comparison: a row whose crossing mass lies within ``rtol *
  total`` of ``p * total`` is near a boundary and every threshold in that
  window is admissible.

  The default margin, ``top_p_rtol(V) = FP32_EPS * (4 + log2(V) / 8)``, is
  what the sampler's fp32 comparison ``mass(v) >= p * total`` can be off by,
  relative to ``total`` (all terms are positive, so every error is relative
  to it).  The XLA reference (``reference.keep_threshold``) compares a
  cumulative sum of the sorted ``exp(y - max)`` (XLA's ``reduce_window``
  scan) with ``p`` times its last entry; the kernels
  (``pallas/threshold.py``) compare per-candidate masses summed in slot
  order with a normalizer made of the stats pass's lane-wise sums (a tree
  over lanes and splits) and the candidates' sum (top-k rows: the
  candidates' alone; large kept sets: the window pass's sums, searched bit
  by bit).  The error has a part
  independent of ``V`` (the terms' ``exp``, 1-2 ulp each, the GPU's
  ``ex2.approx`` within 2^-22; the fp32 rounding of the two compared sums
  and of ``p * total``: about 2 eps together) and a summation part that grows
  with the depth of the sums, about ``log2(V)`` levels of which each adds
  rounding of random sign.  A worst-case bound (``log2(V) * eps`` for a
  tree, ``n * eps / 2`` for a sequential sum of ``n`` terms) exceeds ``1 -
  p`` for p = 0.999999 (8.5 eps) from V = 256 on, and would leave that p
  unchecked; measured errors are far smaller.  Measured (CPU, jax 0.11.2)
  in eps of the total: the reference's error at the crossing, over 4096 rows
  per kind (random, wide, unit normal, zipf, near-flat) and p in {0.5, 0.9,
  0.999999}: at most 3.0 at V = 16, 5.1 at 1007 (a wide row at p = 0.9,
  where a flip needs a boundary within that distance: no flip seen), 3.9 at
  151936 (160 rows per kind); crossings actually moved (the smallest
  ``rtol`` admitting the set kept) on thousands of rows whose ``p`` lies
  within 40 fp32 ulps of a boundary: reference at most 2.2 (V = 16, 1007,
  151936), kernels 2.2 (V = 16), 2.5 (1007), 2.4 (20000, window search),
  1.3 (151936); on ``oracle_grid`` at most 2.0.  The default is 2x the
  largest moved crossing and above every error seen at a crossing but one
  (5.1 at V = 1007 against 5.2), and below ``1 - p = 8.5 eps`` for p =
  0.999999, so rows whose crossing lies further than ``rtol`` from every
  boundary are checked exactly there too (``test_threshold``'s
  ``tail_rows``).  On a V = 151936 row of many small tokens a window of a
  few eps still spans several of them: such rows are near a boundary.
  """
  y = np.asarray(y, np.float64)
  vocab = y.size
  rtol = top_p_rtol(vocab) if rtol is None else rtol
  k = int(top_k) if 0 < int(top_k) < vocab else 0
  p = float(np.float32(top_p))
  m = float(np.float32(min_p))
  p = 1.0 if (math.isnan(p) or p >= 1) else max(p, 0.0)
  m = 0.0 if (math.isnan(m) or m <= 0) else min(m, 1.0)
  order = np.argsort(-y, kind="stable")
  ys = y[order]
  finite = ys > -np.inf
  ymax = ys[0]
  assert np.isfinite(ymax), "oracle_keep needs a valid row"
  t1 = ymax + math.log(m) if m > 0 else -np.inf
  # fp32 rounding of max + log(min_p): a few ulps of the operands.
  d1 = 0.0 if m in (0.0, 1.0) else 4 * FP32_EPS * (abs(ymax) + abs(math.log(m)))
  exact, _ = _oracle_thresholds(ys, finite, k, p, t1, rtol)
  thresholds = set()
  for s1 in (0.0, -d1, d1):
    thresholds |= _oracle_thresholds(ys, finite, k, p, t1 + s1, rtol)[1]
  kept = (y >= exact) & (y > -np.inf)
  # {y >= t} is fixed by its size: one set per distinct count (sets are built
  # on demand: a window near p = 1 may hold thousands).
  n_finite = int(finite.sum())
  counts = np.minimum(np.searchsorted(-ys, -np.fromiter(thresholds, float),
                                      side="right"), n_finite)
  first = int(kept.sum())
  others = sorted(set(counts.tolist()) - {first})
  return OracleKeep(kept, UpwardSets(y, ys, [first] + others))


class UpwardSets:
  """The upward-closed sets ``{y >= ys[n - 1]}`` (``ys`` = ``y`` sorted
  descending) for each kept count ``n`` of ``counts``, as a lazy sequence of
  boolean masks."""

  def __init__(self, y, ys, counts):
    self.y, self.ys, self.counts = y, ys, counts

  def __len__(self):
    return len(self.counts)

  def __getitem__(self, i):
    n = self.counts[i]
    if n == 0:
      return np.zeros(self.y.shape, bool)
    return (self.y >= self.ys[n - 1]) & (self.y > -np.inf)

  def __iter__(self):
    return (self[i] for i in range(len(self)))

  def holds(self, kept) -> bool:
    n = int(kept.sum())
    return n in self.counts and np.array_equal(
        kept, self[self.counts.index(n)])


# ---------------------------------------------------------------------------
# Statistics.
# ---------------------------------------------------------------------------


def chi2_critical(df: int, alpha: float) -> float:
  """Upper ``alpha`` critical value of chi-square(df), Wilson-Hilferty."""
  if df < 1:
    raise ValueError(f"df must be >= 1; got {df}")
  z = statistics.NormalDist().inv_cdf(1.0 - alpha)
  h = 2.0 / (9.0 * df)
  return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2_statistic(counts, probs, *, min_expected: float = 5.0):
  """Pearson chi-square of ``counts`` against ``probs`` (zero-prob bins must be
  empty), pooling bins with expected count below ``min_expected``.

  Returns ``(statistic, degrees_of_freedom)``.
  """
  counts = np.asarray(counts, np.float64)
  probs = np.asarray(probs, np.float64)
  n = counts.sum()
  support = probs > 0
  assert counts[~support].sum() == 0, "samples outside the support"
  counts, expected = counts[support], n * probs[support]
  # Pool the smallest bins together until the pooled bin expects enough.
  order = np.argsort(expected)
  counts, expected = counts[order], expected[order]
  if expected[0] < min_expected:
    cut = int(np.searchsorted(np.cumsum(expected), min_expected)) + 1
    cut = min(cut, len(expected))
    counts = np.append(counts[:cut].sum(), counts[cut:])
    expected = np.append(expected[:cut].sum(), expected[cut:])
  stat = float(np.sum((counts - expected) ** 2 / expected))
  return stat, len(expected) - 1


def assert_chi2_fits(tokens, probs, *, alpha: float = 1e-3):
  """Asserts sampled ``tokens`` fit ``probs`` by a chi-square test at ``alpha``."""
  tokens = np.asarray(tokens)
  probs = np.asarray(probs, np.float64)
  counts = np.bincount(tokens, minlength=probs.size)
  stat, df = chi2_statistic(counts, probs)
  if df == 0:  # a point mass: every sample must be that token
    assert np.all(probs[tokens] == 1.0)
    return
  crit = chi2_critical(df, alpha)
  assert stat <= crit, (f"chi-square {stat:.2f} > critical {crit:.2f} "
                        f"(df={df}, alpha={alpha}, n={tokens.size}); counts "
                        f"{counts.tolist()} vs expected "
                        f"{np.round(probs * tokens.size, 1).tolist()}")


def assert_binned_chi2_fits(tokens, probs, *, bins: int = 16,
                            alpha: float = 1e-3):
  """``assert_chi2_fits`` with the tokens grouped by descending probability
  into ``bins`` groups of about equal mass: for large supports, where most
  tokens expect a few draws, a distortion that moves mass between likely
  and unlikely tokens (a wrong temperature, a wrong normalizer) shows at far
  fewer draws than on the pooled per-token bins."""
  tokens = np.asarray(tokens)
  probs = np.asarray(probs, np.float64)
  assert probs[tokens].min() > 0, "samples outside the support"
  order = np.argsort(-probs, kind="stable")
  group = np.empty(probs.size, np.int64)
  group[order] = np.minimum((np.cumsum(probs[order]) - probs[order]) * bins,
                            bins - 1).astype(np.int64)
  assert_chi2_fits(group[tokens], np.bincount(group, probs, minlength=bins),
                   alpha=alpha)


# Shared statistical settings: one row of STAT_VOCAB tokens drawn STAT_DRAWS
# times per configuration (chi-square against the exact distribution).
STAT_VOCAB = 16
STAT_DRAWS = 4096
STAT_CONFIGS = {
    "plain": dict(temperature=1.0),
    "cold": dict(temperature=0.6),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.0, min_p=0.15),
    "combined": dict(temperature=1.4, top_k=10, top_p=0.9, min_p=0.02),
}


def make_params(batch, **kw):
  """``SamplingParams`` built directly from arrays (no validation): the traced
  path, where out-of-range values follow ``SamplingParams.canonical``."""
  defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
  defaults.update(kw)
  dt = dict(temperature=jnp.float32, top_k=jnp.int32, top_p=jnp.float32,
            min_p=jnp.float32)
  return jaxsample.SamplingParams(**{
      name: jnp.broadcast_to(jnp.asarray(v, dt[name]), (batch,))
      for name, v in defaults.items()})
