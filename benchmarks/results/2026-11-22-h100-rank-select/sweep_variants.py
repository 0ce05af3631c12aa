"""Experiment: Gumbel kernel variants (tile-level filter, scalar loads) vs HEAD."""
import importlib.util, sys
import jax, jax.numpy as jnp
import jaxsample as js
from jaxsample import bench, rng
from jaxsample.pallas import common, gumbel

spec = importlib.util.spec_from_file_location("gv", "gumbel_var.py")
gv = importlib.util.module_from_spec(spec); sys.modules["gv"] = gv; spec.loader.exec_module(gv)
vocab = 151936
bw = bench.measure_bandwidth()
print(f"copy bandwidth {bw/1e12:.2f} TB/s", flush=True)
variants = [("head", gumbel, None, {}), ("tile+scalar", gv, (True, True), {}),
            ("tile+vec", gv, (True, False), {}), ("chunk+scalar", gv, (False, True), {}),
            ("tile+scalar w8", gv, (True, True), dict(num_warps=8)),
            ("tile+scalar 4/SM", gv, (True, True), "4/SM"),
            ("tile+scalar 2/SM", gv, (True, True), "2/SM")]
cases = [("float32", b) for b in (1, 32, 128, 256, 512)] + [("bfloat16", 128), ("bfloat16", 32)]
for dtype, batch in cases:
  params = js.SamplingParams.make(batch, temperature=0.7)
  streams, _ = rng.row_streams(jax.random.key(1), None, batch, vocab)
  fns = {}
  dummy = jnp.zeros((batch, vocab), jnp.dtype(dtype))
  for name, mod, flags, extra in variants:
    if isinstance(extra, str):
      per = int(extra[0]) * 132
      n_tiles = -(-vocab // 2048)
      extra = dict(num_splits=max(1, min(n_tiles, -(-per // batch))))
    cfg = js.SamplerConfig(implementation="pallas", **extra)
    if flags is not None:
      gv.TILE_FILTER, gv.SCALAR_LOADS = flags
    f = jax.jit(lambda x, m=mod, c=cfg: m.combine_partials(m.gumbel_partials(x, params.temperature, streams, c))[0])
    jax.block_until_ready(f(dummy))
    plan = common.make_plan(batch, vocab, dtype, cfg, generator="philox")
    fns[name] = (f, plan)
  floor = batch * vocab * jnp.dtype(dtype).itemsize / bw * 1e6
  for dist in ("randn", "llm"):
    inputs = bench.rotating_inputs(batch, vocab, jnp.dtype(dtype), dist=dist)
    want = None
    for name, (f, plan) in fns.items():
      got = f(inputs[0])
      want = got if want is None else want
      same = bool(jnp.all(got == want))
      r = bench.time_op(f, inputs, 32, 5)
      print(f"{dtype:8s} {dist:5s} B={batch:4d} {plan.num_splits:3d}x{plan.steps:<3d} w{plan.num_warps} {name:18s} {r['us']:8.1f} us  x_floor {r['us']/floor:5.2f} same {same}", flush=True)
    del inputs
