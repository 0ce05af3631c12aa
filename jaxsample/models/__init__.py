"""Models for generation: a Flax NNX transformer, the embedded weights and
Hugging Face Llama 3.x / Qwen2.5 checkpoints (``load_pretrained``)."""

from jaxsample.models.checkpoint import (DRAFT_DIR, EMBEDDED_DIR, load_draft,
                                         load_embedded, load_model,
                                         load_tokenizer, save_model)
from jaxsample.models.hf import load_pretrained
from jaxsample.models.transformer import KVCache, Transformer, TransformerConfig

__all__ = ["DRAFT_DIR", "EMBEDDED_DIR", "KVCache", "Transformer",
           "TransformerConfig", "load_draft", "load_embedded", "load_model",
           "load_pretrained", "load_tokenizer", "save_model"]
