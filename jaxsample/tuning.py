"""Kernel launch configs as data: ``SamplerConfig(tuning=Tuning(...))``
overrides the measured and heuristic tables per device; user guide:
``docs/tuning.md``."""

from jaxsample._src.tuning import (MEASURED, BoundsLaunch, CompactLaunch,
                                   Launch, Occupancy, PackLaunch, PassLaunch,
                                   PivotLaunch, RaceLaunch, SelectLaunch,
                                   SpecStatsLaunch, StatsLaunch, Tuning,
                                   WindowLaunch, overriding, resolve)

__all__ = ["BoundsLaunch", "CompactLaunch", "Launch", "MEASURED", "Occupancy",
           "PackLaunch", "PassLaunch", "PivotLaunch", "RaceLaunch",
           "SelectLaunch", "SpecStatsLaunch", "StatsLaunch", "Tuning",
           "WindowLaunch", "overriding", "resolve"]
