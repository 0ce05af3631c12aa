"""Writes the serving demo's completions (token ids, logprobs as exact
hex floats, finish reasons) to a JSON file, for bit-for-bit comparisons of
two versions of the loop:

    PYTHONPATH=<tree> python3 dump_completions.py OUT.json [serve_demo flags]
"""

import json
import sys

from jaxsample import serve_demo


def main(out: str, argv: list[str]) -> None:
  args = serve_demo.parser().parse_args(argv)
  model, tokenizer = serve_demo.load_target(args)
  requests = serve_demo.make_requests(tokenizer, model.config.vocab_size, args)
  loop = serve_demo.build_loop(model, args.spec[0], args)
  done, _ = serve_demo.serve(loop, requests, args.arrivals, live=False)
  with open(out, "w") as f:
    json.dump({str(rid): [c.token_ids, [float(v).hex() for v in c.logprobs],
                          c.finish_reason, c.drafted, c.accepted]
               for rid, c in sorted(done.items())}, f)
  print(f"{len(done)} completions, {sum(len(c.token_ids) for c in done.values())}"
        f" tokens -> {out}")


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
