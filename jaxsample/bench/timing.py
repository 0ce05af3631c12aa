"""Device-side timing of jitted ops and the HBM floor's bandwidth.

Each op is warmed up, then called ``iters * repeats`` times on rotating inputs
under one JAX profiler trace.  The GPU events (kernels and copies) of the
trace are cut into calls in time order; device time per call is the median
over ``repeats`` consecutive blocks of ``iters`` calls of the block's mean,
with the wall-clock time per call (dispatch included, the same median over
blocks, each block waiting for its last call) alongside.  Off GPU the
profiler is not started (it has no device plane) and the wall-clock figure
stands in.
"""

from __future__ import annotations

import collections
import glob
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["L2_BYTES", "measure_bandwidth", "time_op"]

L2_BYTES = 50 * 2**20  # the H100's and H200's L2 (50 MiB)


def _device_events(trace_dir: str) -> list[tuple[int, int, str]] | None:
  """(start_ns, duration_ns, name) of the GPU events of a trace, in time order."""
  files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  if not files:
    return None
  data = jax.profiler.ProfileData.from_file(files[0])
  events = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if line.name.startswith("Stream"):
        events.extend((e.start_ns, e.duration_ns, e.name) for e in line.events)
  return sorted(events) or None


def time_op(fn: Callable, inputs: list, iters: int, repeats: int) -> dict:
  """Median device and wall time (microseconds) of ``fn`` over rotating inputs.

  Returns ``us`` (device time, or wall time without a device plane),
  ``wall_us``, and with device events ``device_us``, ``device_split`` (False
  when the event count is no multiple of the calls: then the mean over all
  calls), ``kernels_per_call`` and ``kernel_us`` (each device op's mean time
  per call, by name, costliest first).
  """
  jax.block_until_ready(fn(inputs[0]))
  calls = iters * repeats

  def timed_calls() -> float:
    """The median over ``repeats`` blocks of the block's wall time per call."""
    blocks = []
    for r in range(repeats):
      start = time.perf_counter()
      out = None
      for i in range(r * iters, (r + 1) * iters):
        out = fn(inputs[i % len(inputs)])
      jax.block_until_ready(out)
      blocks.append((time.perf_counter() - start) * 1e6 / iters)
    return statistics.median(blocks)

  events = None
  if jax.default_backend() == "gpu":
    with tempfile.TemporaryDirectory() as trace_dir:
      jax.profiler.start_trace(trace_dir)
      wall_us = timed_calls()
      jax.profiler.stop_trace()
      events = _device_events(trace_dir)
  else:  # no device plane to read: skip the profiler's start-up
    wall_us = timed_calls()
  result = {"wall_us": wall_us}
  if events:
    durations = [d for _, d, _ in events]
    per_name = collections.Counter()
    for _, d, name in events:
      per_name[name] += d / 1e3 / calls
    result["kernel_us"] = dict(per_name.most_common())
    if len(durations) % calls == 0:
      per_call = len(durations) // calls
      block = iters * per_call
      means = [sum(durations[r * block:(r + 1) * block]) / 1e3 / iters
               for r in range(repeats)]
      result.update(device_us=statistics.median(means), device_split=True,
                    kernels_per_call=per_call)
    else:
      result.update(device_us=sum(durations) / 1e3 / calls, device_split=False)
  result["us"] = result.get("device_us", result["wall_us"])
  return result


def measure_bandwidth(gib: float = 2.0) -> float:
  """Bytes/s of a large device copy (read + write of ``gib`` GiB), median of 3."""
  n = max(1, int(gib * 2**30 / 4))
  x = jnp.arange(n, dtype=jnp.float32)
  copy = jax.jit(lambda a: a * 1.0001)
  t = time_op(copy, [x], iters=5, repeats=3)["us"]
  return 2 * n * 4 / (t * 1e-6)
