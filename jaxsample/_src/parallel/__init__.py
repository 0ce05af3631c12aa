"""Sampling on sharded logits: batch-parallel (``batch``) and
vocab-parallel (``vocab``)."""

__all__: list[str] = []
