"""Pallas (Triton) GPU kernels; on CPU they run in interpret mode."""

# Pallas' fuser registers a trace-context option (``pallas_fuser_disable_
# nested_fuse``) when first imported, which the first interpret-mode call
# does; every function jitted before it would then miss its cache and
# compile again on its next call.  Importing it with jaxsample registers
# the option before any of the caller's functions is jitted.
from jax.experimental.pallas import fuser as _fuser  # noqa: F401  pylint: disable=unused-import

__all__: list[str] = []
