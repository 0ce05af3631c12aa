"""Every Python block of README.md and docs/*.md runs as pasted, on CPU.

Each block runs alone in a fresh interpreter (nothing from an earlier block),
from an empty directory, with this checkout first on ``PYTHONPATH``.  A block
that cannot run alone starts with ``# fragment: needs <what>`` and is only
checked for naming what it needs (docs/testing.md, Documentation blocks).  A
block that mentions ``--xla_force_host_platform_device_count=N`` (its
comment saying it needs N devices) runs with that flag in ``XLA_FLAGS``.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from helpers.child_env import compile_cache_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "# fragment: needs "
DEVICES_FLAG = re.compile(r"--xla_force_host_platform_device_count=\d+")


def python_blocks():
  """``(page:line, code)`` of every fenced ``python`` block."""
  blocks = []
  for page in PAGES:
    text = page.read_text()
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
      line = text.count("\n", 0, match.start()) + 1
      blocks.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
  return blocks


BLOCKS = python_blocks()
RUNNABLE = [pytest.param(code, id=where) for where, code in BLOCKS
            if not code.startswith(FRAGMENT)]


def test_fragments_say_what_they_need():
  """A block marked as a fragment uses the one marker and names its need."""
  bad = [where for where, code in BLOCKS
         if code.lstrip().startswith("# fragment")
         and not re.match(re.escape(FRAGMENT) + r"\S", code)]
  assert not bad, f"fragment markers must read '{FRAGMENT}<what>': {bad}"
  assert len(RUNNABLE) >= 16, "the pages lost their runnable blocks"


def block_env(code: str) -> dict:
  """The test process's environment (its XLA flags, CPU only), this checkout
  first on the path, the suite's compile cache (``compile_cache_env``), and
  the block's device count."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(
                 filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
             **compile_cache_env())
  devices = DEVICES_FLAG.search(code)
  if devices:
    env["XLA_FLAGS"] = " ".join(filter(None, (env.get("XLA_FLAGS"),
                                              devices.group(0))))
  return env


@pytest.mark.parametrize("code", RUNNABLE)
def test_block_runs_as_pasted(code, tmp_path):
  done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                        env=block_env(code), capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, (
      f"the block failed as pasted (exit {done.returncode}); mark it "
      f"'{FRAGMENT}<what>' if it cannot run alone:\n{done.stderr[-3000:]}")
