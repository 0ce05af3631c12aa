"""One process of a multi-process vocab-parallel sampling run (CPU or GPU).

``python scripts/multiprocess_sample.py PORT NUM_PROCESSES PROCESS_ID OUT``:
joins ``jax.distributed`` at ``localhost:PORT``, samples ``[8, 8192]`` logits
split along the vocabulary over every process's devices with
``sharded.sample_sharded`` (XLA path), and process 0 writes to ``OUT``
whether tokens, logprobs and validity equal its one-device ``sample``.
"""

import sys

import jax

port, num_processes, process_id, out = sys.argv[1:5]
import os  # noqa: E402

if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                           num_processes=int(num_processes),
                           process_id=int(process_id))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxsample  # noqa: E402
from jaxsample import sharded  # noqa: E402

B, V = 8, 8192
x = np.random.default_rng(5).normal(size=(B, V)).astype(np.float32) * 3
params = jaxsample.SamplingParams.make(B, temperature=[1.0, 0.7, 0.0, 1.3] * 2)
key = jax.random.key(3)
config = jaxsample.SamplerConfig(implementation="xla")
mesh = jax.make_mesh((jax.device_count(),), ("v",))
with jax.set_mesh(mesh):
  logits = jax.make_array_from_callback(
      x.shape, jax.NamedSharding(mesh, P(None, "v")), lambda i: x[i])
  body = jax.shard_map(lambda x, p: sharded.sample_sharded(
      x, p, key, axis_name="v", config=config),
                       in_specs=(P(None, "v"), P()), out_specs=P())
  got = jax.jit(body)(logits, jax.device_put(params, P()))
got = [np.asarray(a.addressable_data(0)) for a in jax.tree.leaves(got)]
local = jax.local_devices()[0]
# params as an argument on both sides (XLA folds constant temperatures).
want = jax.jit(lambda x, p: jaxsample.sample(x, p, key, config=config))(
    *jax.device_put((x, params), local))
same = all(np.array_equal(a, np.asarray(b))
           for a, b in zip(got, jax.tree.leaves(want)))
if jax.process_index() == 0:
  with open(out, "w") as f:
    f.write(f"{same} devices={jax.device_count()}\n")
jax.distributed.shutdown()
