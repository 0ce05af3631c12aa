"""Writes the serving demo's completions (token ids, logprobs as exact
hex floats, finish reasons, drafted and accepted counts) to a JSON file, for
bit-for-bit comparisons (``cmp``) of two versions or settings of the loop:

    PYTHONPATH=. python3 scripts/dump_completions.py OUT.json [serve_demo flags]
"""

import argparse
import json

from jaxsample import serve_demo


def main() -> None:
  cli = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  cli.add_argument("out", help="the JSON file to write")
  args, rest = cli.parse_known_args()
  demo = serve_demo.parser().parse_args(rest)
  model, tokenizer = serve_demo.load_target(demo)
  requests = serve_demo.make_requests(tokenizer, model.config.vocab_size, demo)
  loop = serve_demo.build_loop(model, demo.spec[0], demo)
  done, _ = serve_demo.serve(loop, requests, demo.arrivals, live=False)
  with open(args.out, "w") as f:
    json.dump({str(rid): [c.token_ids, [float(v).hex() for v in c.logprobs],
                          c.finish_reason, c.drafted, c.accepted]
               for rid, c in sorted(done.items())}, f)
  print(f"{len(done)} completions, "
        f"{sum(len(c.token_ids) for c in done.values())} tokens -> {args.out}")


if __name__ == "__main__":
  main()
