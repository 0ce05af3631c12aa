"""jaxsample: exact, reproducible LLM token samplers for JAX with Pallas GPU kernels."""

from jaxsample.mask import SamplingMask, extract_sampling_mask
from jaxsample.params import SamplerConfig, SamplingParams
from jaxsample.processors import LogitsProcessors
from jaxsample.reference import SampleResult
from jaxsample.sampling import sample
from jaxsample import logprobs, pallas, spec  # pallas: see its __init__

__all__ = ["LogitsProcessors", "SampleResult", "SamplerConfig",
           "SamplingMask", "SamplingParams", "extract_sampling_mask", "sample"]
__version__ = "0.1.0"
