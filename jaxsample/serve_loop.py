"""Decode steps and generation with jaxsample's samplers.

* ``decode_step(lm, weights, state)``: one pure, jit-able step for a
  ``DecodeState`` of slots (``jaxsample.generation.step``).
* ``generate(model, prompts, ...)``: prefill plus a ``jax.lax.while_loop`` of
  decode steps with per-request parameters, keys and stopping
  (``jaxsample.generation.generate``; bucket policy there).
* The model contract (``LanguageModel``, ``NnxLM``, ``FunctionLM``):
  ``jaxsample.generation.lm``; user guide: ``docs/generation.md``.
"""

from jaxsample.generation.generate import (FINISH_REASONS, Generation, bucket,
                                           generate)
from jaxsample.generation.lm import (FunctionLM, LanguageModel, NnxLM,
                                     as_language_model)
from jaxsample.generation.step import DecodeState, StepOutput, decode_step, emit

__all__ = ["DecodeState", "FINISH_REASONS", "FunctionLM", "Generation",
           "LanguageModel", "NnxLM", "StepOutput", "as_language_model",
           "bucket", "decode_step", "emit", "generate"]
