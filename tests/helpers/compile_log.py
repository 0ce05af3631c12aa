"""Per-test JAX compile accounting (opt-in): ``JAXSAMPLE_TEST_COMPILE_LOG=FILE``.

For every test (setup, call and teardown together) appends one JSON line to
FILE: the CPU seconds (user + sys of the process), JAX's tracing, lowering
and backend-compile seconds (``jax.monitoring``'s duration events, wall
seconds), the number of backend compiles and persistent-cache hits, and
each program whose backend compile took at least ``_PROGRAM_MIN_S`` (its
name and seconds).  pytest-xdist workers append to the same file.  The
suite's profile (``benchmarks/results/2026-11-27h-cpu-suite-share/``) came
from these lines.
"""

from __future__ import annotations

import json
import os

import pytest
from jax import monitoring

__all__ = ["pytest_runtest_protocol"]

_LOG = os.environ.get("JAXSAMPLE_TEST_COMPILE_LOG")
_PROGRAM_MIN_S = 1.0
_PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
           "/jax/core/compile/backend_compile_duration": "compile_s"}
_current: dict = {}


def _on_duration(event, duration, fun_name=None, **_):
  phase = _PHASES.get(event)
  if phase is None or not _current:
    return
  _current[phase] += duration
  if phase == "compile_s":
    _current["compiles"] += 1
    if duration >= _PROGRAM_MIN_S:
      _current["programs"].append((fun_name, round(duration, 2)))


def _on_event(event, **_):
  if event == "/jax/compilation_cache/cache_hits" and _current:
    _current["cache_hits"] += 1


if _LOG:
  monitoring.register_event_duration_secs_listener(_on_duration)
  monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  if not _LOG:
    yield
    return
  _current.update(trace_s=0.0, lower_s=0.0, compile_s=0.0, compiles=0,
                  cache_hits=0, programs=[])
  start = os.times()
  yield
  end = os.times()
  line = dict(test=item.nodeid, cpu_s=round(
      end.user + end.system - start.user - start.system, 2), **{
          k: round(v, 2) if isinstance(v, float) else v
          for k, v in _current.items()})
  _current.clear()
  with open(_LOG, "a") as log:
    log.write(json.dumps(line) + "\n")
