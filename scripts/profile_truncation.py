"""Per-kernel device times of the truncated sampler (one configuration).

    PYTHONPATH=. python3 scripts/profile_truncation.py [B] [dtype] [KNOB=int ...]

Inputs: randn logits scaled x1 and x5 in turn (``FLAT=1``: x1 only;
``DIST``: ``bench_truncation``'s distribution of that name instead).
``SETTINGS``: the filter settings, e.g. ``top_p=0.95;top_k=50,top_p=0.9``
(default: top-k 50 + top-p 0.9, top-p 0.9, min-p 0.05); ``MASK_IDS``: the
``K_cap`` values of the mask profiles (default 1024); ``CANDIDATES``: the
mask profiles' ``max_candidates`` (default: the config's); ``HLO_DIR``: also
write each profiled function's optimized HLO there.

For each setting: the truncated kernels alone, ``jaxsample.sample`` and
``jaxsample.sample(..., return_mask=True)`` per ``K_cap``; the ``TOP``
(default 14) costliest device ops each.
"""
import functools
import glob
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

import jaxsample
from jaxsample import SamplerConfig, SamplingParams, rng
from jaxsample.pallas import threshold

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 128
dtype = jnp.dtype(sys.argv[2] if len(sys.argv) > 2 else "float32")
for setting in sys.argv[3:]:  # module knobs, e.g. _SELECT_WARPS=2
  name, value = setting.split("=")
  # every stage module that binds the knob (imports copy the value)
  stages = [m for n, m in sys.modules.items()
            if n.startswith(threshold.__name__ + ".") and name in vars(m)]
  assert stages, f"no threshold stage defines {name}"
  for stage in stages:
    setattr(stage, name, int(value))
  print(f"# threshold.{name} = {value}")
vocab = 151936
TOP = int(os.environ.get("TOP", "14"))  # device ops listed per profile
xs = [(jax.random.normal(jax.random.key(i), (batch, vocab)) * s).astype(dtype)
      for i, s in enumerate([1, 1, 1, 1] if os.environ.get("FLAT") else
                            [1, 1, 5, 5])]
if os.environ.get("DIST"):  # one of bench_truncation's distributions
  sys.path.insert(0, os.path.dirname(__file__))
  import bench_truncation  # pylint: disable=g-import-not-at-top
  xs = (bench_truncation.make_inputs(os.environ["DIST"], batch, vocab,
                                     dtype) * 4)[:4]


def profile(label, fn):
  if os.environ.get("HLO_DIR"):
    name = "".join(c if c.isalnum() else "_" for c in label)
    with open(os.path.join(os.environ["HLO_DIR"], f"{name}.hlo"), "w") as f:
      f.write(fn.func.lower(xs[0], **fn.keywords).compile().as_text())
  for x in xs:
    jax.block_until_ready(fn(x))
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for i in range(20):
      out = fn(xs[i % 4])
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(
        glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
  per = {}
  for plane in data.planes:
    if plane.name.startswith("/device:GPU"):
      for line in plane.lines:
        if line.name.startswith("Stream"):
          for e in line.events:
            per[e.name] = per.get(e.name, 0) + e.duration_ns / 1e3 / 20
  print(f"== {label}: total {sum(per.values()):.1f} us")
  for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:TOP]:
    print(f"   {v:8.1f}  {k[:90]}")


settings = os.environ.get(
    "SETTINGS", "top_k=50,top_p=0.9;top_p=0.9;min_p=0.05").split(";")
mask_ids = [int(n) for n in os.environ.get("MASK_IDS", "1024").split(",")]
mask_config = dict(max_candidates=int(os.environ["CANDIDATES"])
                   ) if os.environ.get("CANDIDATES") else {}
for setting in settings:
  kw = {k: (int if k == "top_k" else float)(v) for k, v in
        (item.split("=") for item in setting.split(","))}
  name = setting.replace(",", "+")
  # Params are arguments (as in a decode loop), not folded constants.
  params = SamplingParams.make(batch, **kw).canonical(vocab)
  streams, _ = rng.row_streams(jax.random.key(0), None, batch, vocab)
  with_params = lambda f: functools.partial(jax.jit(f), params=params)
  profile(f"sample_truncated {name} B={batch} {dtype.name}", with_params(
      lambda x, params: threshold.sample_truncated(
          x, params, streams, SamplerConfig()).token))
  profile(f"jaxsample.sample {name} B={batch} {dtype.name}", with_params(
      lambda x, params: jaxsample.sample(
          x, params, jax.random.key(0),
          config=SamplerConfig(implementation="pallas")).tokens))
  for width in mask_ids:
    profile(f"jaxsample.sample + mask K_cap={width} {name} B={batch} "
            f"{dtype.name}", with_params(lambda x, params, width=width:
                jaxsample.sample(x, params, jax.random.key(0),
                                 return_mask=True, config=SamplerConfig(
                                     implementation="pallas",
                                     max_mask_ids=width, **mask_config))))
