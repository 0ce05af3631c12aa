"""The README and docs/ stay true: the quick start runs as pasted, the layout
table lists every package module, and every relative link resolves."""

import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _section(text: str, title: str) -> str:
  match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
  assert match, f"README has no '## {title}' section"
  return match.group(1)


def test_quick_start_runs_as_pasted():
  """The README's first python block, executed with a smaller vocabulary."""
  block = re.search(r"```python\n(.*?)```", README, re.S).group(1)
  small, count = re.subn(r"^batch, vocab = (\d+), \d+$", r"batch, vocab = \1, 1000", block,
                         flags=re.M)
  assert count == 1, "the quick start no longer sets 'batch, vocab = B, V' on one line"
  scope = {}
  exec(compile(small, "README.md:quick-start", "exec"), scope)
  out, batch = scope["out"], scope["batch"]
  tokens = np.asarray(out.tokens)
  assert tokens.shape == (batch,) and ((0 <= tokens) & (tokens < 1000)).all()
  assert np.asarray(out.valid).all()
  logprobs = np.asarray(out.logprobs)
  assert np.isfinite(logprobs).all() and (logprobs <= 0).all()
  np.testing.assert_array_equal(scope["positions"], 3)  # the loop advanced them


def test_layout_table_lists_every_package_module():
  layout = _section(README, "Layout")
  modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "jaxsample").rglob("*.py"))
  missing = [m for m in modules if f"`{m}`" not in layout]
  assert not missing, f"README's layout table misses {missing}"
  listed = re.findall(r"`(jaxsample/[^`]+\.py)`", layout)
  stale = [m for m in listed if not (ROOT / m).exists()]
  assert not stale, f"README's layout table lists modules that do not exist: {stale}"


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "benchmarks/results/README.md",
                                  *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
  text = page.read_text()
  targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
  broken = [t for t in targets if not (page.parent / t).exists()]
  assert not broken, f"{page.name}: broken links {broken}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_cite_existing_results_folders(page):
  folders = set(re.findall(r"`(20\d\d-\d\d-\d\d[a-z]?-[\w-]+)/`", page.read_text()))
  missing = [f for f in folders if not (ROOT / "benchmarks/results" / f).is_dir()]
  assert not missing, f"{page.name} cites results folders that do not exist: {missing}"
