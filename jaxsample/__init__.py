"""jaxsample: exact, reproducible LLM token samplers for JAX with Pallas GPU kernels."""

from jaxsample.mask import extract_sampling_mask
from jaxsample.params import SamplerConfig, SamplingParams
from jaxsample.processors import LogitsProcessors
from jaxsample.reference import SampleResult
from jaxsample.sampling import sample
from jaxsample.sampling_mask import SamplingMask
from jaxsample.spec import rejection_sample
from jaxsample.spec_reference import SpecResult
from jaxsample import logprobs, pallas, sharded, spec  # pallas: see its __init__

__all__ = ["LogitsProcessors", "SampleResult", "SamplerConfig",
           "SamplingMask", "SamplingParams", "SpecResult",
           "extract_sampling_mask", "rejection_sample", "sample"]
__version__ = "0.1.0"
