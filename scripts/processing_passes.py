"""The XLA passes of logits processing and top-n logprobs, from compiled HLO.

    PYTHONPATH=. python3 scripts/processing_passes.py [--batch 128] [--vocab 151936]
        [--dtype float32] [--hlo PREFIX]

Compiles (does not run) ``apply_processors`` with each processor of
``python -m jaxsample.bench processing`` (penalties over 1,024-token output
histories with a 64-token prompt, a 16-id bias, a grammar bitmask, all of
them) and ``token_logprobs`` (top-5 raw logprobs) on the default backend,
and prints per program the operations of its entry computation (fusions,
scatters, sorts, copies, ...: each one a kernel launch or a pass), its
temporary and output buffer sizes (XLA's memory analysis), and every
``[B, V]`` value among the operations by dtype: the full-row temporaries
and outputs.
Run it at two commits and compare.
"""
import argparse
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np

import jaxsample as js
from jaxsample import logprobs, processors as procs

parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--batch", type=int, default=128)
parser.add_argument("--vocab", type=int, default=151936)
parser.add_argument("--dtype", default="float32")
parser.add_argument("--history", type=int, default=1024)
parser.add_argument("--prompt", type=int, default=64)
parser.add_argument("--hlo", help="also write each program's HLO to HLO.NAME.txt")
args = parser.parse_args()

B, V = args.batch, args.vocab
r = np.random.default_rng(0)
ids = lambda n: jnp.asarray(r.integers(0, V, (B, n)), jnp.int32)
rows = lambda v: jnp.full((B,), v, jnp.float32)
fields = {
    "penalties": dict(repetition_penalty=rows(1.1), presence_penalty=rows(0.5),
                      frequency_penalty=rows(0.2), output_ids=ids(args.history),
                      prompt_ids=ids(args.prompt),
                      num_output=jnp.full((B,), args.history, jnp.int32)),
    "bias": dict(bias_ids=ids(16), bias_values=jnp.ones((B, 16), jnp.float32)),
    "bitmask": dict(bitmask=jnp.asarray(
        r.integers(-2**31, 2**31, (B, procs.bitmask_width(V))), jnp.int32)),
}
fields["all processors"] = {k: v for f in fields.values() for k, v in f.items()}

x = jax.ShapeDtypeStruct((B, V), jnp.dtype(args.dtype))
params = js.SamplingParams.make(B)
tokens = jnp.zeros((B,), jnp.int32)
programs = {name: (procs.apply_processors, (x, js.LogitsProcessors(**kw)))
            for name, kw in fields.items()}
programs["top-5 raw logprobs"] = (
    lambda x, params, tokens: logprobs.token_logprobs(
        x, params, tokens, num_top=5, mode="raw_logprobs"), (x, params, tokens))

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?[\w.-]+ = (\([^)]*\)|\w+\[[\d,]*\]\S*) ([\w-]+)\(")


def fusion_roots(hlo: str) -> dict[str, str]:
  """Each computation's root opcode, by name."""
  roots, name = {}, None
  for line in hlo.splitlines():
    header = re.match(r"^%?([\w.-]+) .*\{$", line)
    if header and not line.startswith(" "):
      name = header.group(1)
    root = _INSTRUCTION.match(line.replace("ROOT ", "", 1)) if " ROOT " in line else None
    if root and name:
      roots[name] = root.group(2)
  return roots


def entry_lines(hlo: str) -> list[str]:
  """The lines of the ENTRY computation."""
  lines, inside = [], False
  for line in hlo.splitlines():
    if line.startswith("ENTRY"):
      inside = True
    elif inside and line.startswith("}"):
      break
    elif inside:
      lines.append(line)
  return lines


print(f"B = {B}, V = {V}, {args.dtype} logits, backend {jax.default_backend()}, "
      f"jax {jax.__version__}")
for name, (fn, inputs) in programs.items():
  compiled = jax.jit(fn).lower(*inputs).compile()
  hlo = compiled.as_text()
  memory = compiled.memory_analysis()
  if args.hlo:
    with open(f"{args.hlo}.{name.replace(' ', '_')}.txt", "w") as f:
      f.write(hlo)
  ops, full_rows = collections.Counter(), collections.Counter()
  roots = fusion_roots(hlo)
  for line in entry_lines(hlo):
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    shape, opcode = match.groups()
    if opcode in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
      continue
    if opcode == "custom-call":
      opcode = "custom-call " + re.search(r'custom_call_target="([^"]+)"', line).group(1)
    elif opcode == "fusion":
      opcode = f"fusion({roots.get(re.search(r'calls=%?([\w.-]+)', line).group(1), '?')})"
    ops[opcode] += 1
    for dtype in re.findall(rf"(\w+)\[{B},{V}\]", shape):
      full_rows[f"{dtype} {opcode}"] += 1
  fusions = sum(n for op, n in ops.items() if op.startswith("fusion"))
  print(f"\n{name}: {sum(ops.values())} operations ({fusions} fusions): "
        + ", ".join(f"{n} {op}" for op, n in sorted(ops.items())))
  if memory is not None:
    print(f"  buffers: {memory.temp_size_in_bytes / 2**20:.1f} MiB temporary, "
          f"{memory.output_size_in_bytes / 2**20:.1f} MiB output")
  print("  [B, V] values: " + (", ".join(f"{n} {k}" for k, n in sorted(full_rows.items()))
                               or "none"))
