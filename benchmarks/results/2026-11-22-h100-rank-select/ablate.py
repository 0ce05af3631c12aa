"""Experiment: where the Gumbel kernel's time goes (ablations; tokens not exact except 'none')."""
import importlib.util, sys
import jax, jax.numpy as jnp
import jaxsample as js
from jaxsample import bench, rng
from jaxsample.pallas import common
spec = importlib.util.spec_from_file_location("gv", "gumbel_var.py")
gv = importlib.util.module_from_spec(spec); sys.modules["gv"] = gv; spec.loader.exec_module(gv)
vocab = 151936
bw = bench.measure_bandwidth()
print(f"copy bandwidth {bw/1e12:.2f} TB/s", flush=True)
gv.TILE_FILTER, gv.SCALAR_LOADS = True, True
for batch in (32, 128, 512):
  params = js.SamplingParams.make(batch, temperature=0.7)
  streams, _ = rng.row_streams(jax.random.key(1), None, batch, vocab)
  cfg = js.SamplerConfig(implementation="pallas")
  floor = batch * vocab * 4 / bw * 1e6
  inputs = bench.rotating_inputs(batch, vocab, jnp.float32, dist="randn")
  for ab in (None, "nocond", "norng", "exp_only", "load_only"):
    gv.ABLATE = ab
    f = jax.jit(lambda x: gv.gumbel_partials(x, params.temperature, streams, cfg).sumexp)
    jax.block_until_ready(f(inputs[0]))
    r = bench.time_op(f, inputs, 32, 5)
    print(f"B={batch:4d} {str(ab):10s} {r['us']:8.1f} us  x_floor {r['us']/floor:5.2f}", flush=True)
  del inputs
