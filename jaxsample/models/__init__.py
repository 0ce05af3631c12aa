"""Models for generation: a small Flax NNX transformer and the embedded weights."""

from jaxsample.models.checkpoint import (EMBEDDED_DIR, load_embedded,
                                         load_model, load_tokenizer,
                                         save_model)
from jaxsample.models.transformer import KVCache, Transformer, TransformerConfig

__all__ = ["EMBEDDED_DIR", "KVCache", "Transformer", "TransformerConfig",
           "load_embedded", "load_model", "load_tokenizer", "save_model"]
