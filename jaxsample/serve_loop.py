"""Decode steps and generation with jaxsample's samplers.

* ``decode_step(lm, weights, state)``: one pure, jit-able step for a
  ``DecodeState`` of slots (``jaxsample.generation.step``).
* ``prefill(lm, weights, prompts)``: whole prompts into the cache, then each
  slot's first token (how new requests enter a state).
* ``generate(model, prompts, ...)``: prefill plus a ``jax.lax.while_loop`` of
  decode steps with per-request parameters, keys and stopping
  (``jaxsample.generation.generate``; bucket policy there).
* ``ServeLoop``: continuous batching of ``Request``s over fixed slots, with
  streamed ``StreamEvent``s, ``Completion``s in an OpenAI-like shape and
  optional ``Speculation`` (``NgramDrafter``, ``ModelDrafter``) and
  per-request logits processors (``ProcessorLimits``)
  (``jaxsample.generation.serving``, ``requests``, ``tracked``,
  ``slot_programs``, ``drafters``, ``spec_step``; user guide:
  ``docs/serving.md``).
* The model contract (``LanguageModel``, ``NnxLM``, ``FunctionLM``):
  ``jaxsample.generation.lm``; user guide: ``docs/generation.md``.
"""

from jaxsample.generation.drafters import (ModelDrafter, NgramDrafter,
                                           layer_prefix)
from jaxsample.generation.generate import (FINISH_REASONS, Generation, bucket,
                                           generate)
from jaxsample.generation.lm import (FunctionLM, LanguageModel, NnxLM,
                                     as_language_model)
from jaxsample.generation.requests import (Completion, ProcessorLimits,
                                           Request, Speculation, StreamEvent)
from jaxsample.generation.serving import ServeLoop
from jaxsample.generation.spec_step import SpecOutput, SpecState, spec_step
from jaxsample.generation.step import (DecodeState, StepOutput, decode_step,
                                       emit, prefill)

__all__ = ["Completion", "DecodeState", "FINISH_REASONS", "FunctionLM",
           "Generation", "LanguageModel", "ModelDrafter", "NgramDrafter",
           "NnxLM", "ProcessorLimits", "Request", "ServeLoop", "SpecOutput",
           "SpecState", "Speculation", "StepOutput", "StreamEvent",
           "as_language_model", "bucket", "decode_step", "emit", "generate",
           "layer_prefix", "prefill", "spec_step"]
