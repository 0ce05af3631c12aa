"""Inspection of programs: sort operands in lowered text, the runtime conds
and kernels of a jaxpr, and a counter of XLA compilations."""

from __future__ import annotations

import re

import jax


def sort_operands(stablehlo: str) -> list[str]:
  """The operand types of every sort in lowered StableHLO text."""
  return re.findall(r"stablehlo\.sort.*?\}\) : \(([^)]*)\)", stablehlo,
                    re.DOTALL)


def outside_conds(jaxpr, found=None, *, nested: bool = False) -> dict:
  """The ``lax.cond``s of a jaxpr outside kernels (``"cond"``: how many run on
  every call, outside any cond's branches; ``"nested"``: how many inside
  branches) and the kernels (by name) that run on every call.  On a GPU
  each cond that runs sends its predicate to the host."""
  found = {"cond": 0, "nested": 0} if found is None else found
  # ``lax.platform_dependent``'s cond picks its branch while compiling (its
  # index is a ``platform_index``): no predicate travels, no nesting.
  platform = {v for eqn in jaxpr.eqns if eqn.primitive.name == "platform_index"
              for v in eqn.outvars}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "pallas_call":
      if not nested:
        found[eqn.params["name"]] = True
      continue
    runtime_cond = name == "cond" and eqn.invars[0] not in platform
    if runtime_cond:
      found["nested" if nested else "cond"] += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
        if hasattr(sub, "eqns"):
          outside_conds(sub, found, nested=nested or runtime_cond)
  return found


class CompileCounter:
  """Counts XLA backend compilations while installed."""

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self.count = 0

  def __call__(self, event, duration, **kwargs):
    del duration, kwargs
    self.count += event == self.EVENT

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self)
