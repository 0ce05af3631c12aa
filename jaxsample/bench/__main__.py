"""``python -m jaxsample.bench``: see ``jaxsample.bench.cli``."""

import sys

from jaxsample.bench.cli import main

__all__ = []

if __name__ == "__main__":  # importing this module alone runs nothing
  sys.exit(main())
