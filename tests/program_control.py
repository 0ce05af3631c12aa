"""The data-dependent control flow of a compiled XLA program: its
``conditional`` ops and its ``while`` ops without a known trip count.

On a GPU, XLA copies a ``conditional``'s predicate (a ``while``'s condition,
each iteration, unless the trip count is known) to the host before it goes
on, so each such op blocks the dispatching thread until the device reaches
it (``docs/serving.md``, Host and device).  Ops inside a Pallas kernel run in
the kernel on a GPU; in interpret mode (CPU) XLA inlines the kernel body,
its ops named under the kernel's name, so ``control_ops`` skips them.
"""

from __future__ import annotations

import dataclasses
import re

import jax

__all__ = ["ControlOp", "control_ops", "kernel_names", "program_control"]

_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s.*?\s(conditional|while)\(")
_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELDS = re.compile(r'(\w+)=("[^"]*"|[^\s}]+)')


@dataclasses.dataclass(frozen=True)
class ControlOp:
  """One ``conditional`` or unknown-trip ``while`` of a program's text:
  ``kind``, the JAX name stack ``op_name`` and its ``source``: the Python
  frames that made it, innermost first (``file:line function``, ``<``
  between), or "" without them."""

  kind: str
  op_name: str
  source: str

  def __str__(self):
    return f"{self.kind} {self.op_name} ({self.source})"


def kernel_names(jaxpr) -> frozenset[str]:
  """The names of the ``pallas_call``s in a (closed) jaxpr, nested ones
  included."""
  names = set()
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    if eqn.primitive.name == "pallas_call":
      names.add(eqn.params["name"])  # also its ops' name scope
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (jax.extend.core.Jaxpr,
                            jax.extend.core.ClosedJaxpr)):
          names |= kernel_names(sub)
  return frozenset(names)


def _tables(text: str) -> dict[str, dict[int, str]]:
  """The module's source tables (``FileNames``, ``FunctionNames``,
  ``FileLocations``, ``StackFrames``): id -> row text."""
  tables, current = {}, None
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations",
                "StackFrames"):
      current = tables.setdefault(line, {})
    elif current is not None and (row := _TABLE_ROW.match(line)):
      current[int(row.group(1))] = row.group(2)
    else:
      current = None
  return tables


def _source(tables, frame: int, depth: int = 6) -> str:
  """The frames from ``frame`` outwards (at most ``depth``): each row
  names its location and its parent as ``parent_frame_id`` = the parent's
  id + 1 (0: none)."""
  files, functions = tables.get("FileNames", {}), tables.get(
      "FunctionNames", {})
  parts = []
  while frame in tables.get("StackFrames", {}) and len(parts) < depth:
    row = dict(_FIELDS.findall(tables["StackFrames"][frame]))
    place = dict(_FIELDS.findall(
        tables["FileLocations"][int(row["file_location_id"])]))
    path = files[int(place["file_name_id"])].strip('"')
    function = functions[int(place["function_name_id"])].strip('"')
    parts.append(f"{path.rsplit('/', 1)[-1]}:{place['line']} {function}")
    frame = int(row["parent_frame_id"]) - 1
  return " < ".join(parts)


def control_ops(text: str, kernels=frozenset()) -> list[ControlOp]:
  """The ``conditional`` ops and the ``while`` ops without
  ``known_trip_count`` of an HLO module's text (``compiled.as_text()``),
  but those inside the kernels named ``kernels`` (their op names hold a
  kernel's name as a component: an interpret-mode kernel's body)."""
  found, tables = [], _tables(text)
  for line in text.splitlines():
    op = _OP.search(line)
    if not op or (op.group(1) == "while" and "known_trip_count" in line):
      continue
    name = _NAME.search(line)
    name = name.group(1) if name else ""
    if kernels & set(name.split("/")):
      continue
    frame = _FRAME.search(line)
    found.append(ControlOp(op.group(1), name, _source(
        tables, int(frame.group(1))) if frame else ""))
  return found


def program_control(jitted, *args) -> list[ControlOp]:
  """``control_ops`` of ``jitted`` (a ``jax.jit`` function) compiled for
  ``args``, the kernels of its jaxpr skipped."""
  traced = jitted.trace(*args)
  return control_ops(traced.lower().compile().as_text(),
                     kernel_names(traced.jaxpr))
