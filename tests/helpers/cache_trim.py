"""The kept compile cache's size limit, applied once when a run starts."""

from __future__ import annotations

import os
import pathlib


def trim_cache(directory: str | os.PathLike, limit_bytes: int) -> list[str]:
  """Deletes the least recently modified files of ``directory`` (JAX's
  cache entries and any ``-atime`` files an older, capped cache left) until
  the rest take at most ``limit_bytes``; returns the names deleted.  One
  scan of the directory, where JAX's capped cache scans it on every write."""
  root = pathlib.Path(directory)
  if not root.is_dir():
    return []
  files = []
  for path in root.iterdir():
    if path.is_file() and not path.name.startswith("."):
      stat = path.stat()
      files.append((stat.st_mtime_ns, path.name, stat.st_size))
  total = sum(size for _, _, size in files)
  deleted = []
  for _, name, size in sorted(files):
    if total <= limit_bytes:
      break
    (root / name).unlink(missing_ok=True)
    total -= size
    deleted.append(name)
  return deleted
