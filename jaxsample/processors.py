"""Per-request logits processors applied before sampling (penalties, logit
bias, allowed/banned ids, min tokens, grammar bitmasks): ``LogitsProcessors``
and ``pack_bitmask``; user guide: ``docs/processing.md``."""

from jaxsample._src.processors import MAX_BIAS, LogitsProcessors, pack_bitmask

__all__ = ["LogitsProcessors", "MAX_BIAS", "pack_bitmask"]
