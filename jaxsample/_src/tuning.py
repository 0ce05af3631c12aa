"""Launch tuning of the Pallas kernels as data: one frozen config per kernel,
measured tables per device.

Every kernel reads its launch config from a ``Tuning``
(``resolve(SamplerConfig.tuning)``).  For each kernel the config is, in
order: the caller's override (``SamplerConfig(tuning=Tuning(stats=...))``,
the whole config of that kernel), else the entry of ``MEASURED`` for
``jax.devices()[0].device_kind``, else the config class's defaults (the
heuristic: values chosen on an H100, with ``None`` fields derived from the
shape by the plan functions).  Each ``MEASURED`` entry names the results
folders (``benchmarks/results/``) that measured it.  On CPU (interpret mode)
and on devices without an entry every kernel takes the heuristic.  See
``docs/tuning.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
from jax.experimental.pallas import triton as plgpu

__all__ = ["BoundsLaunch", "CompactLaunch", "DEFAULT",
           "H100_KIND", "H200_KIND", "Launch", "Measured", "MEASURED", "Occupancy",
           "overriding", "PackLaunch", "planned", "PassLaunch", "PivotLaunch",
           "RaceLaunch", "resolve", "SelectLaunch", "SpecStatsLaunch",
           "StatsLaunch", "Tuning", "WindowLaunch"]


def _check(owner, name: str, value, *, pow2: bool = False,
           optional: bool = False) -> None:
  if value is None and optional:
    return
  ok = (isinstance(value, numbers.Integral) and not isinstance(value, bool)
        and value >= 1)
  if pow2:
    ok = ok and value >= 16 and not value & (value - 1)
  if not ok:
    want = "a power of 2 >= 16" if pow2 else "an int >= 1"
    raise ValueError(f"{type(owner).__name__}.{name} must be {want}"
                     f"{' or None' if optional else ''}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class Launch:
  """Triton compiler parameters of a kernel with one program per row (grid
  ``(B,)``); the base of every launch config.

  Attributes:
    num_warps: warps per program.
    num_stages: Triton pipelining stages.
  """

  num_warps: int | None = 4
  num_stages: int = 1

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      _check(self, field.name, value, pow2=field.name == "block_size",
             optional=field.default is None)

  def compiler_params(self) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=self.num_warps,
                                num_stages=self.num_stages)


@dataclasses.dataclass(frozen=True)
class BoundsLaunch(Launch):
  """The bound select (``jaxsample_row_bounds``): one program per row."""

  num_warps: int = 8


@dataclasses.dataclass(frozen=True)
class SelectLaunch(Launch):
  """The final select (``jaxsample_select_threshold`` over the candidates)."""

  num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class WindowLaunch(Launch):
  """The window kernel (``jaxsample_threshold_window``) and the window's
  exact select: long serial searches."""

  num_warps: int = 16


@dataclasses.dataclass(frozen=True)
class PackLaunch(Launch):
  """The pack kernel (``jaxsample_pack_candidates``): at least ``num_warps``,
  one more per 256 buffer slots up to 16 (``warps``)."""

  num_warps: int = 8

  def warps(self, capacity: int) -> int:
    return min(16, max(self.num_warps, capacity // 256))


@dataclasses.dataclass(frozen=True)
class RaceLaunch(Launch):
  """A Gumbel race (``jaxsample_gumbel_max``; ``jaxsample_spec_emit``): grid
  ``(B, num_splits)``, each program walks its split in RNG tiles
  (``common.race_plan``).

  Attributes:
    num_warps: None: 1 from ``one_warp_batch`` rows with FP32 noise, else 4
      (``warps``).
    num_splits: programs per row; None: ``Occupancy.splits``.
    block_size: elements per load for generators without lanes (threefry);
      philox loads ``min(512, 128 * num_warps)`` lanes.
    one_warp_batch: the batch from which FP32-noise philox races take 1-warp
      programs.
  """

  num_warps: int | None = None
  num_splits: int | None = None
  block_size: int = 1024
  one_warp_batch: int = 32

  def warps(self, batch: int, *, fp64: bool, lanes: bool) -> int:
    if self.num_warps:
      return self.num_warps
    return 1 if lanes and batch >= self.one_warp_batch and not fp64 else 4


@dataclasses.dataclass(frozen=True)
class PassLaunch(Launch):
  """A pass over the row without noise: grid ``(B, num_splits)``, each
  program walks its split ``chunks_per_step`` loads of ``block_size`` per
  loop step (``threshold.base.pass_plan``).

  Attributes:
    block_size: elements per masked load.
    chunks_per_step: loads per loop step (the next step's run ahead).
    num_splits: programs per row; None: ``Occupancy.splits``.
  """

  block_size: int = 1024
  chunks_per_step: int = 1
  num_splits: int | None = None


@dataclasses.dataclass(frozen=True)
class StatsLaunch(PassLaunch):
  """Truncation pass 1 (``jaxsample_row_stats``); 4 x 512 with 4 warps
  beat 1 x 1024, 2 x 1024 and 4 x 1024 with 8 warps on an H100 (commit
  0c70631; that sweep's log was not kept)."""

  block_size: int = 512
  chunks_per_step: int = 4


@dataclasses.dataclass(frozen=True)
class CompactLaunch(PassLaunch):
  """Truncation pass 2 (``jaxsample_collect_candidates``)."""

  block_size: int = 1024
  chunks_per_step: int = 1


@dataclasses.dataclass(frozen=True)
class SpecStatsLaunch(PassLaunch):
  """Pass 1 of the draft-logits verifier (``jaxsample_spec_stats``); the
  load is at most the vocabulary rounded up to a power of 2."""

  block_size: int = 4096


@dataclasses.dataclass(frozen=True)
class PivotLaunch(Launch):
  """The pivot search (``jaxsample_pivot_threshold``): one program walks the
  whole row, ``chunks_per_step`` loads of ``block_size`` per step."""

  num_warps: int = 8
  block_size: int = 512
  chunks_per_step: int = 4
  num_splits = 1  # not a field: one program per row


@dataclasses.dataclass(frozen=True)
class Occupancy:
  """The split heuristic of the row-walking kernels (``splits``).

  Attributes:
    sm_count: SMs of the device (132 on an H100 and an H200).
    programs_per_sm: ``(warps, programs)`` pairs: the programs per SM the
      splits aim at, by warps per program (a program takes the entry of the
      most warps not above its own).
    one_warp_resident: 1-warp programs per SM past which a launch runs a
      short second wave.
    batch_shards: the shards a call's batch is split into (1: none): plans
      are made for ``batch_shards`` times a call's rows, so a batch shard
      launches what the whole batch would and its kernels sum in the same
      order (bit-identical logprobs).  ``jaxsample._src.parallel.batch`` sets it
      (``planned``).
    batch_invariant: plan every batch as one row (``planned_rows`` 1): a
      row's kernels then sum in the same order at any batch size, so its
      logprobs and masks are bit-identical at any B
      (``SamplerConfig.batch_invariant`` sets it; slower at large B).
  """

  sm_count: int = 132
  programs_per_sm: tuple[tuple[int, int], ...] = ((1, 15), (2, 6), (4, 3))
  one_warp_resident: int = 16
  batch_shards: int = 1
  batch_invariant: bool = False

  def __post_init__(self):
    _check(self, "sm_count", self.sm_count)
    _check(self, "one_warp_resident", self.one_warp_resident)
    _check(self, "batch_shards", self.batch_shards)
    pairs = self.programs_per_sm
    if not (isinstance(pairs, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and all(
            isinstance(v, numbers.Integral) and v >= 1 for v in p)
        for p in pairs) and 1 in dict(pairs)):
      raise ValueError(
          "Occupancy.programs_per_sm must be a tuple of (warps, programs) int "
          f"pairs with an entry for 1 warp; got {pairs!r}")

  def planned_rows(self, batch: int) -> int:
    """The rows a plan is made for: one when ``batch_invariant``, else the
    whole batch's on a batch shard."""
    return 1 if self.batch_invariant else batch * self.batch_shards

  def splits(self, rows: int, n_tiles: int, num_warps: int) -> int:
    """Splits per row: ``programs_per_sm`` programs per SM, rounded up; for
    1-warp programs, away from just over ``one_warp_resident`` per SM (one
    split fewer if that still leaves most of a full wave, else one more)."""
    target = max(entry for entry in self.programs_per_sm
                 if entry[0] <= num_warps)[1] * self.sm_count
    splits = max(1, min(n_tiles, -(-target // max(rows, 1))))
    per_sm = lambda s: rows * s / self.sm_count
    resident = self.one_warp_resident
    if num_warps == 1 and resident < per_sm(splits) <= 1.5 * resident:
      fewer = per_sm(splits - 1) >= 0.75 * resident
      splits = splits - 1 if fewer else splits + 1
    return splits


@dataclasses.dataclass(frozen=True)
class Tuning:
  """The launch configs of every kernel; a field left None takes the
  device's ``MEASURED`` entry, else the config class's defaults
  (``resolve``).  ``spec_emit`` is pass 2 of the draft-logits verifier."""

  gumbel: RaceLaunch | None = None
  spec_emit: RaceLaunch | None = None
  spec_stats: SpecStatsLaunch | None = None
  stats: StatsLaunch | None = None
  bounds: BoundsLaunch | None = None
  compact: CompactLaunch | None = None
  pack: PackLaunch | None = None
  select: SelectLaunch | None = None
  window: WindowLaunch | None = None
  pivot: PivotLaunch | None = None
  occupancy: Occupancy | None = None

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value, kind = getattr(self, field.name), _KINDS[field.name]
      if value is not None and not isinstance(value, kind):
        raise ValueError(f"Tuning.{field.name} must be a {kind.__name__} or "
                         f"None; got {value!r}")


_KINDS = {"gumbel": RaceLaunch, "spec_emit": RaceLaunch,
          "spec_stats": SpecStatsLaunch, "stats": StatsLaunch,
          "bounds": BoundsLaunch, "compact": CompactLaunch,
          "pack": PackLaunch, "select": SelectLaunch, "window": WindowLaunch,
          "pivot": PivotLaunch, "occupancy": Occupancy}

DEFAULT = Tuning(**{name: kind() for name, kind in _KINDS.items()})
"""The heuristic: every config at its class's defaults."""


@dataclasses.dataclass(frozen=True)
class Measured:
  """A device's config of one kernel and the results folders
  (``benchmarks/results/<folder>/``) whose runs chose it."""

  config: object
  sources: tuple[str, ...]
  note: str = ""


H100_KIND = "NVIDIA H100 80GB HBM3"
H200_KIND = "NVIDIA H200"

_H100_OCCUPANCY = Measured(
    Occupancy(sm_count=132, programs_per_sm=((1, 15), (2, 6), (4, 3)),
              one_warp_resident=16),
    ("2026-11-22-h100-sweep", "2026-11-24-one-warp",
     "2026-11-24-one-hot-pass"),
    "4-warp programs: ~3 per SM; 1-warp: 15 per SM (B = 128: 41.7 us); "
    "past 16 resident 1-warp programs a second wave (640 rows: 3 splits "
    "162.6 us, 4 splits 181.5)")

MEASURED: dict[str, dict[str, Measured]] = {
    H100_KIND: {
        "gumbel": Measured(
            RaceLaunch(num_warps=None, num_splits=None, block_size=1024,
                       num_stages=1, one_warp_batch=32),
            ("2026-11-22-h100-sweep", "2026-11-24-one-warp"),
            "4 warps beat 8 for B >= 32; 1 warp from B = 32 with FP32 noise "
            "(B = 128: 41.7 against 44.4 us; B = 1: 7.1 against 5.3; FP64 "
            "noise at B = 128: 135 against 87)"),
        "occupancy": _H100_OCCUPANCY,
        "bounds": Measured(
            BoundsLaunch(num_warps=8, num_stages=1),
            ("2026-11-24-compact-scan",),
            "8 warps: 6.9 us against 8.4 (4 warps) at B = 128"),
        "select": Measured(
            SelectLaunch(num_warps=4, num_stages=1),
            ("2026-11-24-compact-scan",),
            "8 warps: 4.6 us against 4.1 (B = 128)"),
        "compact": Measured(
            CompactLaunch(block_size=1024, chunks_per_step=1, num_warps=4,
                          num_splits=None, num_stages=1),
            ("2026-11-24-idle-skips",),
            "1 x 1024 with 4 warps beat 4 x 512, 2 x 1024 and 1 x 2048 "
            "(window pass at B = 128: 69.0 against 74.0-96.6 us)"),
        "window": Measured(
            WindowLaunch(num_warps=16, num_stages=1),
            ("2026-11-24-idle-skips",),
            "16 warps beat 8 and 4 (18.6 / 18.9 / 26.1 us at B = 1)"),
        "pack": Measured(
            PackLaunch(num_warps=8, num_stages=1),
            ("2026-11-23-h100-segment-gather",),
            "8 warps: 4.6 -> 3.9 us at B = 128"),
        "pivot": Measured(
            PivotLaunch(num_warps=8, block_size=512, chunks_per_step=4,
                        num_stages=1),
            ("2026-11-24-fewer-round-trips",),
            "8 warps beat 4 (B = 1, by count / mass: 521.8 / 664.0 us), 16 "
            "(577.8 / 657.7) and 32 (1013.7 / 1206.4)"),
    },
    H200_KIND: {
        "stats": Measured(
            StatsLaunch(block_size=512, chunks_per_step=4, num_warps=4,
                        num_splits=None, num_stages=1),
            ("2026-11-26-h200-bounds",),
            "27.5 us at B = 128; 2 x 1024 took 26.0 but was not adopted "
            "(8 warps 36.8, 2 warps 29.6)"),
    },
}
"""Configs measured per device kind (``jax.Device.device_kind``); kernels
without an entry take the heuristic (``DEFAULT``)."""


def resolve(override: Tuning | None = None,
            device_kind: str | None = None) -> Tuning:
  """Every kernel's config: ``override``'s where given, else the
  ``MEASURED`` entry of ``device_kind`` (default: the kind of
  ``jax.devices()[0]``), else ``DEFAULT``'s."""
  if override is not None and not isinstance(override, Tuning):
    raise ValueError(f"tuning must be a Tuning or None; got {override!r} (e.g. "
                     "Tuning(stats=StatsLaunch(num_warps=8)))")
  if device_kind is None:
    device_kind = jax.devices()[0].device_kind
  return _resolve(override or Tuning(), device_kind)


@functools.lru_cache(maxsize=64)
def _resolve(override: Tuning, device_kind: str) -> Tuning:
  table = MEASURED.get(device_kind, {})
  return Tuning(**{
      name: getattr(override, name) or (
          table[name].config if name in table else getattr(DEFAULT, name))
      for name in _KINDS})


def planned(override: Tuning | None, *, shards: int = 1,
            batch_invariant: bool = False) -> Tuning | None:
  """``override`` for a call on one of ``shards`` batch shards, planned as
  one row with ``batch_invariant``: its resolved ``occupancy`` with
  ``batch_shards`` multiplied by ``shards`` and ``batch_invariant`` set
  (``override`` itself for 1 shard without it)."""
  if shards == 1 and not batch_invariant:
    return override
  occupancy = resolve(override).occupancy
  return dataclasses.replace(override or Tuning(), occupancy=dataclasses.replace(
      occupancy, batch_shards=occupancy.batch_shards * shards,
      batch_invariant=occupancy.batch_invariant or batch_invariant))


def overriding(knobs: dict[str, int], device_kind: str | None = None) -> Tuning:
  """A ``Tuning`` that sets ``knobs`` (``{"kernel.field": value}``, e.g.
  ``{"compact.num_warps": 8}``) on the kernels' resolved configs, for sweeps;
  kernels without a knob stay None.

  Raises:
    ValueError: naming the knob, for an unknown kernel or field.
  """
  resolved, configs = resolve(None, device_kind), {}
  for knob, value in knobs.items():
    kernel, _, field = knob.partition(".")
    if kernel not in _KINDS or field not in {
        f.name for f in dataclasses.fields(_KINDS[kernel])}:
      raise ValueError(
          f"unknown tuning knob {knob!r}: give kernel.field with a kernel of "
          f"{sorted(_KINDS)} and one of its config's fields")
    config = configs.get(kernel) or getattr(resolved, kernel)
    configs[kernel] = dataclasses.replace(config, **{field: value})
  return Tuning(**configs)
