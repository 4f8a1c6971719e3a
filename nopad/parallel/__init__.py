"""Parallel layouts of a packed batch: context parallelism (Megatron THD, zigzag or contiguous
chunks per rank) and Ulysses sequence parallelism (HF models under FSDP).

The THD plan itself is :class:`nopad.engines.ThdPlan`; these are the pieces a trainer
uses on their own: the CP alignment and shard indices, and Ulysses' model switch and gather.
"""

from nopad.parallel._cp import cp_alignment, gather_cp_shards, shard_index, unshard_index
from nopad.parallel._ulysses import enable_ulysses, gather_seq, padded_length, slice_for_rank

__all__ = [
    "cp_alignment",
    "enable_ulysses",
    "gather_cp_shards",
    "gather_seq",
    "padded_length",
    "shard_index",
    "slice_for_rank",
    "unshard_index",
]
