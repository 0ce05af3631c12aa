"""Vocab-parallel sampling across 2 ``jax.distributed`` CPU processes."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "multiprocess_sample.py"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_equal_one_device(tmp_path):
  """2 processes x 2 CPU devices, logits split along V over all 4: equal
  to one device's ``sample`` (bounded by a timeout; no hang)."""
  out = tmp_path / "result.txt"
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2",
             PYTHONPATH=str(SCRIPT.parent.parent))
  procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(port), "2",
                             str(i), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=240)[0].decode()[-2000:])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert all(p.returncode == 0 for p in procs), logs
  assert out.read_text().split() == ["True", "devices=4"], logs
