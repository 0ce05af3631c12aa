"""The [B, V] operations of apply_processors (bias) on a jit parameter, donated, and computed in the program: JAX_PLATFORMS=cpu PYTHONPATH=. python3 THIS."""
import re, jax, jax.numpy as jnp, numpy as np
import jaxsample as js
from jaxsample.bench.cases import processor_fields
B, V, D = 8, 4096, 64
f = processor_fields(B, V, 64, 16)
procs = js.LogitsProcessors(**f["bias"])
params = js.SamplingParams.make(B)
def param_in(x, p):
  return js.processors.apply_processors(x, p)
def intermediate(h, w, p):
  x = (h @ w).astype(jnp.float32)
  return js.processors.apply_processors(x, p)
def intermediate_raw(h, w, p):
  x = (h @ w).astype(jnp.float32)
  return js.processors.apply_processors(x, p), jnp.max(x, axis=-1)
h = jax.ShapeDtypeStruct((B, D), jnp.bfloat16); w = jax.ShapeDtypeStruct((D, V), jnp.bfloat16)
x = jax.ShapeDtypeStruct((B, V), jnp.float32)
for name, fn, args, don in (("param", param_in, (x, procs), ()), ("param donated", param_in, (x, procs), (0,)),
                       ("intermediate", intermediate, (h, w, procs), ()), ("intermediate + raw read", intermediate_raw, (h, w, procs), ())):
  hlo = jax.jit(fn, donate_argnums=don).lower(*args).compile().as_text()
  entry = hlo[hlo.index("ENTRY"):]
  ops = [l.strip()[:130] for l in entry.splitlines() if " = " in l and f"[{B},{V}]" in l.split(" = ")[1][:40]]
  print("==", name); [print("  ", o) for o in ops]
def intermediate_raw_first(h, w, p):
  x = (h @ w).astype(jnp.float32)
  m = jnp.max(x, axis=-1)
  x, m = jax.lax.optimization_barrier((x, m))
  return js.processors.apply_processors(x, p), m
hlo = jax.jit(intermediate_raw_first).lower(h, w, procs).compile().as_text()
entry = hlo[hlo.index("ENTRY"):]
print("== raw first + barrier"); [print("  ", l.strip()[:130]) for l in entry.splitlines() if " = " in l and f"[{B},{V}]" in l.split(" = ")[1][:40]]
