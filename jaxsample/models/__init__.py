"""Models for generation: a small Flax NNX transformer and the embedded weights."""

from jaxsample.models.checkpoint import (DRAFT_DIR, EMBEDDED_DIR, load_draft,
                                         load_embedded, load_model,
                                         load_tokenizer, save_model)
from jaxsample.models.transformer import KVCache, Transformer, TransformerConfig

__all__ = ["DRAFT_DIR", "EMBEDDED_DIR", "KVCache", "Transformer",
           "TransformerConfig", "load_draft", "load_embedded", "load_model",
           "load_tokenizer", "save_model"]
