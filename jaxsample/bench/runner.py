"""Runs a suite: times each case's ops and the peers, prints a table, writes JSON.

A ``Suite`` names its cases (``cases(args)``) and builds, per case, a ``Group``:
the rotating inputs, the ops timed on them, the bytes of logits one call must
read (the HBM floor: those bytes over the copy bandwidth measured in the same
run) and, for the peers (``jaxsample.bench.peers``), the ``[N, V]`` rows of an
input.  Groups are built one at a time, so one case's buffers are freed
before the next case's are made.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence

import jax
import numpy as np

import jaxsample
from jaxsample.bench import peers
from jaxsample.bench.timing import measure_bandwidth, time_op

try:
  import tqdm
except ImportError:  # the "bench" extra; without it, no progress bar
  tqdm = None

__all__ = ["Group", "JSON_KEYS", "ROW_KEYS", "Suite", "add_common_options", "describe_device",
           "print_header", "progress_bar", "run_suite", "time_group", "write_json"]

# Keys every JSON row and the JSON document carry (tests/test_bench.py).
ROW_KEYS = ("suite", "op", "case", "us", "wall_us", "floor_us", "x_floor")
JSON_KEYS = ("suite", "device", "backend", "jax", "jaxsample", "bandwidth_bytes_per_s",
             "argv", "options", "rows")


@dataclasses.dataclass
class Group:
  """One case's timed work.

  Attributes:
    label: the row fields that describe the case (``Case.label()`` and more).
    inputs: rotating inputs; every op takes one.
    ops: op name -> function of one input.
    floor_bytes: logits bytes one call must read.
    peer_rows: input -> ``[N, V]`` logits for the peers; None: no peers.
    peer_filters, temperature: the case's filters and temperature, for the peers.
    extra: op name -> fields added to that op's row (e.g. an exactness check).
    annotate: ``(op name, time_op result) -> fields`` added to the row.
    suite: the suite's name (the rows' ``suite`` field), set by whoever times the group.
  """

  label: dict
  inputs: list
  ops: dict[str, Callable]
  floor_bytes: int
  peer_rows: Callable | None = None
  peer_filters: dict = dataclasses.field(default_factory=dict)
  temperature: float = 1.0
  extra: dict[str, dict] = dataclasses.field(default_factory=dict)
  annotate: Callable[[str, dict], dict] | None = None
  suite: str = ""


@dataclasses.dataclass(frozen=True)
class Suite:
  """A named benchmark: its CLI options, its cases and how to time one."""

  name: str
  help: str
  defaults: dict  # the common options' defaults (``add_common_options``)
  add_options: Callable[[argparse.ArgumentParser], None]
  cases: Callable[[argparse.Namespace], Sequence]
  build: Callable[[argparse.Namespace, object], Group]


def add_common_options(parser: argparse.ArgumentParser, defaults: dict) -> None:
  """Options every suite takes; ``defaults`` overrides the suite's defaults."""
  d = dict(batch="1,32,128", vocab=151936, dtypes="float32", dists="randn",
           settings="plain", temperature=0.7, iters=32, repeats=5, kernels=0)
  d.update(defaults)
  parser.add_argument("--batch", default=d["batch"], help="batch sizes (comma-separated)")
  parser.add_argument("--vocab", type=int, default=d["vocab"], help="vocabulary size V")
  parser.add_argument("--dtypes", default=d["dtypes"], help="logits dtypes")
  parser.add_argument("--dists", default=d["dists"],
                      help="logit distributions (jaxsample.bench.cases.DISTS)")
  parser.add_argument("--settings", default=d["settings"],
                      help="filter settings (jaxsample.bench.cases.SETTINGS)")
  parser.add_argument("--cases", default="",
                      help="a named case set (jaxsample.bench.cases.NAMED) in place of "
                      "--batch/--vocab/--dtypes/--dists/--settings/--temperature")
  parser.add_argument("--temperature", type=float, default=d["temperature"],
                      help="every request's temperature")
  parser.add_argument("--implementation", default="auto",
                      choices=("auto", "pallas", "xla_search", "xla"),
                      help="jaxsample's backend in the 'jaxsample' ops (auto: the kernels "
                      "on GPU, xla_search elsewhere; pallas off GPU: interpret mode); the "
                      "sort-based XLA reference is timed as its own op")
  parser.add_argument("--iters", type=int, default=d["iters"], help="calls per timed block")
  parser.add_argument("--repeats", type=int, default=d["repeats"],
                      help="timed blocks (the median is reported)")
  parser.add_argument("--ops", default="", help="comma-separated substrings selecting ops")
  parser.add_argument("--no-peers", dest="peers", action="store_false",
                      help="leave out the reference ops (jaxsample.bench.peers)")
  parser.add_argument("--torch", action="store_true",
                      help="also time a torch sort-based sampler (needs torch with CUDA)")
  parser.add_argument("--kernels", type=int, default=d["kernels"],
                      help="print the N costliest device ops of each row")
  parser.add_argument("--resident", action="store_true",
                      help="time every op on one input buffer, which stays in the L2 when it "
                      "fits: what an op costs when HBM is not its bound (rows say resident)")
  parser.add_argument("--bandwidth-gib", type=float, default=2.0,
                      help="size of the copy that measures the bandwidth")
  parser.add_argument("--out", default="", help="write the rows as JSON to this path")
  parser.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no progress bar (tqdm, the 'bench' extra)")


def _label_text(label: dict) -> str:
  skip = ("vocab",)
  return " ".join(f"{v}" if k in ("setting", "dist", "dtype") else f"{k}={v}"
                  for k, v in label.items() if k not in skip)


def _selected(name: str, patterns: list[str]) -> bool:
  return not patterns or any(p in name for p in patterns)


def time_group(group: Group, args: argparse.Namespace, bandwidth: float, *,
               write: Callable = print, bar=None, external: dict | None = None) -> list[dict]:
  """Times one case's ops and its peers; prints a table row per op; returns the rows.

  ``external`` maps a peer name to ``factory(filters, temperature) -> op`` where
  ``op(inputs, iters, repeats)`` times a non-JAX sampler on the case's peer rows
  (a ``time_op``-like result, or None where it cannot run); ``args.torch`` adds
  the torch sort-based sampler to it.
  """
  if args.resident:
    group.inputs = group.inputs[:1]
    group.label["resident"] = True
  ops = dict(group.ops)
  if args.peers and group.peer_rows is not None:
    vocab = group.label["vocab"]
    ops.update({name: (lambda x, fn=fn: fn(group.peer_rows(x))) for name, fn in
                peers.peer_ops(group.peer_filters, group.temperature, vocab).items()})
  external = dict(external or {})
  if args.torch:
    external[peers.TORCH_SORT] = peers.torch_sort_op
  patterns = [s for s in args.ops.split(",") if s]
  floor_us = group.floor_bytes / bandwidth * 1e6
  case_text = _label_text(group.label)
  timed = []
  for name, fn in ops.items():
    if not _selected(name, patterns):
      continue
    if bar is not None:
      bar.set_postfix_str(name[:30])
    timed.append((name, time_op(fn, group.inputs, args.iters, args.repeats)))
  if group.peer_rows is not None:
    rows_in = None
    for name, factory in external.items():
      if not _selected(name, patterns):
        continue
      rows_in = rows_in or [group.peer_rows(x) for x in group.inputs]
      result = factory(group.peer_filters, group.temperature)(rows_in, args.iters, args.repeats)
      if result is not None:
        timed.append((name, result))
  rows = []
  for name, result in timed:
    row = dict(suite=group.suite, op=name, case=case_text, **group.label,
               floor_us=floor_us, x_floor=result["us"] / floor_us, **result,
               **group.extra.get(name, {}))
    if group.annotate is not None:
      row.update(group.annotate(name, result))
    rows.append(row)
    write(f"{name:38s} {result['us']:9.1f} {result['wall_us']:9.1f} {floor_us:9.1f} "
          f"{row['x_floor']:8.2f}  {case_text}")
    for kernel, us in list(result.get("kernel_us", {}).items())[:args.kernels]:
      write(f"    {us:8.2f}  {kernel[:90]}")
  return rows


def describe_device(bandwidth: float) -> dict:
  """The JSON document's fields that say where and with what it ran."""
  return dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(),
              jax=jax.__version__, jaxsample=jaxsample.__version__,
              bandwidth_bytes_per_s=bandwidth, argv=sys.argv)


def print_header(title: str, bandwidth: float) -> None:
  device = jax.devices()[0]
  print(f"# {title}: {device.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}, jaxsample {jaxsample.__version__}; copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s; floor = logits bytes read once / copy bandwidth; "
        f"us = device time per call (wall time off GPU)", flush=True)
  print(f"{'op':38s} {'us':>9s} {'wall_us':>9s} {'floor_us':>9s} {'x_floor':>8s}  case",
        flush=True)


def progress_bar(total: int, desc: str, enabled: bool):
  """A tqdm bar on stderr (shown only on a terminal), or None without tqdm."""
  if tqdm is None:
    return None
  # disable=None: tqdm shows the bar only on a terminal (not in logs).
  return tqdm.tqdm(total=total, desc=desc, unit="case", file=sys.stderr,
                   disable=True if not enabled or total < 2 else None)


def run_suite(suite: Suite, args: argparse.Namespace) -> dict:
  """Times every case of ``suite``; prints the table; returns (and with
  ``--out`` writes) the JSON document."""
  bandwidth = measure_bandwidth(args.bandwidth_gib)
  print_header(f"suite {suite.name}", bandwidth)
  cases = list(suite.cases(args))
  bar = progress_bar(len(cases), suite.name, args.progress)
  write = bar.write if bar is not None else print
  rows = []
  for case in cases:
    group = suite.build(args, case)
    group.suite = suite.name
    rows += time_group(group, args, bandwidth, write=write, bar=bar)
    if bar is not None:
      bar.update()
    del group
  if bar is not None:
    bar.close()
  doc = dict(suite=suite.name, **describe_device(bandwidth),
             options={k: v for k, v in vars(args).items() if k != "suite_obj"},
             rows=rows)
  if args.out:
    write_json(doc, args.out)
  return doc


def write_json(doc: dict, path) -> None:
  with open(path, "w") as f:
    json.dump(doc, f, indent=1, default=_jsonable)


def _jsonable(value):
  if isinstance(value, (np.generic,)):
    return value.item()
  return str(value)
