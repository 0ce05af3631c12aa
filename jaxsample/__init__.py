"""jaxsample: exact, reproducible LLM token samplers for JAX with Pallas GPU kernels.

The public face: the names of ``__all__``; the modules ``logprobs``,
``processors``, ``sharded`` and ``tuning``; and, imported on demand,
``jaxsample.serve_loop`` (decode steps, generation, serving), ``jaxsample.models``
and ``jaxsample.bench``.  Everything under ``jaxsample._src`` is private."""

from jaxsample._src.mask import extract_sampling_mask
from jaxsample._src.params import SamplerConfig, SamplingParams
from jaxsample._src.processors import LogitsProcessors
from jaxsample._src.reference import SampleResult
from jaxsample._src.sampling import sample
from jaxsample._src.sampling_mask import SamplingMask
from jaxsample._src.spec import rejection_sample
from jaxsample._src.spec_reference import SpecResult
from jaxsample import logprobs, processors, sharded, tuning

__all__ = ["LogitsProcessors", "SampleResult", "SamplerConfig",
           "SamplingMask", "SamplingParams", "SpecResult",
           "extract_sampling_mask", "rejection_sample", "sample"]
__version__ = "0.1.0"
