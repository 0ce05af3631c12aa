"""Shared by the copied peers' tests (``test_bench_peers``, ``test_flashinfer_peer``):
stand-in source trees and loading a copy or skipping without it."""

import pytest


def source_tree(root, files):
  """``root`` holding a stand-in file at each of ``files`` (paths in the copy)."""
  for name in files:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text("# stand-in\n")
  return root


def load_copy(module, source: str):
  """``module.load(source)`` (a copied peer), or a skip naming the missing copy."""
  try:
    module.resolve_source(source)
  except ValueError as error:  # VllmSourceError, FlashInferSourceError
    pytest.skip(f"needs the source copy: {error}")
  return module.load(source)
