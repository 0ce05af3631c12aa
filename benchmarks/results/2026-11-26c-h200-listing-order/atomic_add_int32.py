"""jax 0.11.2 Pallas-Triton: atomic_add of an int32 *vector* adds as floats.

    PYTHONPATH=. python3 atomic_add_int32.py     # on the GPU machine

``_atomic_lowering_rule`` picks ``RMWOp.ADD`` only when the value's MLIR type
is an ``IntegerType``; a vector's type is a ``RankedTensorType``, so int32
vectors get ``FADD``: small counts are denormal floats, flushed to 0.
Scalars (an ``IntegerType``) add correctly; ``atomic_xchg`` is unaffected;
``atomic_max`` on an int32 vector fails to lower (the float path).
Seen on the H200 with the session's longer variant script, of which this is
the core (counters start at 5; lanes 0..255 add 1 to bucket lane % 8):
    vector int32 add: counters [0 0 0 0 0 0 0 0 5 ...], old values 5 (first lane per bucket) then 0
    scalar int32 add: counter 5 -> 6, old value 5
    vector fp32 add (the workaround): exact counts and old values (the listing kernels' GPU tests)
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def kernel(_, counter_ref, old_ref, *, scalar):
  row = pl.program_id(0)
  if scalar:
    old_ref[row, :] = jnp.full((256,), plgpu.atomic_add(counter_ref, (row, 3),
                                                        jnp.int32(1)))
    return
  bucket = jnp.arange(256, dtype=jnp.int32) % 8
  old_ref[row, :] = plgpu.atomic_add(counter_ref, (row, bucket),
                                     jnp.ones_like(bucket))


for scalar in (False, True):
  counters, old = pl.pallas_call(
      functools.partial(kernel, scalar=scalar),
      out_shape=[jax.ShapeDtypeStruct((2, 16), jnp.int32),
                 jax.ShapeDtypeStruct((2, 256), jnp.int32)],
      grid=(2,), input_output_aliases={0: 0},
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(
          jnp.full((2, 16), 5, jnp.int32))
  print("scalar" if scalar else "vector", np.asarray(counters)[0],
        np.asarray(old)[0, :16])
