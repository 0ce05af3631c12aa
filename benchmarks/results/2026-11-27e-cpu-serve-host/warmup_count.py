"""Counts the XLA compilations of ``ServeLoop.warmup()`` over every prompt
bucket (embedded model, 32 slots, cache 256, XLA sampler); see README."""

import collections
import time

import jax

from jaxsample import serve_demo

COMPILES = collections.Counter()


def listen(event, duration, **kwargs):
  del kwargs
  if event == "/jax/core/compile/backend_compile_duration":
    COMPILES["count"] += 1
    COMPILES["seconds"] += duration


jax.monitoring.register_event_duration_secs_listener(listen)
args = serve_demo.parser().parse_args(["--implementation", "xla",
                                       "--slots", "32"])
model, _ = serve_demo.load_target(args)
loop = serve_demo.build_loop(model, "none", args)
COMPILES.clear()
cpu = time.thread_time()
loop.warmup()
print(f"warmup() of every bucket (cache 256: 16..256): {COMPILES['count']} "
      f"XLA compilations, {COMPILES['seconds']:.1f} s compiling, "
      f"{time.thread_time() - cpu:.1f} s main-thread CPU")
