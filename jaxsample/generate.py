"""Generate text with a Hugging Face checkpoint, streaming to the terminal.

``python -m jaxsample.generate --model PATH --prompt "..."`` loads a Llama
3.x or Qwen2/Qwen2.5 folder (``jaxsample.models.load_pretrained``: config,
safetensors weights, ``tokenizer.json``) and prints the completion as it is
generated.  ``--chat`` renders the prompt as a user message with the
folder's chat template.  Sampling settings default to the folder's
``generation_config.json`` (``jaxsample.models.text.GenerationDefaults``);
the flags override them.  ``--devices N`` shards the model tensor-parallel
over the first N devices.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

from jaxsample.models.text import TextGenerator

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxsample.generate",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--model", required=True,
                 help="a local Hugging Face folder (config.json, "
                 "*.safetensors, tokenizer.json)")
  p.add_argument("--prompt", required=True)
  p.add_argument("--chat", action="store_true",
                 help="render the prompt as a user message with the chat template")
  p.add_argument("--max-tokens", type=int, default=256)
  p.add_argument("--temperature", type=float, help="default: generation_config")
  p.add_argument("--top-k", type=int, help="default: generation_config (0: off)")
  p.add_argument("--top-p", type=float, help="default: generation_config")
  p.add_argument("--repetition-penalty", type=float,
                 help="default: generation_config (1: off)")
  p.add_argument("--stop", action="append", default=[],
                 help="a stop string (repeatable); the text ends before it")
  p.add_argument("--seed", type=int, default=None,
                 help="sampling seed (default: a fresh one)")
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                 help="default: the checkpoint's torch_dtype")
  p.add_argument("--max-len", type=int,
                 help="KV cache length (default min(max_position_embeddings, 4096))")
  p.add_argument("--devices", type=int, default=1,
                 help="shard the weights tensor-parallel over this many devices")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  mesh = None
  if args.devices > 1:
    devices = jax.devices()
    if args.devices > len(devices):
      raise SystemExit(f"--devices {args.devices}: only {len(devices)} "
                       "devices are visible")
    mesh = jax.sharding.Mesh(np.array(devices[:args.devices]), ("model",))
  generator = TextGenerator(args.model, dtype=args.dtype, mesh=mesh,
                            max_len=args.max_len, slots=1)
  for delta in generator.stream(
      args.prompt, chat=args.chat, max_tokens=args.max_tokens, stop=args.stop,
      seed=args.seed, temperature=args.temperature, top_k=args.top_k,
      top_p=args.top_p, repetition_penalty=args.repetition_penalty):
    sys.stdout.write(delta)
    sys.stdout.flush()
  sys.stdout.write("\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
