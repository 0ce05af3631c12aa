"""The suite's persistent compile cache for a child interpreter (a doc block,
a probe at another XLA level): environment variables, read by JAX at start."""

from __future__ import annotations

import jax


def compile_cache_env() -> dict[str, str]:
  """``JAX_*`` variables giving a child this process's compile cache
  directory, keeping every program the child compiles: a fresh
  interpreter's programs are mostly eager operations that compile in well
  under the suite's 0.1 s threshold and would otherwise compile again on
  every run.  Uncapped, as the suite's own processes are
  (``tests/conftest.py`` trims the directory once a run).  Empty when the
  suite runs without a cache."""
  cache = jax.config.jax_compilation_cache_dir
  if not cache:
    return {}
  return {"JAX_COMPILATION_CACHE_DIR": cache,
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
