"""Pytest set-up for the jaxsample test suite: JAX's CPU devices, XLA flags
and compile cache, the markers' hooks (GPU skips, collection order, the
compatibility tier's tests) and the fixtures.  Plain helpers (oracles,
statistics, runners, parametrization cases) live in ``tests/helpers/``.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
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
#                ${XDG_CACHE_HOME:-~/.cache}/jaxsample/test-compiles), trimmed
#                to JAXSAMPLE_TEST_JAX_CACHE_MB megabytes when a run starts
#                (``trim_cache``), not on every write: JAX's capped cache
#                (``jax_compilation_cache_max_size``) reads the whole
#                directory on every write, 0.58 s a write at 7,700 files, so
#                a cold run's writes cost time quadratic in their number;
#   tmp (unset)  one for this run, removed when the run ends; the
#                pytest-xdist workers share it (the controller imports this
#                file first and the workers inherit _RUN_CACHE_VAR);
#   off          none.
# JAX's key (jax/_src/cache_key.py ``get``) hashes the program's StableHLO
# (debug info stripped), the jaxlib version, the backend's platform version,
# XLA_FLAGS and the compile options: an entry that the code or the stack no
# longer produces is never loaded, only trimmed.
CACHE_MB_DEFAULT = 1024
_RUN_CACHE_VAR = "JAXSAMPLE_TEST_RUN_CACHE"
_TRIMMED_VAR = "JAXSAMPLE_TEST_CACHE_TRIMMED"
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
  if _TRIMMED_VAR not in os.environ:  # once a run: not in the workers
    os.environ[_TRIMMED_VAR] = _CACHE
    from helpers.cache_trim import trim_cache  # noqa: E402
    trim_cache(_CACHE, int(_CACHE_MB) * 2**20)
if _CACHE != "off":
  jax.config.update("jax_compilation_cache_dir", _CACHE)
  # 0.1 s, not 0.5: warm, test_mask.py took 39.1 CPU-s against 47.4
  # (benchmarks/results/2026-11-27n-cpu-suite-warm/threshold/).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import pytest  # noqa: E402

from jaxsample.models import EMBEDDED_DIR, load_embedded  # noqa: E402
from jaxsample.bench import peers  # noqa: E402

# JAXSAMPLE_TEST_COMPILE_LOG=FILE: per-test compile accounting (the hook).
from helpers.compile_log import pytest_runtest_protocol  # noqa: E402,F401


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
    "test_xla_search.py", "test_vocab_parallel.py", "test_sharding.py",
    "test_spec_kernels.py",
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


@pytest.fixture
def require_gpu():
  """Skips the test unless JAX runs on a GPU (use only in gpu-marked tests)."""
  _skip_without_gpu()


@pytest.fixture(scope="module")
def torch():
  """torch with CUDA (the copied peers' tests), or a skip saying so."""
  module = peers.torch_module()
  if module is None:
    pytest.skip("needs torch with CUDA")
  return module


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
