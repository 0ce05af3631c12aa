"""jaxsample's private core: the API functions, their backends and kernels.

Nothing here is public: the public names are those of ``jaxsample``,
``jaxsample.serve_loop``, ``jaxsample.models`` and the public modules
``jaxsample._src.logprobs``, ``jaxsample._src.parallel.vocab`` and ``jaxsample.tuning``."""

__all__: list[str] = []
