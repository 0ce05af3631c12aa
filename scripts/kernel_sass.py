"""SASS of a kernel, for instruction counts (GPU machine only).

    PYTHONPATH=. python3 scripts/kernel_sass.py OUT_DIR [KERNEL] [B] [V] [kernel.field=int ...]

Captures the Triton IR that Pallas lowers KERNEL to (``gumbel``, the default:
``jaxsample_gumbel_max``; ``compact``: the windowed compact pass of
``threshold.collect_candidates``; ``stats``: the truncation's stats pass)
for B x V fp32 logits at the device's tuning (``jaxsample._src.tuning``),
with the given knobs set (e.g. ``compact.num_warps=8``),
compiles it with the installed ``triton`` for sm_90 (with the warps of the
kernel's launch plan) and writes
``KERNEL.ttir``, ``.ptx``, ``.cubin`` and ``.sass`` (nvdisasm or cuobjdump)
to OUT_DIR, then prints the register count and the opcode histogram of the
SASS: over the whole kernel and over its longest loops' paths that take no
forward branch (in the Gumbel kernel, tiles whose chunks hold no possible
winner).
"""
import argparse
import collections
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering, pallas_call_registration

from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import rng
from jaxsample._src.pallas import common, gumbel, threshold
from jaxsample._src import tuning

parser = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("out", help="output folder")
parser.add_argument("kernel", nargs="?", default="gumbel", choices=("gumbel", "compact", "stats"))
parser.add_argument("batch", nargs="?", type=int, default=128)
parser.add_argument("vocab", nargs="?", type=int, default=151936)
parser.add_argument("knobs", nargs="*", metavar="kernel.field=int",
                    help="tuning knobs, e.g. compact.num_warps=8")
cli = parser.parse_args()
out, name, B, V = cli.out, cli.kernel, cli.batch, cli.vocab
override = tuning.overriding({k: int(v) for k, v in (
    setting.split("=") for setting in cli.knobs)})
config = SamplerConfig(tuning=override)
tuned = tuning.resolve(override)

captured = []
WARPS = []  # num_warps of the captured kernel
_lower = lowering.lower_jaxpr_to_triton_module


def capture(*args, **kwargs):
  result = _lower(*args, **kwargs)
  captured.append(result.module.operation.get_asm(enable_debug_info=False))
  return result


pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture


def f(x, t):
  rows = jnp.zeros((B,), jnp.float32)
  if name == "stats":
    params = SamplingParams(t, rows.astype(jnp.int32), rows + 0.9, rows)
    plan = threshold.base.pass_plan(B, V, tuned.stats, tuned.occupancy)
    WARPS.append(plan.num_warps)
    return threshold.stats._stats_pass(
        x, params, plan, threshold.base.segment_size(V, plan.chunk), 1024)
  if name == "compact":
    WARPS.append(tuned.compact.num_warps)
    return threshold.collect_candidates(
        x, SamplingParams(t, rows.astype(jnp.int32), rows + 1, rows),
        rows > -1, rows, rows, rows, None, config,
        upper=rows + 1, capacity=8192)
  WARPS.append(common.race_plan(B, V, tuned.gumbel, tuned.occupancy,
                                generator="philox", fp64=False).num_warps)
  streams = rng.RowStreams(*(jnp.zeros((B,), jnp.uint32),) * 4)
  return gumbel.gumbel_partials(x, t, streams, config)


jax.jit(f).lower(jax.ShapeDtypeStruct((B, V), jnp.float32),
                 jax.ShapeDtypeStruct((B,), jnp.float32))
ttir = captured[0]  # the first kernel of the call
open(f"{out}/{name}.ttir", "w").write(ttir)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

warps = WARPS[0]  # the kernel's own warps (its launch plan's)
print(f"num_warps {warps}")
kernel = triton.compile(f"{out}/{name}.ttir", target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps, "num_stages": 1})
open(f"{out}/{name}.ptx", "w").write(kernel.asm["ptx"])
open(f"{out}/{name}.cubin", "wb").write(kernel.asm["cubin"])
tools = [os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                      "bin"), "/usr/local/cuda/bin"] + os.environ.get(
                          "PATH", "").split(":")
for tool, flags in (("nvdisasm", ["-c"]), ("cuobjdump", ["-sass"])):
  found = [os.path.join(d, tool) for d in tools
           if os.path.exists(os.path.join(d, tool))]
  if found:
    sass = subprocess.run([found[0], *flags, f"{out}/{name}.cubin"],
                          capture_output=True, text=True).stdout
    break
else:
  sys.exit(f"no nvdisasm or cuobjdump in {tools}")
open(f"{out}/{name}.sass", "w").write(sass)
try:
  kernel._init_handles()
  print(f"registers {kernel.n_regs}, spills {kernel.n_spills}, shared "
        f"{kernel.metadata.shared} bytes")
except Exception as e:  # diagnostics only
  print("no register count:", e)
# Instructions as (address, opcode, text); labels (".L_x_3:") name the next one.
ops, labels, pending = [], {}, []
for line in sass.splitlines():
  label = re.match(r"^(\.L_x_\d+):", line)
  if label:
    pending.append(label.group(1))
    continue
  m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
  if m:
    address = int(m.group(1), 16)
    labels.update((name, address) for name in pending)
    pending = []
    ops.append((address, m.group(2), line))
print(f"{len(ops)} SASS instructions")
hist = collections.Counter(op.split(".")[0] for _, op, _ in ops)
print("whole kernel:", hist.most_common(40))


def target(line):
  m = re.search(r"\((\.L_x_\d+)\)", line)
  return labels.get(m.group(1)) if m else None


branches = [(a, target(l)) for a, op, l in ops if op.startswith("BRA")]
loops = [(t, a) for a, t in branches if t is not None and t < a]
for start, end in sorted(loops, key=lambda r: r[0] - r[1])[:2]:
  # The loop's path that takes no forward branch inside it (for the Gumbel
  # kernel: every chunk's filter says no possible winner).
  skipped = [(a, t) for a, t in branches
             if t is not None and start <= a < t <= end]
  body = [op.split(".")[0] for a, op, _ in ops if start <= a <= end and
          not any(b < a < t for b, t in skipped)]
  print(f"loop {start:#x}-{end:#x}, path without forward branches: "
        f"{len(body)} instructions:", collections.Counter(body).most_common(40))
