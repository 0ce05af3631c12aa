"""The report's figures (matplotlib, ``Agg`` backend, PNG): time against batch size.

* ``sample-V{V}-{dtype}-{setting}.png``: one line per implementation (op), the
  HBM floor (dashed) and the plain read (``jnp.max``, thick) drawn;
* ``spec-V{V}-{dtype}-k{k}.png``: verification time per setting, with the
  target rows' read and floor.

Both axes are logarithmic (B from 1 to 512 spans two and a half decades of time).
"""

from __future__ import annotations

import pathlib

try:
  import matplotlib
  matplotlib.use("Agg")  # files only, no display
  from matplotlib import pyplot
except ImportError:  # the "bench" extra
  pyplot = None

__all__ = ["draw_all", "require_matplotlib"]

_READS = ("jnp.max (one read)", "jnp.max (target and draft)")


def require_matplotlib() -> None:
  if pyplot is None:
    raise SystemExit("the report's figures need matplotlib: pip install 'jaxsample[bench]' "
                     "(or matplotlib)")


def _figure(title: str, lines: dict[str, list[tuple[int, float]]],
            floor: list[tuple[int, float]], path: pathlib.Path) -> None:
  fig, ax = pyplot.subplots(figsize=(10.5, 5.5))
  colors = pyplot.get_cmap("tab20").colors
  ax.set_prop_cycle(color=colors[::2] + colors[1::2])  # ten hues, then their light shades
  for name, points in lines.items():
    xs, ys = zip(*sorted(points))
    read = name in _READS
    ax.plot(xs, ys, marker="o", markersize=3.5, label=name, color="black" if read else None,
            linewidth=2.6 if read else 1.3, zorder=3 if read else 2)
  xs, ys = zip(*sorted(floor))
  ax.plot(xs, ys, linestyle="--", color="grey", linewidth=1.5, label="HBM floor")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xticks(xs, [str(x) for x in xs])
  ax.set_xlabel("batch size B")
  ax.set_ylabel("us per call")
  ax.set_title(title, fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  pyplot.close(fig)


def _floor(rows: list[dict]) -> list[tuple[int, float]]:
  return list({r["batch"]: r["floor_us"] for r in rows}.items())


def draw_all(doc: dict, folder: pathlib.Path) -> dict:
  """Draws every figure of ``doc``'s rows into ``folder``; returns
  ``{("sample", V, dtype, setting) or ("spec", V, dtype, k): file name}``."""
  require_matplotlib()
  rows, device, names = doc["rows"], doc["device"], {}
  groups = {}
  for r in rows:
    key = (("sample", r["vocab"], r["dtype"], r["setting"]) if r["suite"] == "sample" else
           ("spec", r["vocab"], r["dtype"], r["k"]))
    groups.setdefault(key, []).append(r)
  for key, mine in groups.items():
    part, vocab, dtype, last = key
    lines = {}
    if part == "sample":
      name = f"sample-V{vocab}-{dtype}-{last}.png"
      title = f"{last}: V = {vocab}, {dtype}, {device}"
      for r in mine:
        lines.setdefault(r["op"], []).append((r["batch"], r["us"]))
    else:
      name = f"spec-V{vocab}-{dtype}-k{last}.png"
      title = f"verification, k = {last} (one-hot drafts): V = {vocab}, {dtype}, {device}"
      for r in mine:
        label = r["op"] if r["op"] in _READS else f"{r['op']} {r['setting']}"
        points = lines.setdefault(label, [])
        if r["batch"] not in dict(points):
          points.append((r["batch"], r["us"]))
    _figure(title, lines, _floor(mine), folder / name)
    names[key] = name
  return names
