"""jaxsample: exact, reproducible LLM token samplers for JAX with Pallas GPU kernels."""

from jaxsample._src.mask import extract_sampling_mask
from jaxsample._src.params import SamplerConfig, SamplingParams
from jaxsample._src.processors import LogitsProcessors
from jaxsample._src.reference import SampleResult
from jaxsample._src.sampling import sample
from jaxsample._src.sampling_mask import SamplingMask
from jaxsample._src.spec import rejection_sample
from jaxsample._src.spec_reference import SpecResult
from jaxsample._src import logprobs, pallas, spec  # pallas: see its __init__
from jaxsample._src.parallel import vocab as sharded

__all__ = ["LogitsProcessors", "SampleResult", "SamplerConfig",
           "SamplingMask", "SamplingParams", "SpecResult",
           "extract_sampling_mask", "rejection_sample", "sample"]
__version__ = "0.1.0"
