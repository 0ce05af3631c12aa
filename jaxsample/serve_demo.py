"""Serving demo: a stream of mixed requests through ``ServeLoop``.

``python -m jaxsample.serve_demo`` (or ``python -m jaxsample.demo --serve``)
loads the embedded Shakespeare model (a random-weight model of the same
architecture with ``--random`` or when the package has no weights), submits
``--requests`` requests with mixed settings (greedy, T = 0.8 + top-p 0.9,
top-k 20, min-p 0.05) arriving ``--arrivals`` per decode step, and shows a
live line: requests done, tokens/s, draft acceptance and the host's share of the
loop's time (not waiting for the device: ``docs/serving.md``).  ``--spec``
turns on speculative decoding: ``ngram`` (prompt lookup), ``draft`` (the
packaged draft model, ``jaxsample.models.load_draft``: 2 layers, d_model
64, trained on the same corpus with the same tokenizer), ``layers:N`` (the
model's first ``N`` layers as the draft model) or ``synthetic:R1,R2,..``
(per-position acceptance rates: ``k`` = the number of rates drafts verified
at every step, n-gram guesses padded with the last token; the cost of real
verification at a chosen acceptance).
``python -m jaxsample.bench serve`` serves the same stream with the same
options and prints only the summary lines, with the device's idle share.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import jax
import numpy as np
from flax import nnx

from jaxsample.generation.drafters import ModelDrafter, NgramDrafter, layer_prefix
from jaxsample.generation.lm import NnxLM
from jaxsample.generation.requests import Request, Speculation
from jaxsample.generation.serving import ServeLoop
from jaxsample.models import (EMBEDDED_DIR, Transformer, TransformerConfig,
                              load_draft, load_embedded)
from jaxsample._src.params import SamplerConfig

__all__ = ["SETTINGS", "acceptance", "add_options", "build_loop",
           "load_stream", "load_target", "main", "make_requests", "parser",
           "serve", "serve_specs"]

SETTINGS = (  # (name, Request fields)
    ("greedy", dict(temperature=0.0)),
    ("T=0.8 top-p 0.9", dict(temperature=0.8, top_p=0.9)),
    ("top-k 20", dict(temperature=1.0, top_k=20)),
    ("min-p 0.05", dict(temperature=1.0, min_p=0.05)),
)
PROMPTS = ("ROMEO:\nBut soft, what light", "KING HENRY:\nOnce more unto the",
           "HAMLET:\nTo be, or not to be", "First Citizen:\nBefore we proceed")


def load_target(args):
  """``(Transformer, tokenizer or None)``: embedded weights unless
  ``--random`` or absent."""
  if not args.random and (EMBEDDED_DIR / "config.json").exists():
    return load_embedded()
  config = TransformerConfig(vocab_size=args.vocab, d_model=args.d_model,
                             num_layers=args.layers, num_heads=args.heads,
                             num_kv_heads=args.kv_heads,
                             mlp_dim=args.mlp or 4 * args.d_model,
                             max_len=args.cache_len, dtype=args.dtype)
  return Transformer(config, rngs=nnx.Rngs(args.seed)), None


def build_loop(model: Transformer, spec: str, args) -> ServeLoop:
  """A ``ServeLoop`` over ``model`` with the ``--spec`` choice ``spec``."""
  config = SamplerConfig(implementation=args.implementation)
  speculation = None
  if spec == "ngram":
    speculation = Speculation(NgramDrafter(args.k))
  elif spec == "draft" or spec.startswith("layers:"):
    lm, weights = (NnxLM.split(load_draft()) if spec == "draft" else
                   layer_prefix(model, int(spec.split(":")[1])))
    speculation = Speculation(ModelDrafter(lm, args.k, config), weights)
  elif spec.startswith("synthetic:"):
    rates = [float(r) for r in spec.split(":")[1].split(",")]
    speculation = Speculation(NgramDrafter(len(rates)), synthetic_rates=rates)
  elif spec != "none":
    raise ValueError(f"--spec must be none, ngram, draft, layers:N or "
                     f"synthetic:R,..;"
                     f" got {spec!r}")
  return ServeLoop(NnxLM.split(model), slots=args.slots,
                   cache_len=args.cache_len, config=config,
                   steps_per_call=args.steps_per_call, speculation=speculation,
                   overlap=not args.no_overlap)


def make_requests(tokenizer, vocab: int, args) -> list[Request]:
  """``--requests`` requests cycling through ``SETTINGS`` and ``PROMPTS``."""
  rs = np.random.default_rng(args.seed)
  requests = []
  for i in range(args.requests):
    if tokenizer is not None:
      prompt = tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids
    else:
      prompt = rs.integers(0, vocab, args.prompt_len).tolist()
    requests.append(Request(prompt=prompt[:args.cache_len // 2],
                            max_tokens=args.max_tokens, seed=i, request_id=i,
                            **SETTINGS[i % len(SETTINGS)][1]))
  return requests


def acceptance(accepted: int, drafted: int) -> str:
  """``accepted / drafted`` and the draft count, or ``-`` with no drafts
  (``--spec none``, or an n-gram drafter that found no match)."""
  return f"{accepted / drafted:.2f} of {drafted} drafts" if drafted else "-"


def _progress(loop: ServeLoop, total: int, seconds: float) -> str:
  s = loop.stats
  share = lambda key: s[key] / s["busy_s"] if s["busy_s"] else 0.0
  return (f"requests {s['completed']}/{total} | {s['tokens']} tokens | "
          f"{s['tokens'] / max(seconds, 1e-9):8.1f} tok/s | acceptance "
          f"{acceptance(s['accepted'], s['drafted'])} | "
          f"host {100 * (1 - share('wait_s')):.1f}% of loop time (in "
          f"dispatch {100 * share('dispatch_s'):.1f}%)")


def serve(loop: ServeLoop, requests: list[Request], arrivals: int,
          live: bool, on_call=None) -> tuple[dict, float]:
  """Feeds ``arrivals`` requests per decode step (``arrivals *
  steps_per_call`` before each ``step`` call: the same stream for any
  number of steps per call); returns completions and seconds.
  ``on_call(i)``, if given, runs before the ``i``-th ``step`` call."""
  done, queue = {}, list(requests)
  per_call = arrivals * loop.steps_per_call
  start = time.perf_counter()
  for call in itertools.count():
    if not (queue or loop.pending):
      break
    if on_call is not None:
      on_call(call)
    for request in queue[:per_call]:
      loop.submit(request)
    del queue[:per_call]
    for event in loop.step():
      if event.completion is not None:
        done[event.request_id] = event.completion
    if live:
      print("\r" + _progress(loop, len(requests),
                             time.perf_counter() - start), end="",
            file=sys.stderr, flush=True)
  if live:
    print(file=sys.stderr)
  return done, time.perf_counter() - start


def serve_specs(model: Transformer, requests: list[Request], args, live: bool):
  """For each ``--spec`` value, a warmed-up loop serves ``requests``:
  yields ``(loop, completions, summary line)``."""
  for spec in args.spec:
    loop = build_loop(model, spec, args)
    start = time.perf_counter()
    loop.warmup(max(len(r.prompt) for r in requests))
    compile_s = time.perf_counter() - start
    done, seconds = serve(loop, requests, args.arrivals, live=live)
    yield loop, done, (f"spec={spec:18s} slots={args.slots} k={args.k} "
                       f"steps/call={loop.steps_per_call} "
                       f"warmup {compile_s:.1f} s | "
                       + _progress(loop, len(requests), seconds))


def load_stream(args):
  """``(model, tokenizer or None, requests)`` of the options; prints the
  model and the device."""
  model, tokenizer = load_target(args)
  what = "embedded model" if tokenizer is not None else "random weights"
  print(f"{what}: {model.config} on {jax.devices()[0].device_kind}")
  return model, tokenizer, make_requests(tokenizer, model.config.vocab_size,
                                         args)


def parser() -> argparse.ArgumentParser:
  """The command line of ``main``."""
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add_options(parser)
  parser.add_argument("--show", type=int, default=4,
                      help="completions to print")
  return parser


def add_options(parser: argparse.ArgumentParser) -> None:
  """The stream's, the model's and the loop's options (``main``'s and
  ``python -m jaxsample.bench serve``'s)."""
  parser.add_argument("--requests", type=int, default=32,
                      help="requests in the stream")
  parser.add_argument("--arrivals", type=int, default=4,
                      help="requests submitted per decode step")
  parser.add_argument("--slots", type=int, default=8, help="decode slots")
  parser.add_argument("--max-tokens", type=int, default=48,
                      help="tokens per request")
  parser.add_argument("--cache-len", type=int, default=256,
                      help="cached positions per sequence")
  parser.add_argument("--steps-per-call", type=int, default=None,
                      help="decode steps per jitted call (default: "
                      "ServeLoop's, DEFAULT_STEPS_PER_CALL)")
  parser.add_argument("--spec", nargs="+", default=["none"],
                      help="none | ngram | draft | layers:N | synthetic:R1,R2,..")
  parser.add_argument("--k", type=int, default=4,
                      help="draft tokens per step (ngram, draft, layers; synthetic: "
                      "one per rate)")
  parser.add_argument("--no-overlap", action="store_true",
                      help="read each step's outputs before the next dispatch")
  parser.add_argument("--implementation", default="auto",
                      choices=["auto", "pallas", "xla"])
  parser.add_argument("--random", action="store_true",
                      help="random weights instead of the embedded model")
  parser.add_argument("--vocab", type=int, default=2048,
                      help="random model: vocabulary")
  parser.add_argument("--d-model", type=int, default=128,
                      help="random model: width")
  parser.add_argument("--layers", type=int, default=4,
                      help="random model: layers")
  parser.add_argument("--heads", type=int, default=4,
                      help="random model: query heads")
  parser.add_argument("--kv-heads", type=int, default=2,
                      help="random model: key/value heads")
  parser.add_argument("--mlp", type=int, default=0,
                      help="random model: MLP width (0: 4 * d-model)")
  parser.add_argument("--dtype", default="float32",
                      choices=["float32", "bfloat16"],
                      help="random model: weights and activations")
  parser.add_argument("--prompt-len", type=int, default=16,
                      help="random model: prompt tokens")
  parser.add_argument("--seed", type=int, default=0)


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  model, tokenizer, requests = load_stream(args)
  for _, done, line in serve_specs(model, requests, args, live=True):
    print(line)
    for rid in sorted(done)[:args.show]:
      choice = done[rid].to_openai(tokenizer)
      name = SETTINGS[rid % len(SETTINGS)][0]
      body = choice.get("text", choice["token_ids"])
      print(f"  [{name}] {body!r} ({choice['finish_reason']}, acceptance "
            f"{acceptance(done[rid].accepted, done[rid].drafted)})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
