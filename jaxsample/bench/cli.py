"""``python -m jaxsample.bench SUITE [options]``: one CLI for every benchmark suite.

Each suite times jaxsample's ops and the reference ops (``jnp.max``'s plain
read, ``jax.random.categorical``, ``lax.top_k`` + categorical, an XLA sort
top-p; ``jaxsample.bench.peers``) on the same rotating inputs in the same run,
and reports the HBM floor (logits bytes over a copy bandwidth measured in the
same run).  It prints one table row per (op, case) and with ``--out`` writes
the rows as JSON.  ``python -m jaxsample.bench report`` runs the standard
grid against every peer and writes JSON, tables and figures
(``jaxsample.bench.report``); ``decode`` times decode steps
(``jaxsample.bench.decode``), ``serve`` the serving loop
(``jaxsample.bench.serve``) and ``hf`` generation on Hugging Face
checkpoints against transformers (``jaxsample.bench.hf``).  ``python -m jaxsample.bench SUITE --help``
lists a suite's options and defaults; ``docs/benchmarks.md`` has the
commands behind the README's figures.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from jaxsample.bench import (cases, hf, kernel_suites, multi_device, report,
                             runner, suites)

__all__ = ["COMMANDS", "SUITES", "main", "parser"]

SUITES = dict(suites.SUITES, pivot=kernel_suites.PIVOT, sort=kernel_suites.SORT,
              sharded=multi_device.SHARDED)
COMMANDS = {
    "decode": "decode steps: the embedded model, 8B- and 0.5B-shaped models "
              "with each token chooser (jaxsample.bench.decode)",
    "serve": "the serving loop: tokens/s, host and device idle shares "
             "(jaxsample.bench.serve)"}
"""Commands with their own command line (``main(argv)``), imported only when
run: they load the embedded model's packages (the ``models`` extra)."""


def parser() -> argparse.ArgumentParser:
  """The CLI's parser: one subcommand per suite."""
  top = argparse.ArgumentParser(
      prog="python -m jaxsample.bench", description=__doc__.split("\n\n")[0],
      epilog=f"settings: {', '.join(cases.SETTINGS)}; distributions: "
      f"{', '.join(cases.DISTS)}; case sets (--cases): {', '.join(cases.NAMED)}")
  commands = top.add_subparsers(dest="suite", required=True, metavar="SUITE")
  for suite in SUITES.values():
    sub = commands.add_parser(suite.name, help=suite.help, description=suite.help,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    runner.add_common_options(sub, suite.defaults)
    suite.add_options(sub)
  sub = commands.add_parser("report", help=report.__doc__.split("\n")[0],
                            description=report.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
  report.add_options(sub)
  sub = commands.add_parser("hf", help=hf.__doc__.split("\n\n")[0],
                            description=hf.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
  hf.add_options(sub)
  for name, help in COMMANDS.items():
    commands.add_parser(name, help=help, add_help=False)
  return top


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] in COMMANDS:
    return importlib.import_module(f"jaxsample.bench.{argv[0]}").main(argv[1:])
  args = parser().parse_args(argv)
  if args.suite == "report":
    return report.main(args, argv)
  if args.suite == "hf":
    return hf.main(args)
  if args.cases and args.cases not in cases.NAMED:
    raise SystemExit(f"--cases {args.cases!r}: expected one of {list(cases.NAMED)}")
  runner.run_suite(SUITES[args.suite], args)
  return 0


if __name__ == "__main__":
  sys.exit(main())
