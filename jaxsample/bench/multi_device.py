"""The ``sharded`` suite: vocab-parallel sampling on several devices.

Per case (``[B, V]`` logits, a tensor-parallel LM head's output split along
V over ``--devices`` devices): ``sharded.sample_sharded`` inside
``jax.shard_map``; the all-gather baseline (gather the vocabulary on every
device, then ``jaxsample.sample``); and ``jaxsample.sample`` on one device.
The sharded ops pad V with -inf to a multiple of ``devices x 2048`` (the
kernels' vocab shards are whole RNG tiles); the one-device op reads the
unpadded row.  Params are closed over (a decode loop's fixed settings), so
each program holds the route of those params alone.

Every row records ``collective_bytes``: the bytes of the results of the
collectives in the compiled program, per device (all-reduce, all-gather,
...; those inside conds count whether taken or not: an upper bound), and,
for the sharded ops, ``same_tokens``: whether their tokens equal one
device's ``sample`` on the same padded logits.  Multi-device ``us`` sums the
kernels of every device (``timing.time_op``): compare ``wall_us``, the
latency of a call.
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsample as js
from jaxsample import sharded
from jaxsample._src import rng
from jaxsample.bench import cases as cases_lib
from jaxsample.bench.runner import Group, Suite
from jaxsample.bench.suites import grid_cases

__all__ = ["SHARDED", "collective_bytes"]

_KEY = jax.random.key(1)
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
               "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
               "u64": 8}
_COLLECTIVE = re.compile(
    r"=\s*(.*?)\s(all-reduce|all-gather|all-to-all|collective-permute|"
    r"reduce-scatter)(-start)?\(")


def collective_bytes(compiled_text: str) -> int:
  """Bytes of the results of the collectives in compiled HLO text (per
  device; an async pair counted once, at its start)."""
  total = 0
  for line in compiled_text.splitlines():
    found = _COLLECTIVE.search(line)
    if not found:
      continue
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", found.group(1)):
      if dtype in _ITEM_BYTES:
        total += _ITEM_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


def _options(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--devices", type=int, default=2,
                      help="devices the vocabulary is split over (at most jax.device_count())")


def _build(args, case: cases_lib.Case) -> Group:
  devices = min(args.devices, jax.device_count())
  mesh = jax.make_mesh((devices,), ("v",), devices=jax.devices()[:devices])
  config = js.SamplerConfig(implementation=args.implementation)
  params = js.SamplingParams.make(case.batch, temperature=case.temperature,
                                  **cases_lib.SETTINGS[case.setting])
  tile = devices * rng.PHILOX_TILE
  padded = -(-case.vocab // tile) * tile
  split = NamedSharding(mesh, P(None, "v"))

  def pad(x):
    return jnp.pad(x, ((0, 0), (0, padded - case.vocab)), constant_values=-jnp.inf)

  inputs = [(x, jax.device_put(pad(x), split)) for x in case.inputs(most=8)]
  one = jax.jit(lambda x: js.sample(x, params, _KEY, config=config))
  shard_specs = dict(mesh=mesh, in_specs=P(None, "v"), out_specs=P())
  parallel = jax.jit(jax.shard_map(
      lambda x: sharded.sample_sharded(x, params, _KEY, axis_name="v", config=config),
      **shard_specs))
  gathered = jax.jit(jax.shard_map(
      lambda x: js.sample(lax.all_gather(x, "v", axis=1, tiled=True), params, _KEY,
                          config=config), check_vma=False, **shard_specs))
  one_name = "one device sample"
  programs = {one_name: (one, 0), f"sample_sharded {devices} devices": (parallel, 1),
              f"all-gather + sample {devices} devices": (gathered, 1)}
  compiled = {name: fn.lower(inputs[0][i]).compile() for name, (fn, i) in programs.items()}
  # The jitted functions (traceable: time_op checks that no kernel's outputs
  # are dropped); their compiled text above gives the collective bytes.
  ops = {name: (lambda xs, fn=fn, i=i: fn(xs[i])) for name, (fn, i) in programs.items()}
  want = np.asarray(one(jax.device_put(pad(inputs[0][0]), jax.devices()[0])).tokens)
  extra = {}
  for name in ops:
    alone = name == one_name
    extra[name] = dict(devices=1 if alone else devices,
                       vocab_padded=case.vocab if alone else padded,
                       collective_bytes=collective_bytes(compiled[name].as_text()))
    if not alone:  # the one-device op reads the unpadded row: other counters
      extra[name]["same_tokens"] = bool(np.array_equal(
          np.asarray(ops[name](inputs[0]).tokens), want))
  return Group(label=case.label(), inputs=inputs, ops=ops, floor_bytes=case.logits_bytes,
               extra=extra)


SHARDED = Suite(
    name="sharded",
    help="vocab-parallel sample_sharded vs all-gather + sample vs one device",
    defaults=dict(batch="128,256", dtypes="float32,bfloat16", iters=16, repeats=5),
    add_options=_options, cases=grid_cases, build=_build)
