"""SASS of the Gumbel kernel, for instruction counts (GPU machine only).

    PYTHONPATH=. python3 scripts/kernel_sass.py OUT_DIR [B] [V]

Captures the Triton IR that Pallas lowers ``jaxsample_gumbel_max`` to (B x V
fp32 logits, default plan), compiles it with the installed ``triton`` for
sm_90 and writes ``gumbel.ttir``, ``gumbel.ptx``, ``gumbel.cubin`` and
``gumbel.sass`` (nvdisasm or cuobjdump) to
OUT_DIR, then prints the opcode histogram of the SASS: over the whole kernel
and over its hottest loop (the largest backward-branch range).
"""
import collections
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering, pallas_call_registration

from jaxsample import SamplerConfig, rng
from jaxsample.pallas import gumbel

out = sys.argv[1]
B = int(sys.argv[2]) if len(sys.argv) > 2 else 128
V = int(sys.argv[3]) if len(sys.argv) > 3 else 151936

captured = []
_lower = lowering.lower_jaxpr_to_triton_module


def capture(*args, **kwargs):
  result = _lower(*args, **kwargs)
  captured.append(result.module.operation.get_asm(enable_debug_info=False))
  return result


pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture


def f(x, t):
  streams = rng.RowStreams(*(jnp.zeros((B,), jnp.uint32),) * 4)
  return gumbel.gumbel_partials(x, t, streams, SamplerConfig())


jax.jit(f).lower(jax.ShapeDtypeStruct((B, V), jnp.float32),
                 jax.ShapeDtypeStruct((B,), jnp.float32))
(ttir,) = captured
open(f"{out}/gumbel.ttir", "w").write(ttir)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

kernel = triton.compile(f"{out}/gumbel.ttir", target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4, "num_stages": 1})
open(f"{out}/gumbel.ptx", "w").write(kernel.asm["ptx"])
open(f"{out}/gumbel.cubin", "wb").write(kernel.asm["cubin"])
tools = [os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                      "bin"), "/usr/local/cuda/bin"] + os.environ.get(
                          "PATH", "").split(":")
for tool, flags in (("nvdisasm", ["-c"]), ("cuobjdump", ["-sass"])):
  found = [os.path.join(d, tool) for d in tools
           if os.path.exists(os.path.join(d, tool))]
  if found:
    sass = subprocess.run([found[0], *flags, f"{out}/gumbel.cubin"],
                          capture_output=True, text=True).stdout
    break
else:
  sys.exit(f"no nvdisasm or cuobjdump in {tools}")
open(f"{out}/gumbel.sass", "w").write(sass)
try:
  kernel._init_handles()
  print(f"registers {kernel.n_regs}, spills {kernel.n_spills}")
except Exception as e:  # diagnostics only
  print("no register count:", e)
lines = [l for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", l)]
ops = []
for l in lines:
  m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", l)
  if m:
    ops.append((int(m.group(1), 16), m.group(2), l))
print(f"{len(ops)} SASS instructions")
hist = collections.Counter(op.split(".")[0] for _, op, _ in ops)
print("whole kernel:", hist.most_common(40))
# Loops: branches to a lower address.
loops = []
for addr, op, l in ops:
  if op.startswith("BRA"):
    m = re.search(r"0x([0-9a-f]+)", l.split("BRA", 1)[1])
    if m and int(m.group(1), 16) < addr:
      loops.append((int(m.group(1), 16), addr))
for start, end in sorted(loops, key=lambda r: r[0] - r[1])[:3]:
  body = [op.split(".")[0] for a, op, _ in ops if start <= a <= end]
  print(f"loop {start:#x}-{end:#x}: {len(body)} instructions:",
        collections.Counter(body).most_common(40))
