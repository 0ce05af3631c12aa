"""Which PTX division matches XLA's fp32 ``x / t`` on this GPU?

    PYTHONPATH=. python3 scripts/check_division.py
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxsample.pallas import common

argparse.ArgumentParser(description=__doc__.strip().splitlines()[0]).parse_args()
x = jnp.asarray((np.random.default_rng(0).standard_normal((8, 4096)) * 10)
                .astype(np.float32))
t = jnp.float32([0.7, 0.3, 1.9, 3.3, 0.9, 1e-3, 0.45, 1.7])
xla = np.asarray(jax.jit(lambda x, t: x / t[:, None])(x, t))
ieee = np.asarray(x) / np.asarray(t)[:, None]


def kernel(t_ref, x_ref, o_ref, *, op):
  row = pl.program_id(0)
  xs = x_ref[row, :]
  ts = jnp.broadcast_to(t_ref[row], xs.shape)
  (quotient,) = common._asm(f"{op} $0, $1, $2;", "=f,f,f", (jnp.float32,),
                            xs, ts)
  o_ref[row, :] = quotient


for op in ("div.rn.f32", "div.full.f32", "div.approx.f32"):
  out = pl.pallas_call(functools.partial(kernel, op=op),
                       out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
                       grid=(8,))(t, x)
  out = np.asarray(out)
  print(f"{op:16s} differs from XLA in {np.sum(out != xla):6d} / {out.size}, "
        f"from IEEE in {np.sum(out != ieee):6d}")
print(f"{'XLA':16s} differs from IEEE in {np.sum(xla != ieee):6d}")
