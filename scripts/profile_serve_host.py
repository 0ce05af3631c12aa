"""Where the serving loop's host time goes, per step call (CPU or GPU).

    PYTHONPATH=. python3 scripts/profile_serve_host.py [serve_demo flags]

Builds the loop of ``python -m jaxsample.serve_demo`` with the same flags
(defaults here: the embedded model, 32 slots, 128 requests of 64 tokens,
``--implementation xla``), warms it up (counting XLA compilations), then
serves the stream twice:

* timed: wall seconds and the main thread's CPU seconds
  (``time.thread_time``: the host's work; waits and the runtime's own
  threads excluded) of the loop, and per phase, by wrapping the loop's
  methods that exist (``_admission_inputs``: admission arrays;
  ``_dispatch`` / ``_timed`` / ``_call_admit``: jitted calls;
  ``_collect``: reading outputs into events) plus ``stats``;
* profiled: ``cProfile`` of the same stream, top functions by own time.

Counts are per step call (``stats["step_calls"]``) and per decode step
(step calls times ``steps_per_call``).
"""

from __future__ import annotations

import collections
import cProfile
import functools
import pstats
import sys
import time

import jax

from jaxsample import serve_demo

DEFAULTS = ["--implementation", "xla", "--slots", "32", "--requests", "128",
            "--max-tokens", "64"]
PHASES = ("_admission_inputs", "_dispatch", "_timed", "_call_admit",
          "_collect")
COMPILES = collections.Counter()


def count_compiles(event: str, duration: float, **kwargs) -> None:
  del kwargs
  if event == "/jax/core/compile/backend_compile_duration":
    COMPILES["count"] += 1
    COMPILES["seconds"] += duration


def timed_phases(loop, totals: collections.Counter) -> None:
  """Wraps ``loop``'s phase methods (outermost calls only) to add their
  wall and thread CPU seconds to ``totals``."""
  depth = [0]

  def wrap(name, method):
    @functools.wraps(method)
    def run(*args, **kwargs):
      depth[0] += 1
      wall, cpu = time.perf_counter(), time.thread_time()
      try:
        return method(*args, **kwargs)
      finally:
        depth[0] -= 1
        if not depth[0]:
          totals[name + " wall"] += time.perf_counter() - wall
          totals[name + " cpu"] += time.thread_time() - cpu
    return run

  for name in PHASES:
    if hasattr(loop, name):
      vars(loop)[name] = wrap(name, getattr(loop, name))  # this instance only


def main(argv: list[str]) -> None:
  jax.monitoring.register_event_duration_secs_listener(count_compiles)
  args = serve_demo.parser().parse_args(DEFAULTS + argv)
  model, tokenizer = serve_demo.load_target(args)
  requests = serve_demo.make_requests(tokenizer, model.config.vocab_size, args)
  loop = serve_demo.build_loop(model, args.spec[0], args)
  start = time.perf_counter()
  loop.warmup(max(len(r.prompt) for r in requests))
  print(f"warm-up {time.perf_counter() - start:.1f} s: {COMPILES['count']} "
        f"XLA compilations, {COMPILES['seconds']:.1f} s compiling")
  COMPILES.clear()
  phases = collections.Counter()
  timed_phases(loop, phases)
  cpu, wall = time.thread_time(), time.perf_counter()
  serve_demo.serve(loop, requests, args.arrivals, live=False)
  cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
  s = dict(loop.stats)
  calls = s["step_calls"]
  waited = s.get("wait_s", s.get("device_s"))
  ms = lambda seconds: f"{1e3 * seconds / calls:.3f}"
  print(f"timed: {calls} step calls, {s['admit_calls']} admit calls, "
        f"{s['tokens']} tokens, {s['tokens'] / wall:.1f} tok/s; per step "
        f"call: wall {ms(wall)} ms, host thread CPU {ms(cpu)} ms, "
        f"busy_s - {'wait_s' if 'wait_s' in s else 'device_s'} "
        f"{ms(s['busy_s'] - waited)} ms (host share "
        f"{100 * (1 - waited / s['busy_s']):.1f}%)")
  steps = calls * loop.steps_per_call
  print(f"per decode step ({loop.steps_per_call} per call): wall "
        f"{1e3 * wall / steps:.3f} ms, host thread CPU {1e3 * cpu / steps:.3f}"
        f" ms, busy_s - wait_s {1e3 * (s['busy_s'] - waited) / steps:.3f} ms, "
        f"dispatch_s {1e3 * s.get('dispatch_s', 0.0) / steps:.3f} ms")
  print("phases, ms per step call:", {k: ms(v) for k, v in
                                      sorted(phases.items())})
  print("stats:", {k: round(v, 3) if isinstance(v, float) else v
                   for k, v in sorted(s.items())})
  print(f"compilations while serving: {COMPILES['count']}")
  loop.stats.clear()
  for name in PHASES:  # the class's methods again: no timers in the profile
    vars(loop).pop(name, None)
  profile = cProfile.Profile()
  profile.enable()
  serve_demo.serve(loop, requests, args.arrivals, live=False)
  profile.disable()
  pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(
      25)


if __name__ == "__main__":
  main(sys.argv[1:])
