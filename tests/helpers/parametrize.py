"""Parametrization helpers: the backends and generators tests run over, and
cases marked ``slow`` (outside the default CPU suite) or ``gpu`` (GPU only;
``tests/conftest.py`` skips them elsewhere)."""

from __future__ import annotations

import pytest


IMPLEMENTATIONS = ("xla", "pallas")
GENERATORS = ("philox", "threefry")


def slow_case(*values, id=None):
  """A parametrization case outside the default CPU suite (marked ``slow``):
  more interpret-mode kernel time than its coverage is worth on every CPU
  run; ``scripts/dev test --all`` and the GPU run take it."""
  return pytest.param(*values, marks=pytest.mark.slow, id=id)


# ``IMPLEMENTATIONS`` with the kernel case ``slow``: for tests whose kernel
# path other tests of the default suite already pin to the reference.
IMPLEMENTATIONS_SLOW_KERNELS = ("xla", slow_case("pallas", id="pallas"))


# ``GENERATORS`` for kernel-only tests with the threefry case ``slow``, and
# ``(impl, gen)`` pairs with the kernels' threefry case ``slow``: the
# kernels' threefry noise is pinned to the reference by the default parity
# cases of test_sample and test_rng.
GENERATORS_SLOW_THREEFRY = ("philox", slow_case("threefry", id="threefry"))
IMPLEMENTATIONS_BY_GENERATOR = (
    pytest.param("xla", "philox", id="xla-philox"),
    pytest.param("xla", "threefry", id="xla-threefry"),
    pytest.param("pallas", "philox", id="pallas-philox"),
    slow_case("pallas", "threefry", id="pallas-threefry"))


def on_gpu(*values, id=None):
  """A parametrization case that runs on a GPU only (marked ``gpu``): the
  shapes and models interpret mode is too slow for.  Tests with such cases
  are marked ``kernels``: their other cases run on every backend, and the
  GPU run (``-m "gpu or kernels or slow"``) takes them all."""
  return pytest.param(*values, marks=pytest.mark.gpu, id=id)
