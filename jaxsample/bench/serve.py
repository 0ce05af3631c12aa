"""``python -m jaxsample.bench serve``: the serving loop's throughput.

Serves ``jaxsample.serve_demo``'s stream (the same options: model, requests,
arrivals, slots, ``--spec``) and prints one summary line per ``--spec``
value: tokens/s, draft acceptance and the host's share of the loop's time;
then, over ``--idle-window`` step calls of the steady state of a second pass
of the same stream, the device's idle share (``timing.IdleWindow``: a
profiler trace; n/a without GPU events).
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxsample import serve_demo
from jaxsample.bench.timing import IdleWindow

__all__ = ["main", "parser"]


@dataclasses.dataclass
class _CallWindow:
  """``serve``'s ``on_call``: profiles the step calls ``calls + 1 .. 2
  calls`` with ``idle`` (``close`` ends a window the stream left open)."""

  idle: IdleWindow
  calls: int
  open: bool = False

  def __call__(self, call: int) -> None:
    if call == self.calls:
      self.idle.start()
      self.open = True
    elif call == 2 * self.calls and self.open:
      self.close()

  def close(self) -> None:
    if self.open:
      self.idle.stop()
      self.open = False


def _idle(idle: IdleWindow) -> str:
  if idle.wall_s is None:
    return ""
  share = ("n/a (no GPU events)" if idle.idle_share is None else
           f"{100 * idle.idle_share:.1f}%")
  return f" | device idle {share} of {1e3 * idle.wall_s:.1f} ms profiled"


def parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m jaxsample.bench serve", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  serve_demo.add_options(parser)
  parser.add_argument("--idle-window", type=int, default=16,
                      help="step calls profiled (in a second pass) for the "
                      "device idle share, after as many warm calls (0: none)")
  return parser


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  model, _, requests = serve_demo.load_stream(args)
  for loop, _, line in serve_demo.serve_specs(model, requests, args,
                                              live=False):
    if args.idle_window:  # a second pass, profiled
      window = _CallWindow(IdleWindow(), args.idle_window)
      serve_demo.serve(loop, requests, args.arrivals, live=False,
                       on_call=window)
      window.close()
      line += _idle(window.idle)
    print(line)
  return 0
