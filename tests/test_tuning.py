"""Launch tuning as data (``jaxsample._src.tuning``): each device kind
resolves to the launch constants the kernels used before they became data,
an override reaches the kernel, and the old global knobs fail clearly."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsample
from jaxsample import SamplerConfig, SamplingParams
from jaxsample._src import rng
from jaxsample._src.pallas import common, gumbel
from jaxsample._src import tuning
from jaxsample._src.tuning import (BoundsLaunch, CompactLaunch, Occupancy,
                                   PackLaunch, PivotLaunch, RaceLaunch,
                                   SelectLaunch, SpecStatsLaunch, StatsLaunch,
                                   Tuning, WindowLaunch)

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The module constants the kernels launched with before tuning became data
# (commit 0393ea5): common._PROGRAMS_PER_SM, _ONE_WARP_BATCH,
# _ONE_WARP_RESIDENT, _SM_COUNT_DEFAULT; threshold.base._PASS_BLOCK,
# _PASS_TILE, _PASS_WARPS; stats._BOUND_WARPS; candidates._COMPACT_BLOCK,
# _COMPACT_TILE, _COMPACT_WARPS, _PACK_WARPS; select._SELECT_WARPS;
# window.WINDOW_WARPS; pivot._PIVOT_WARPS; spec.stats.STATS_BLOCK; every
# launch with 1 stage and the heuristic's warps and splits where
# SamplerConfig's knobs were None.
BEFORE = Tuning(
    gumbel=RaceLaunch(num_warps=None, num_splits=None, block_size=1024,
                      num_stages=1, one_warp_batch=32),
    spec_emit=RaceLaunch(num_warps=None, num_splits=None, block_size=1024,
                         num_stages=1, one_warp_batch=32),
    spec_stats=SpecStatsLaunch(block_size=4096, chunks_per_step=1,
                               num_warps=4, num_splits=None, num_stages=1),
    stats=StatsLaunch(block_size=512, chunks_per_step=4, num_warps=4,
                      num_splits=None, num_stages=1),
    bounds=BoundsLaunch(num_warps=8, num_stages=1),
    compact=CompactLaunch(block_size=1024, chunks_per_step=1, num_warps=4,
                          num_splits=None, num_stages=1),
    pack=PackLaunch(num_warps=8, num_stages=1),
    select=SelectLaunch(num_warps=4, num_stages=1),
    window=WindowLaunch(num_warps=16, num_stages=1),
    pivot=PivotLaunch(num_warps=8, block_size=512, chunks_per_step=4,
                      num_stages=1),
    occupancy=Occupancy(sm_count=132,
                        programs_per_sm=((1, 15), (2, 6), (4, 3)),
                        one_warp_resident=16))


@pytest.mark.parametrize("kind", [tuning.H100_KIND, tuning.H200_KIND, "cpu",
                                  "NVIDIA A100-SXM4-80GB"])
def test_every_device_resolves_to_the_constants_of_before(kind):
  """A refactor, not a retune: the H100's and the H200's tables and the
  heuristic (other devices, CPU) give the old constants."""
  assert tuning.resolve(None, kind) == BEFORE
  assert tuning.DEFAULT == BEFORE


def test_the_current_device_resolves_by_its_kind():
  kind = jax.devices()[0].device_kind
  assert tuning.resolve() == tuning.resolve(None, kind)


def test_old_pass_plans_pack_warps_and_splits():
  """The pack kernel's warps and the split heuristic as the old code
  computed them (``min(16, max(8, C / 256))``; ``_default_splits`` on
  ``(rows, tiles, warps)``)."""
  pack = BEFORE.pack
  assert [pack.warps(c) for c in (64, 1024, 2048, 4096, 8192, 16384)] == [
      8, 8, 8, 16, 16, 16]
  cases = [(1, 75, 4), (8, 75, 4), (32, 75, 1), (128, 75, 1), (128, 75, 4),
           (512, 75, 1), (640, 75, 1), (1152, 75, 1), (200, 75, 2),
           (96, 5, 8), (1, 149, 4), (4, 16, 4)]
  assert [BEFORE.occupancy.splits(*c) for c in cases] == [
      75, 50, 62, 16, 4, 4, 3, 3, 4, 5, 149, 16]
  race = BEFORE.gumbel
  assert race.warps(31, fp64=False, lanes=True) == 4
  assert race.warps(32, fp64=False, lanes=True) == 1
  assert race.warps(32, fp64=True, lanes=True) == 4
  assert race.warps(512, fp64=False, lanes=False) == 4  # threefry


def test_measured_entries_name_existing_results_folders():
  index = (ROOT / "benchmarks" / "results" / "README.md").read_text()
  for device, table in tuning.MEASURED.items():
    for kernel, entry in table.items():
      assert isinstance(entry.config, type(getattr(tuning.DEFAULT, kernel))), (
          device, kernel)
      assert entry.sources, (device, kernel)
      for folder in entry.sources:
        assert (ROOT / "benchmarks" / "results" / folder / "README.md"
                ).is_file(), (device, kernel, folder)
        assert f"`{folder}/`" in index, folder


def test_an_override_replaces_its_kernels_config_only():
  override = Tuning(stats=StatsLaunch(num_warps=8),
                    gumbel=RaceLaunch(num_splits=3))
  got = tuning.resolve(override, tuning.H100_KIND)
  assert got.stats == StatsLaunch(block_size=512, chunks_per_step=4,
                                  num_warps=8)
  assert got.gumbel.num_splits == 3 and got.gumbel.num_warps is None
  assert dataclasses.replace(got, stats=BEFORE.stats,
                             gumbel=BEFORE.gumbel) == BEFORE


def test_overriding_sets_knobs_on_resolved_configs():
  got = tuning.overriding({"compact.num_warps": 8, "compact.block_size": 512,
                           "pivot.num_warps": 4}, tuning.H100_KIND)
  assert got.compact == dataclasses.replace(BEFORE.compact, num_warps=8,
                                            block_size=512)
  assert got.pivot == dataclasses.replace(BEFORE.pivot, num_warps=4)
  assert got.stats is None and got.gumbel is None
  for knob in ("compact.warps", "sort.num_warps", "num_warps"):
    with pytest.raises(ValueError, match="unknown tuning knob"):
      tuning.overriding({knob: 4})


def _launches(fn, *args) -> dict[str, list]:
  """``{kernel name: [(grid, num_warps), ...]}`` of every ``pallas_call`` in
  ``fn``'s jaxpr (conds and loops included)."""
  found = {}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        found.setdefault(str(eqn.params["name"]), []).append(
            (tuple(eqn.params["grid_mapping"].grid),
             eqn.params["compiler_params"].num_warps))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def test_overrides_reach_the_kernels_launches():
  """Interpret mode: a larger stats-pass block shrinks its grid; the bound
  select and the Gumbel race take the warps and splits given; other
  kernels keep theirs."""
  batch, vocab = 8, 8192
  x = jnp.zeros((batch, vocab), jnp.float32)
  params = SamplingParams.make(batch, temperature=0.7, top_k=50, top_p=0.9)

  def launches(override):
    config = SamplerConfig(implementation="pallas", tuning=override)
    return _launches(lambda x: jaxsample.sample(
        x, params, jax.random.key(0), config=config), x)

  default = launches(None)
  # 512-element chunks (one per step in interpret mode): 16 tiles, 16 splits.
  assert default["jaxsample_row_stats"] == [((batch, 16), 4)]
  assert default["jaxsample_row_bounds"] == [((batch,), 8)]
  got = launches(Tuning(stats=StatsLaunch(block_size=2048),
                        bounds=BoundsLaunch(num_warps=2)))
  assert got["jaxsample_row_stats"] == [((batch, 4), 4)]
  assert got["jaxsample_row_bounds"] == [((batch,), 2)]
  others = lambda found: {k: v for k, v in found.items()
                          if k not in ("jaxsample_row_stats",
                                       "jaxsample_row_bounds")}
  assert others(got) == others(default)

  streams, _ = rng.row_streams(jax.random.key(0), None, batch, vocab)
  race = lambda launch: _launches(lambda x: gumbel.gumbel_partials(
      x, params.temperature, streams, SamplerConfig(
          implementation="pallas", tuning=Tuning(gumbel=launch))), x)
  # philox: 4 tiles of 2048; the default plan, 4 warps (B < 32), 4 splits.
  assert race(None)["jaxsample_gumbel_max"] == [((batch, 4), 4)]
  assert race(RaceLaunch(num_warps=2, num_splits=2))[
      "jaxsample_gumbel_max"] == [((batch, 2), 2)]


def test_a_batch_shard_plans_as_the_whole_batch():
  """``planned``: a shard's ``Occupancy.batch_shards`` scales the rows its
  plans are made for (warps and splits of the whole batch)."""
  assert tuning.planned(None) is None
  shard = tuning.resolve(tuning.planned(tuning.planned(None, shards=2),
                                        shards=4))
  assert shard.occupancy.batch_shards == 8
  whole = tuning.resolve()
  for rows in (1, 4, 16):
    plan = common.race_plan(rows, 151936, shard.gumbel, shard.occupancy,
                            generator="philox", fp64=False)
    want = common.race_plan(8 * rows, 151936, whole.gumbel, whole.occupancy,
                            generator="philox", fp64=False)
    assert (plan.num_warps, plan.num_splits) == (want.num_warps,
                                                 want.num_splits)


def test_batch_invariant_plans_every_batch_as_one_row():
  """``batch_invariant``: every kernel plan at any batch size (and on any
  batch shard) is the one-row plan, so a row's sums keep their order."""
  one = tuning.resolve(tuning.planned(None, batch_invariant=True))
  sharded = tuning.resolve(tuning.planned(None, shards=4,
                                          batch_invariant=True))
  alone = tuning.resolve()
  want = common.race_plan(1, 151936, alone.gumbel, alone.occupancy,
                          generator="philox", fp64=False)
  plain = {common.race_plan(b, 151936, alone.gumbel, alone.occupancy,
                            generator="philox", fp64=False).num_splits
           for b in (1, 33, 130, 512)}
  assert len(plain) > 1  # without it, the plan follows B
  for tuned in (one, sharded):
    for rows in (1, 33, 130, 512):
      for fp64 in (False, True):
        plan = common.race_plan(rows, 151936, tuned.gumbel, tuned.occupancy,
                                generator="philox", fp64=fp64)
        base = common.race_plan(1, 151936, alone.gumbel, alone.occupancy,
                                generator="philox", fp64=fp64)
        assert (plan.num_warps, plan.num_splits) == (base.num_warps,
                                                     base.num_splits)
      stats = common.make_plan(rows, 151936, chunk=1024, tile=4096,
                               num_warps=4, num_splits=None, num_stages=1,
                               occupancy=tuned.occupancy)
      assert stats.num_splits == common.make_plan(
          1, 151936, chunk=1024, tile=4096, num_warps=4, num_splits=None,
          num_stages=1, occupancy=alone.occupancy).num_splits
  assert want.num_warps == 4


@pytest.mark.parametrize("make,match", [
    (lambda: StatsLaunch(block_size=48), "StatsLaunch.block_size"),
    (lambda: CompactLaunch(block_size=8), "CompactLaunch.block_size"),
    (lambda: RaceLaunch(num_warps=0), "RaceLaunch.num_warps"),
    (lambda: PivotLaunch(num_stages=-1), "PivotLaunch.num_stages"),
    (lambda: SelectLaunch(num_warps=None), "SelectLaunch.num_warps"),
    (lambda: PackLaunch(num_warps=2.0), "PackLaunch.num_warps"),
    (lambda: Tuning(stats=CompactLaunch()), "Tuning.stats"),
    (lambda: Occupancy(programs_per_sm=((4, 3),)), "programs_per_sm"),
    (lambda: Occupancy(sm_count=0), "Occupancy.sm_count"),
    (lambda: Occupancy(batch_shards=0), "Occupancy.batch_shards"),
    (lambda: Tuning(occupancy=False), "Tuning.occupancy"),
    (lambda: SamplerConfig(tuning=StatsLaunch()), "tuning must be"),
])
def test_bad_tuning_values_raise_naming_the_field(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_numpy_integers_are_accepted():
  assert StatsLaunch(block_size=np.int64(1024), num_warps=np.int32(8)) == (
      StatsLaunch(block_size=1024, num_warps=8))


def test_configs_are_hashable_static_arguments():
  a = SamplerConfig(tuning=Tuning(stats=StatsLaunch(num_warps=8)))
  b = SamplerConfig(tuning=Tuning(stats=StatsLaunch(num_warps=8)))
  assert a == b and hash(a) == hash(b)
  assert a != SamplerConfig(tuning=Tuning(stats=StatsLaunch(num_warps=4)))


def test_nothing_sets_module_attributes():
  """Sweeps and batch shards pass configs: no ``setattr`` and no ``global``
  statement in the package or the scripts."""
  found = []
  for path in sorted([*(ROOT / "jaxsample").rglob("*.py"),
                      *(ROOT / "scripts").glob("*.py")]):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Global) or isinstance(node, ast.Call) and getattr(
          node.func, "id", None) == "setattr":
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
  assert not found


@pytest.mark.gpu
def test_the_gpu_has_a_measured_table(require_gpu):
  """The device kind string matches a ``MEASURED`` key (a misspelt key
  would silently fall back to the heuristic)."""
  kind = jax.devices()[0].device_kind
  assert kind in tuning.MEASURED, (kind, sorted(tuning.MEASURED))
  assert tuning.resolve() == BEFORE
  np.testing.assert_equal(tuning.resolve().occupancy.sm_count,
                          jax.devices()[0].core_count)
