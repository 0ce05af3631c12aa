"""Benchmarks with device-side timing: ``python -m jaxsample.bench SUITE --help``.

``cases`` (named shapes, dtypes, settings and logit distributions), ``timing``
(profiler-summed device time, the copy bandwidth), ``peers`` (the reference
ops timed beside jaxsample), ``runner`` (tables and JSON), ``suites`` and
``kernel_suites`` (the suites), ``cli`` (the command line).
"""

from jaxsample.bench.cases import (DISTS, LLM_HEADS, SETTINGS, Case, make_logits,
                                   rotating_inputs)
from jaxsample.bench.timing import L2_BYTES, measure_bandwidth, time_op

__all__ = ["Case", "DISTS", "L2_BYTES", "LLM_HEADS", "SETTINGS", "make_logits",
           "measure_bandwidth", "rotating_inputs", "time_op"]
