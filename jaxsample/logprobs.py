"""Top-n logprobs with ranks in vLLM's four modes (raw or processed, logprobs
or logits): ``token_logprobs``; user guide: ``docs/processing.md``."""

from jaxsample._src.logprobs import (MAX_TOP, MODES, TokenLogprobs,
                                     mode_values, token_logprobs,
                                     top_logprobs)

__all__ = ["MAX_TOP", "MODES", "TokenLogprobs", "mode_values",
           "token_logprobs", "top_logprobs"]
