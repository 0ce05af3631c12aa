"""Vocab-parallel sampling inside your own ``jax.shard_map`` (logits split
along V over ``axis_name``; O(B) collectives), bit-identical to the
single-device call; user guide: ``docs/multi_device.md``."""

from jaxsample._src.parallel.vocab import (extract_sampling_mask_sharded,
                                           rejection_sample_sharded,
                                           sample_sharded)

__all__ = ["extract_sampling_mask_sharded", "rejection_sample_sharded",
           "sample_sharded"]
