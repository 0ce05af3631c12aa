"""Device-side timing of jitted ops and the HBM floor's bandwidth.

Each op is warmed up, then called ``iters * repeats`` times on rotating inputs
under one JAX profiler trace.  The GPU events (kernels and copies) of the
trace are cut into calls in time order; device time per call is the median
over ``repeats`` consecutive blocks of ``iters`` calls of the block's mean,
with the wall-clock time per call (dispatch included, the same median over
blocks, each block waiting for its last call) alongside.  Off GPU the
profiler is not started (it has no device plane) and the wall-clock figure
stands in.

``IdleWindow`` measures the share of a stretch of wall time in which the
GPU ran nothing (the serving benchmark's device idle share).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["IdleWindow", "L2_BYTES", "busy_ns", "kernel_calls",
           "measure_bandwidth", "time_op"]

L2_BYTES = 50 * 2**20  # the H100's and H200's L2 (50 MiB)


def _profile(trace_dir: str):
  """The ``ProfileData`` of the trace written to ``trace_dir``, or None."""
  files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  return jax.profiler.ProfileData.from_file(files[0]) if files else None


def _events(data, plane_prefix: str, line_prefix: str = ""):
  """(start_ns, duration_ns, name) of the events on the lines named
  ``line_prefix``.. of the planes named ``plane_prefix``..; the planes of
  one trace share one clock (ns from the trace's start)."""
  return [(e.start_ns, e.duration_ns, e.name)
          for plane in data.planes if plane.name.startswith(plane_prefix)
          for line in plane.lines if line.name.startswith(line_prefix)
          for e in line.events]


def device_events(trace_dir: str) -> list[tuple[int, int, str]] | None:
  """(start_ns, duration_ns, name) of the GPU events of a trace, in time order."""
  data = _profile(trace_dir)
  return (sorted(_events(data, "/device:GPU", "Stream")) or None) if data else None


def busy_ns(events, start_ns: int, end_ns: int) -> int:
  """Nanoseconds of ``[start_ns, end_ns)`` covered by at least one of
  ``events`` (``(start_ns, duration_ns, name)``): the union of their
  intervals (streams overlap) clipped to the window."""
  busy, reach = 0, start_ns
  for start, duration, _ in sorted(events):
    begin, end = max(start, reach), min(start + duration, end_ns)
    if end > begin:
      busy += end - begin
      reach = end
  return busy


@dataclasses.dataclass
class IdleWindow:
  """A profiled stretch of wall time: ``start()`` begins a JAX profiler
  trace and a window (a ``TraceAnnotation`` named ``WINDOW``), ``stop()``
  ends both and sets ``wall_s``, the window's length, and ``busy_s``, the
  seconds of it in which some GPU op (kernel or copy, any stream) ran, both
  in the trace's clock; ``busy_s`` stays None when the trace has no GPU
  events (a CPU run)."""

  WINDOW = "jaxsample_idle_window"

  wall_s: float | None = None
  busy_s: float | None = None
  _trace_dir: tempfile.TemporaryDirectory | None = dataclasses.field(
      default=None, repr=False)
  _annotation: jax.profiler.TraceAnnotation | None = dataclasses.field(
      default=None, repr=False)

  def start(self) -> None:
    self._trace_dir = tempfile.TemporaryDirectory()
    jax.profiler.start_trace(self._trace_dir.name)
    self._annotation = jax.profiler.TraceAnnotation(self.WINDOW)
    self._annotation.__enter__()

  def stop(self) -> None:
    self._annotation.__exit__(None, None, None)
    jax.profiler.stop_trace()
    with self._trace_dir:
      data = _profile(self._trace_dir.name)
    (start, length, _), = [e for e in _events(data, "/host:")
                           if e[2] == self.WINDOW]
    self.wall_s = length / 1e9
    events = _events(data, "/device:GPU", "Stream")
    if events:
      self.busy_s = busy_ns(events, start, start + length) / 1e9

  @property
  def idle_share(self) -> float | None:
    """``1 - busy_s / wall_s``, or None without GPU events."""
    if self.busy_s is None:
      return None
    return 1 - self.busy_s / self.wall_s


def _sub_jaxprs(eqn):
  """The jaxprs an equation's params hold (call bodies, cond branches ...)."""
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


def _count_kernels(jaxpr, used: list[bool], counts: list[int]) -> None:
  """Adds to ``counts`` = [live, dead] the ``pallas_call``s of ``jaxpr``
  whose outputs ``used`` needs or not.  An equation is live when one of its
  outputs is (a backward pass); a body whose outputs map one to one to its
  equation's (jit, cond branches, custom derivatives, shard_map) sees the
  equation's used outputs, any other body (loops) all of them."""
  live = {v for v, u in zip(jaxpr.outvars, used)
          if u and isinstance(v, jax.extend.core.Var)}
  for eqn in reversed(jaxpr.eqns):
    outs = [v in live for v in eqn.outvars]
    alive = any(outs) or bool(eqn.effects)
    if eqn.primitive.name == "pallas_call":
      counts[0 if alive else 1] += 1
      # (its kernel body is not walked: it is one kernel launch)
    else:
      for body in _sub_jaxprs(eqn):
        body_used = (outs if alive and len(body.outvars) == len(outs)
                     else [alive] * len(body.outvars))
        _count_kernels(body, body_used, counts)
    if alive:
      live.update(v for v in eqn.invars if isinstance(v, jax.extend.core.Var))


def kernel_calls(fn: Callable, *args) -> tuple[int, int]:
  """``(live, dead)``: the ``pallas_call``s in the program ``fn(*args)``
  traces whose outputs reach its outputs, and those whose outputs it drops.
  JAX >= 0.12 removes a dead one as dead code, so a timed function that
  drops a kernel's outputs times less than it names (``time_op`` refuses
  one)."""
  closed = jax.make_jaxpr(fn)(*args)
  counts = [0, 0]
  _count_kernels(closed.jaxpr, [True] * len(closed.jaxpr.outvars), counts)
  return counts[0], counts[1]


def time_op(fn: Callable, inputs: list, iters: int, repeats: int) -> dict:
  """Median device and wall time (microseconds) of ``fn`` over rotating inputs.

  Returns ``us`` (device time, or wall time without a device plane),
  ``wall_us``, and with device events ``device_us``, ``device_split`` (False
  when the event count is no multiple of the calls: then the mean over all
  calls), ``kernels_per_call`` and ``kernel_us`` (each device op's mean time
  per call, by name, costliest first).  A ``ValueError`` if ``fn`` drops the
  outputs of a Pallas kernel it calls (``kernel_calls``): return or reduce
  every output.
  """
  dead = kernel_calls(fn, inputs[0])[1]
  if dead:
    raise ValueError(f"time_op: {dead} Pallas kernel call(s) in the timed "
                     f"function have outputs it drops (JAX removes them as "
                     f"dead code): return or reduce every output of {fn!r}")
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
      events = device_events(trace_dir)
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
