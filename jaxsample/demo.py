"""The main job: generate Shakespeare with the embedded model and jaxsample.

``scripts/dev demo`` (``python -m jaxsample.demo``) loads the packaged Flax
NNX model (``docs/model.md``) and generates, in one batch, a completion for
each prompt, request ``i`` using setting ``i mod 4``: greedy, T = 0.8 with
top-p 0.9, top-k 20, and min-p 0.05.  It prints each completion and the
throughput (generated tokens per second of the jitted ``generate``, measured
after a compiling warm-up call); ``--masks`` also prints, per token, its
logprob and its sampling mask (the kept ids and ``logz``).  On a GPU the
sampler runs the Pallas kernels (``--implementation auto``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import numpy as np

import jaxsample as js
from jaxsample import serve_demo, serve_loop
from jaxsample.models import load_embedded
from jaxsample._src.params import IMPLEMENTATIONS

__all__ = ["PROMPTS", "SETTINGS", "main"]

CACHE_DIR = pathlib.Path.home() / ".cache" / "jaxsample" / "xla"

PROMPTS = [
    "ROMEO.\nBut soft, what light",
    "HAMLET.\nTo be, or not to be",
    "KING LEAR.\nBlow, winds, and",
    "MACBETH.\nIs this a dagger",
    "PORTIA.\nThe quality of mercy",
    "PROSPERO.\nWe are such stuff",
    "First Citizen.\nWhat say you",
    "OTHELLO.\nIt is the cause",
]
SETTINGS = [  # (name, temperature, top_k, top_p, min_p)
    ("greedy", 0.0, 0, 1.0, 0.0),
    ("T=0.8 top-p 0.9", 0.8, 0, 0.9, 0.0),
    ("top-k 20", 1.0, 20, 1.0, 0.0),
    ("min-p 0.05", 1.0, 0, 1.0, 0.05),
]


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
  """The module docstring as written, and each flag's default."""


def parse_args(argv):
  parser = argparse.ArgumentParser(
      prog="scripts/dev demo", description=__doc__,
      formatter_class=HelpFormatter)
  parser.add_argument("--prompt", action="append", dest="prompts",
                      metavar="TEXT",
                      help="a prompt (repeat the flag for several); default: "
                           f"{len(PROMPTS)} built-in openings")
  parser.add_argument("--max-new-tokens", type=int, default=48,
                      help="tokens to generate per request")
  parser.add_argument("--seed", type=int, default=0,
                      help="request i of round r uses key "
                           "fold_in(fold_in(key(seed), r), i); round 0 is the "
                           "printed warm-up call")
  parser.add_argument("--rounds", type=int, default=1,
                      help="timed generate calls after the compiling warm-up "
                           "call, whose completions are printed (fresh keys "
                           "each)")
  parser.add_argument("--masks", action="store_true",
                      help="print each token's logprob and sampling mask "
                           "(kept ids, or 'all' when nothing was cut, and logz)")
  parser.add_argument("--mask-ids", type=int, default=8,
                      help="with --masks: kept ids to show per token")
  parser.add_argument("--compile-cache", default=str(CACHE_DIR), metavar="DIR",
                      help="JAX persistent compilation cache (later runs skip "
                           "compiling); '' turns it off")
  parser.add_argument("--implementation", default="auto",
                      choices=IMPLEMENTATIONS,
                      help="sampler backend (auto: the Pallas kernels on GPU)")
  parser.add_argument("--serve", action="store_true",
                      help="run the serving-loop demo instead; the other flags "
                           "are its own (python -m jaxsample.serve_demo --help)")
  parser.add_argument("--rng", default="philox", choices=["philox", "threefry"],
                      help="counter-based noise generator")
  args = parser.parse_args(argv)
  if args.max_new_tokens < 1 or args.rounds < 1 or args.mask_ids < 1:
    parser.error("--max-new-tokens, --rounds and --mask-ids must be >= 1")
  return args


def show_masks(choice, tokenizer, width: int) -> None:
  for token, logprob, ids, logz in zip(choice["token_ids"], choice["logprobs"],
                                       choice["sampling_mask"], choice["logz"]):
    if ids is None:
      kept = "all"
    else:
      count = ids["count"] if isinstance(ids, dict) else len(ids)
      listed = ids["ids"] if isinstance(ids, dict) else ids
      kept = (f"{count} kept: " + " ".join(repr(tokenizer.decode([i]))
                                          for i in listed[:width])
              + (" ..." if count > width else ""))
    print(f"    {tokenizer.decode([token])!r:16s} logprob {logprob:8.4f}  "
          f"logz {logz:8.4f}  {kept}")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--serve" in argv:  # the serving loop's demo takes the other flags
    return serve_demo.main([a for a in argv if a != "--serve"])
  args = parse_args(argv)
  start = time.perf_counter()
  if args.compile_cache:
    jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  model, tokenizer = load_embedded()
  texts = args.prompts or PROMPTS
  prompts = [tokenizer.encode(text).ids for text in texts]
  if not all(prompts):
    print("error: --prompt must not be empty", file=sys.stderr)
    return 2
  settings = [SETTINGS[i % len(SETTINGS)] for i in range(len(texts))]
  names, temps, ks, ps, mps = zip(*settings)
  params = js.SamplingParams.make(len(texts), temperature=temps, top_k=ks,
                                  top_p=ps, min_p=mps)
  config = js.SamplerConfig(implementation=args.implementation, rng=args.rng)
  stop = [tokenizer.token_to_id("<|endoftext|>")]

  def run(round_index):
    base = jax.random.fold_in(jax.random.key(args.seed), round_index)
    keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(
        np.arange(len(texts)))
    out = serve_loop.generate(model, prompts, params=params, keys=keys,
                              max_new_tokens=args.max_new_tokens,
                              stop_tokens=stop, config=config,
                              return_masks=args.masks)
    return jax.block_until_ready(out)

  print(f"jaxsample {js.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), implementation={args.implementation}, "
        f"{len(texts)} requests, up to {args.max_new_tokens} new tokens each")
  warm = time.perf_counter()
  first = run(0)  # compiles
  compile_s = time.perf_counter() - warm
  timed, tokens = 0.0, 0
  for r in range(1, args.rounds + 1):
    t0 = time.perf_counter()
    out = run(r)
    timed += time.perf_counter() - t0
    tokens += int(np.sum(out.num_tokens))
  for text, name, choice in zip(texts, names,
                                first.to_openai(tokenizer=tokenizer)):
    print(f"\n[{name}] ({len(choice['token_ids'])} tokens, "
          f"{choice['finish_reason']})")
    print(text + choice["text"])
    if args.masks:
      show_masks(choice, tokenizer, args.mask_ids)
  print(f"\n{tokens} tokens in {timed:.2f} s: {tokens / timed:.1f} tokens/s "
        f"(batch {len(texts)}, {args.rounds} round(s)); first call with "
        f"compilation {compile_s:.1f} s; total {time.perf_counter() - start:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
