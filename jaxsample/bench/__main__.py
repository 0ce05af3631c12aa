"""``python -m jaxsample.bench``: see ``jaxsample.bench.cli``."""

import sys

from jaxsample.bench.cli import main

sys.exit(main())
