"""Parallel layouts of a packed batch: context parallelism (:mod:`nopad.parallel.cp`, Megatron THD)
and Ulysses sequence parallelism (:mod:`nopad.parallel.ulysses`, HF/FSDP).

``from nopad.parallel import cp_alignment`` keeps working: the CP names are re-exported here.
"""

from nopad.parallel.cp import (
    CP_LAYOUTS,
    CpLayout,
    check_cp_args,
    contiguous_shard_index,
    cp_alignment,
    fp8_alignment,
    gather_cp_shards,
    prepare_padded_lengths,
    shard_index,
    unshard_index,
    zigzag_shard_index,
)

__all__ = [
    "CP_LAYOUTS",
    "CpLayout",
    "check_cp_args",
    "contiguous_shard_index",
    "cp_alignment",
    "fp8_alignment",
    "gather_cp_shards",
    "prepare_padded_lengths",
    "shard_index",
    "unshard_index",
    "zigzag_shard_index",
]
