"""``python -m jaxsample.bench report``: the standard grid in one run, against the peers.

Times, on the same rotating inputs in one process, every case of the grid
(vocabularies x dtypes x batch sizes x settings) through the ``sample``
suite's ops (jaxsample with params traced and closed over, with a sampling
mask on truncating settings, greedy on plain rows, the sort-based XLA
reference with a token check) and the peers (``peers``: ``jnp.max``,
``jax.random.categorical``, ``lax.top_k``, an XLA sort top-p, torch's sort
sampler; ``vllm_peers``: vLLM's Triton kernels; ``flashinfer_peers``:
FlashInfer's CUDA kernels, built from a source copy), then the ``spec`` suite's
verification (one-hot drafts, ``k`` draft tokens per row) per setting.  One
progress bar covers every case.  Into ``--out DIR`` it writes ``report.json``
(every row, the device, versions, bandwidth, command, git commit, peers),
``report.md`` (one table per vocabulary, dtype and setting, batch sizes as
rows, implementations as columns, with ratios to the plain sample and to
``jnp.max``; spec tables per draft length) and PNG figures
(``jaxsample.bench.plots``).  ``--merge A.json,B.json`` renders several runs'
rows (e.g. one device call per vocabulary) without timing anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

from jaxsample.bench import cases as cases_lib
from jaxsample.bench import flashinfer_peers, peers, plots, runner, suites, vllm_peers
from jaxsample.bench.timing import measure_bandwidth

__all__ = ["JAXSAMPLE", "JSON_KEYS", "MAX", "PEERS", "SPEC_MAX", "add_options", "guarded",
           "jobs", "main", "render", "run"]

PEERS = ("jax", "torch", "vllm", "flashinfer")
JSON_KEYS = ("report", "device", "backend", "jax", "jaxsample", "bandwidth_bytes_per_s",
             "argv", "command", "git_commit", "options", "peers", "rows")
JAXSAMPLE = "jaxsample"  # the plain sample's op (params traced): the ratios' base
MAX = "jnp.max (one read)"
SPEC_MAX = "jnp.max (target and draft)"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def add_options(parser: argparse.ArgumentParser) -> None:
  """The report's options (``python -m jaxsample.bench report --help``)."""
  parser.add_argument("--out", default="report", help="output folder")
  parser.add_argument("--batch", default="1,8,32,128,256,512", help="batch sizes")
  parser.add_argument("--vocab", default="151936,128256", help="vocabulary sizes")
  parser.add_argument("--dtypes", default="float32,bfloat16", help="logits dtypes")
  parser.add_argument("--settings", default="plain,top_k50+top_p0.9,top_p0.95,min_p0.05",
                      help="filter settings (jaxsample.bench.cases.SETTINGS)")
  parser.add_argument("--dist", default="randn", choices=cases_lib.DISTS,
                      help="logit distribution")
  parser.add_argument("--temperature", type=float, default=0.7)
  parser.add_argument("--mask-caps", default="1024",
                      help="K_cap values: also time sample(..., return_mask=True) on "
                      "truncating settings ('' for none)")
  parser.add_argument("--params", default="both", choices=("arg", "static", "both"),
                      help="params as jit arguments, closed over, or both")
  parser.add_argument("--spec-k", default="1,4,8", help="draft lengths of the spec part")
  parser.add_argument("--no-spec", dest="spec", action="store_false",
                      help="leave out speculative verification")
  parser.add_argument("--no-sample", dest="sample", action="store_false",
                      help="leave out the sample part (a verification-only slice)")
  parser.add_argument("--quick", action="store_true",
                      help="a short run: --iters 4 --repeats 2, params traced only, the "
                      "first draft length only, a 0.25 GiB bandwidth copy")
  parser.add_argument("--peers", default="auto",
                      help="comma-separated peers among jax,torch,vllm,flashinfer, or none; "
                      "auto: jax, torch where it runs on CUDA, vllm and flashinfer where a "
                      "source copy is given")
  parser.add_argument("--vllm-src", default="",
                      help=f"a local copy of vLLM's source (or ${vllm_peers.ENV_VAR})")
  parser.add_argument("--flashinfer-src", default="",
                      help=f"a local copy of FlashInfer's source, built at run time (or "
                      f"${flashinfer_peers.ENV_VAR})")
  parser.add_argument("--implementation", default="auto",
                      choices=("auto", "pallas", "xla_search", "xla"))
  parser.add_argument("--iters", type=int, default=16, help="calls per timed block")
  parser.add_argument("--repeats", type=int, default=3, help="timed blocks (median)")
  parser.add_argument("--bandwidth-gib", type=float, default=2.0,
                      help="size of the copy that measures the bandwidth")
  parser.add_argument("--merge", default="",
                      help="comma-separated report.json files: render their rows into --out "
                      "and time nothing")
  parser.add_argument("--time-limit", type=float, default=0.0,
                      help="seconds: start no case after this long (the report lists the cases "
                      "left out); 0: no limit")
  parser.add_argument("--no-progress", dest="progress", action="store_false")


def _ints(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v]


def _names(text: str) -> list[str]:
  return [v for v in text.split(",") if v]


def _quick(opts: argparse.Namespace) -> argparse.Namespace:
  if not opts.quick:
    return opts
  return argparse.Namespace(**dict(
      vars(opts), iters=4, repeats=2, params="arg", bandwidth_gib=min(opts.bandwidth_gib, 0.25),
      spec_k=",".join(_names(opts.spec_k)[:1])))


# The peers built from a local source copy: name -> (module, the copy's option's value).
_COPIED = {"vllm": (vllm_peers, lambda opts: opts.vllm_src),
           "flashinfer": (flashinfer_peers, lambda opts: opts.flashinfer_src)}


def _source(opts: argparse.Namespace, name: str) -> str | None:
  """The ``--NAME-src`` option of a copied peer, or None (its environment variable)."""
  return _COPIED[name][1](opts) or None


def chosen_peers(opts: argparse.Namespace) -> set[str]:
  if opts.peers == "none":
    return set()
  if opts.peers == "auto":
    chosen = {"jax"}
    if peers.torch_module() is not None:
      chosen |= {"torch"}
      chosen |= {name for name, (module, _) in _COPIED.items()
                 if _source(opts, name) or os.environ.get(module.ENV_VAR)}
    return chosen
  chosen = set(_names(opts.peers))
  unknown = chosen - set(PEERS)
  if unknown:
    raise SystemExit(f"--peers {opts.peers!r}: unknown {sorted(unknown)}; expected a "
                     f"comma-separated subset of {list(PEERS)}, 'auto' or 'none'")
  for name in chosen & set(_COPIED):
    try:
      _COPIED[name][0].resolve_source(_source(opts, name))
    except ValueError as error:  # VllmSourceError, FlashInferSourceError
      raise SystemExit(str(error)) from None
  if chosen - {"jax"} and peers.torch_module() is None:
    raise SystemExit(f"--peers {opts.peers}: torch, vLLM's and FlashInfer's kernels need torch "
                     "(and Triton, nvcc) with a CUDA device; leave them out here")
  return chosen


def load_copied(chosen: set[str], opts: argparse.Namespace, failures: list) -> dict:
  """``{name: loaded kernels}`` of the chosen copied peers; a copy that fails to
  load (e.g. a kernel this Triton or nvcc cannot compile) is recorded in
  ``failures`` and left out."""
  loaded = {}
  for name in sorted(chosen & set(_COPIED)):
    module = _COPIED[name][0]
    try:
      loaded[name] = module.load(_source(opts, name))
    except ValueError as error:  # the copy vanished since chosen_peers
      raise SystemExit(str(error)) from None
    except Exception as error:  # noqa: BLE001 -- recorded in the report
      _record(failures, f"{name} (loading the source copy)", {}, None, error)
  return loaded


def _suite_args(suite: runner.Suite, opts, chosen: set[str], extra: list[str]):
  """A suite's own options, as its CLI would parse them, from the report's."""
  parser = argparse.ArgumentParser()
  runner.add_common_options(parser, suite.defaults)
  suite.add_options(parser)
  argv = ["--iters", str(opts.iters), "--repeats", str(opts.repeats),
          "--implementation", opts.implementation, "--no-progress", *extra]
  return parser.parse_args(argv + ([] if "jax" in chosen else ["--no-peers"]))


@dataclasses.dataclass(frozen=True)
class Job:
  """One case to time: its suite, the suite's options and the case."""

  suite: runner.Suite
  args: argparse.Namespace
  case: object
  peers: bool  # whether the non-JAX peers run on it


def jobs(opts: argparse.Namespace, chosen: set[str]) -> list[Job]:
  """Every case of the grid: per vocabulary and dtype, the sample part then the spec part."""
  sample = _suite_args(suites.SAMPLE, opts, chosen,
                       ["--params", opts.params, "--mask-caps", opts.mask_caps])
  sample_plain = argparse.Namespace(**dict(vars(sample), mask_caps=""))  # nothing truncated
  spec = _suite_args(suites.SPEC, opts, chosen, ["--draft", "no", "--rates", "",
                                                 "--no-reference", "--no-peers"])
  found = []
  for vocab in _ints(opts.vocab):
    for dtype in _names(opts.dtypes):
      grid = cases_lib.grid(_ints(opts.batch), vocab, (dtype,), _names(opts.settings),
                            (opts.dist,), opts.temperature)
      if opts.sample:
        found += [Job(suites.SAMPLE, sample_plain if c.setting == "plain" else sample, c, True)
                  for c in grid]
      if opts.spec:
        found += [Job(suites.SPEC, spec, suites.SpecCase(c, k, False), False)
                  for c in grid for k in _ints(opts.spec_k)]
  return found


def _command(argv: list[str]) -> str:
  return "python -m jaxsample.bench " + shlex.join(argv)


def _seconds(doc: dict) -> str:
  return f" ({doc['elapsed_s']} s)" if doc.get("elapsed_s") is not None else ""


def _git_commit() -> str | None:
  """HEAD of the checkout this package runs from (``+dirty`` with local changes)."""
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  if head.returncode:
    return None
  return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def run(opts: argparse.Namespace, argv: list[str]) -> dict:
  """Times the grid; writes and returns the report document (``argv``: the
  command line after ``python -m jaxsample.bench``, recorded)."""
  if opts.merge:
    return render(_merged([pathlib.Path(p) for p in _names(opts.merge)], argv), opts.out)
  plots.require_matplotlib()
  opts = _quick(opts)
  chosen = chosen_peers(opts)
  failures = []
  loaded = load_copied(chosen, opts, failures)
  factories = {}
  if "torch" in chosen:
    factories[peers.TORCH_SORT] = peers.torch_sort_op
  for name, kernels in loaded.items():
    factories.update(_COPIED[name][0].peer_factories(kernels))
  external = {name: guarded(name, factory, failures) for name, factory in factories.items()}
  if factories and os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() != "false":
    print("warning: torch shares the GPU with JAX, which takes 75% of its memory up front "
          "unless XLA_PYTHON_CLIENT_PREALLOCATE=false (scripts/gpu_run.sh sets it)",
          file=sys.stderr, flush=True)
  start = time.perf_counter()
  bandwidth = measure_bandwidth(opts.bandwidth_gib)
  runner.print_header("report", bandwidth)
  todo = jobs(opts, chosen)
  bar = runner.progress_bar(len(todo), "report", opts.progress)
  write = bar.write if bar is not None else print
  rows, left_out, commit = [], [], _git_commit()

  def document(complete: bool) -> dict:
    return dict(report=1, **runner.describe_device(bandwidth),
                command=_command(argv), git_commit=commit,
                elapsed_s=round(time.perf_counter() - start, 1), complete=complete,
                left_out=left_out, options=vars(opts),
                peers=dict(names=sorted(chosen), external=sorted(external),
                           **{name: loaded[name].describe() if name in loaded else None
                              for name in _COPIED},
                           failures=failures),
                rows=rows)

  folder = pathlib.Path(opts.out)
  folder.mkdir(parents=True, exist_ok=True)
  for job in todo:
    if opts.time_limit and time.perf_counter() - start > opts.time_limit:
      left_out.append(f"{job.suite.name} {job.case}")
    else:
      group = job.suite.build(job.args, job.case)
      group.suite = job.suite.name
      rows += runner.time_group(group, job.args, bandwidth, write=write, bar=bar,
                                external=external if job.peers else None)
      del group
      # the rows so far, should the process be cut short (``--merge`` reads it)
      runner.write_json(document(complete=False), folder / "report.json")
    if bar is not None:
      bar.update()
  if bar is not None:
    bar.close()
  if left_out:
    print(f"# report: --time-limit {opts.time_limit:g} s left out {len(left_out)} of "
          f"{len(todo)} cases", flush=True)
  return render(document(complete=not left_out), opts.out)


def _record(failures: list, peer: str, filters: dict, rows, error: Exception) -> None:
  failures.append(dict(peer=peer, filters=filters,
                       shape=list(rows.shape) if rows is not None else [],
                       dtype=str(rows.dtype) if rows is not None else "",
                       error=f"{type(error).__name__}: {error}"[:2000]))
  print(f"# peer {peer!r} failed and is left out from here on: {failures[-1]['error']}",
        file=sys.stderr, flush=True)


def guarded(name: str, factory, failures: list):
  """``factory`` whose ops record an exception in ``failures`` and time nothing
  (a peer that fails once, e.g. a kernel this Triton cannot compile, is left
  out of the remaining cases) instead of ending the run."""

  def for_case(filters, temperature):
    op = factory(filters, temperature)

    def run(rows, iters, repeats):
      if any(f["peer"] == name for f in failures):
        return None
      try:
        return op(rows, iters, repeats)
      except Exception as error:  # noqa: BLE001 -- recorded in the report
        _record(failures, name, filters, rows[0], error)
        return None

    return run

  return for_case


def _merged(paths: list[pathlib.Path], argv: list[str]) -> dict:
  """One document from several runs' ``report.json``: the first's fields,
  every row, and under ``merged`` each run's own fields but its rows (so the
  merged document alone keeps every row once and every run's record)."""
  docs = [json.loads(p.read_text()) for p in paths]
  devices = sorted({d["device"] for d in docs})
  if len(devices) > 1:
    print(f"warning: --merge mixes devices {devices}; compare rows of one device only",
          file=sys.stderr)
  failures = [f for d in docs for f in (d.get("peers") or {}).get("failures", [])]
  return dict(docs[0], command=_command(argv), elapsed_s=None,
              complete=all(d.get("complete", True) for d in docs),
              left_out=[c for d in docs for c in d.get("left_out", [])],
              peers=dict(docs[0].get("peers") or {}, failures=failures),
              rows=[r for d in docs for r in d["rows"]],
              merged=[dict({k: v for k, v in d.items() if k != "rows"}, path=str(p))
                      for p, d in zip(paths, docs)])


# ---------------------------------------------------------------------------
# report.md
# ---------------------------------------------------------------------------


def _unique(values) -> list:
  return list(dict.fromkeys(values))


def _cell(us: float | None, *bases: float | None) -> str:
  if us is None:
    return "–"
  ratios = ", ".join(f"{us / b:.2f}" if b else "–" for b in bases)
  return f"{us:.1f} ({ratios})" if bases else f"{us:.1f}"


def _sample_table(rows: list[dict], vocab: int, dtype: str, setting: str) -> list[str]:
  mine = [r for r in rows if r["suite"] == "sample" and r["vocab"] == vocab and
          r["dtype"] == dtype and r["setting"] == setting]
  ops = _unique(r["op"] for r in mine)
  at = {(r["op"], r["batch"]): r for r in mine}
  plain = {r["batch"]: r["us"] for r in rows if r["suite"] == "sample" and
           r["vocab"] == vocab and r["dtype"] == dtype and r["setting"] == "plain" and
           r["op"] == JAXSAMPLE}
  lines = [f"### V = {vocab}, {dtype}, {setting}", "",
           "us per call (x the plain sample, x `jnp.max`); floor: the HBM floor", "",
           "| B | floor | " + " | ".join(ops) + " |",
           "|---" * (len(ops) + 2) + "|"]
  for batch in sorted({r["batch"] for r in mine}):
    read = at.get((MAX, batch), {}).get("us")
    floor = next(r["floor_us"] for r in mine if r["batch"] == batch)
    cells = [_cell(at[(op, batch)]["us"] if (op, batch) in at else None,
                   plain.get(batch), read) for op in ops]
    lines.append(f"| {batch} | {floor:.1f} | " + " | ".join(cells) + " |")
  checked = [r for r in mine if "same_tokens" in r]
  if checked:
    wrong = sorted({f"{r['op']} at B={r['batch']}" for r in checked if not r["same_tokens"]})
    lines += ["", "Tokens against the XLA reference: " + (
        f"DIFFERENT for {', '.join(wrong)}" if wrong else
        f"identical ({len(checked)} checks)")]
  return lines + [""]


def _spec_table(rows: list[dict], vocab: int, dtype: str, k: int) -> list[str]:
  mine = [r for r in rows if r["suite"] == "spec" and r["vocab"] == vocab and
          r["dtype"] == dtype and r["k"] == k]
  settings = _unique(r["setting"] for r in mine)
  at = {(r["op"], r["setting"], r["batch"]): r["us"] for r in mine}
  lines = [f"### Verification, V = {vocab}, {dtype}, k = {k} (one-hot drafts)", "",
           "us per call of `spec.rejection_sample` per setting (x the plain verification); "
           f"`{SPEC_MAX}`: the target rows read once", "",
           f"| B | floor | {SPEC_MAX} | " + " | ".join(settings) + " |",
           "|---" * (len(settings) + 3) + "|"]
  for batch in sorted({r["batch"] for r in mine}):
    floor = next(r["floor_us"] for r in mine if r["batch"] == batch)
    read = next((us for (op, _, b), us in at.items() if op == SPEC_MAX and b == batch), None)
    plain = at.get((JAXSAMPLE, "plain", batch))
    cells = [_cell(at.get((JAXSAMPLE, s, batch)), plain) for s in settings]
    lines.append(f"| {batch} | {floor:.1f} | {_cell(read)} | " + " | ".join(cells) + " |")
  return lines + [""]


def _markdown(doc: dict, figures: dict) -> str:
  rows = doc["rows"]
  copies = [f"{label} kernels from {(doc.get('peers') or {})[name]['commit']}"
            for name, label in (("vllm", "vLLM"), ("flashinfer", "FlashInfer"))
            if (doc.get("peers") or {}).get(name)]
  lines = ["# jaxsample benchmark report", "",
           f"- device: {doc['device']} ({doc['backend']}); jax {doc['jax']}, jaxsample "
           f"{doc['jaxsample']}; git commit {doc.get('git_commit')}",
           f"- copy bandwidth: {doc['bandwidth_bytes_per_s'] / 1e12:.3f} TB/s; floor = logits "
           "bytes read once / copy bandwidth",
           f"- command: `{doc['command']}`{_seconds(doc)}",
           f"- peers: {', '.join((doc.get('peers') or {}).get('names', [])) or 'none'}"
           + "".join(f"; {copy}" for copy in copies)]
  lines += [f"- merged run: `{m['command']}` on {m['device']}{_seconds(m)}"
            for m in doc.get("merged", [])]
  lines += [f"- FAILED peer {f['peer']} ({f['dtype']} {f['shape']}, {f['filters']}): "
            f"{f['error'].splitlines()[0][:300]}"
            for f in (doc.get("peers") or {}).get("failures", [])]
  if not doc.get("complete", True):
    left = doc.get("left_out", [])
    lines += [f"- **incomplete**: {len(left)} case(s) left out by `--time-limit`"
              + (f" (first: {left[0]})" if left else " or by a cut run (the rows written "
                 "before it)")]
  lines += ["", "Times are device time per call (profiler-summed kernels for JAX ops; "
            "CUDA-graph replays for torch, vLLM and FlashInfer), medians over blocks of calls on "
            "rotating inputs; off GPU, wall time.", ""]
  sample = [r for r in rows if r["suite"] == "sample"]
  for vocab, dtype in _unique((r["vocab"], r["dtype"]) for r in rows):
    lines += [f"## V = {vocab}, {dtype}", ""]
    for setting in _unique(r["setting"] for r in sample if r["vocab"] == vocab and
                           r["dtype"] == dtype):
      lines += _sample_table(rows, vocab, dtype, setting)
      name = figures.get(("sample", vocab, dtype, setting))
      lines += [f"![{setting}]({name})", ""] if name else []
    for k in sorted({r["k"] for r in rows if r["suite"] == "spec" and r["vocab"] == vocab and
                     r["dtype"] == dtype}):
      lines += _spec_table(rows, vocab, dtype, k)
      name = figures.get(("spec", vocab, dtype, k))
      lines += [f"![verification k={k}]({name})", ""] if name else []
  return "\n".join(lines)


def render(doc: dict, out: str | os.PathLike) -> dict:
  """Writes ``report.json``, the figures and ``report.md`` into ``out``; returns ``doc``."""
  folder = pathlib.Path(out)
  folder.mkdir(parents=True, exist_ok=True)
  runner.write_json(doc, folder / "report.json")
  figures = plots.draw_all(doc, folder)
  (folder / "report.md").write_text(_markdown(doc, figures))
  print(f"# report: {len(doc['rows'])} rows, {len(figures)} figures -> {folder}/report.md",
        flush=True)
  return doc


def main(opts: argparse.Namespace, argv: list[str]) -> int:
  run(opts, argv)
  return 0
