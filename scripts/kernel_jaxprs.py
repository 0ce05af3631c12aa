"""Digests of every Pallas kernel the public API launches, for showing that a
refactor leaves the kernels unchanged.

    PYTHONPATH=. python3 scripts/kernel_jaxprs.py OUT.txt [--batch 1,8,128] [--vocab 151936]

Traces ``sample`` (with a mask; philox and threefry, FP32 and FP64 noise;
bf16 logits), ``extract_sampling_mask`` and ``rejection_sample`` (draft
logits and one-hot drafts) with traced params on the default backend (run it
on the GPU machine for the GPU's plans and the device's tuning; on CPU the
kernels trace in interpret mode), prints one line per case (its number of
``pallas_call``s and a digest of its jaxpr: every kernel body, grid and
compiler parameters) and writes the jaxprs to OUT.txt.  Run it at two commits
and diff the printed lines (or OUT.txt).
"""
import argparse
import hashlib
import re

import jax
import jax.numpy as jnp

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import spec

parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("out", help="file for the jaxprs")
parser.add_argument("--batch", default="1,8,128", help="batch sizes")
parser.add_argument("--vocab", type=int, default=151936)
parser.add_argument("--draft-k", type=int, default=3, help="draft tokens")
cli = parser.parse_args()
S = jax.ShapeDtypeStruct
V, K = cli.vocab, cli.draft_k


def params_of(b):
  return [S((b,), jnp.float32), S((b,), jnp.int32), S((b,), jnp.float32),
          S((b,), jnp.float32)]


with open(cli.out, "w") as out:

  def dump(name, fn, *args):
    text = re.sub(r"0x[0-9a-f]+", "0x", str(jax.make_jaxpr(fn)(*args)))
    print(f"{name}: {text.count('pallas_call')} kernels, "
          f"{hashlib.sha256(text.encode()).hexdigest()[:16]}", flush=True)
    out.write(f"=== {name}\n{text}\n")

  for b in (int(v) for v in cli.batch.split(",")):
    key = S((2,), jnp.uint32)
    for gen in ("philox", "threefry"):
      for fp64 in (False, True):
        config = SamplerConfig(implementation="pallas", rng=gen,
                               use_fp64_gumbel=fp64)
        with jax.enable_x64(fp64):
          dump(f"sample+mask B={b} {gen} fp64={fp64}",
               lambda x, t, k, p, m, key, c=config: jaxsample.sample(
                   x, SamplingParams(t, k, p, m), key, return_mask=True,
                   config=c), S((b, V), jnp.float32), *params_of(b), key)
    config = SamplerConfig(implementation="pallas")
    dump(f"sample bf16 B={b}", lambda x, t, k, p, m, key: jaxsample.sample(
        x, SamplingParams(t, k, p, m), key, config=config),
         S((b, V), jnp.bfloat16), *params_of(b), key)
    dump(f"extract B={b}",
         lambda x, t, k, p, m: jaxsample.extract_sampling_mask(
             x, SamplingParams(t, k, p, m), config=config),
         S((b, V), jnp.float32), *params_of(b))
    for draft in (True, False):
      dump(f"spec draft_logits={draft} B={b}",
           lambda tl, dt, dl, n, t, k, p, m, key, draft=draft:
           spec.rejection_sample(tl, dt, n, SamplingParams(t, k, p, m), key,
                                 draft_logits=dl if draft else None,
                                 config=config),
           S((b, K + 1, V), jnp.float32), S((b, K), jnp.int32),
           S((b, K, V), jnp.float32), S((b,), jnp.int32), *params_of(b), key)
