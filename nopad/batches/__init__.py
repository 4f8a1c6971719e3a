"""Batches: verl-compatible conversions between padded TensorDicts and jagged nested tensors (a left-
padded prompt + right-padded response batch to nested per-token fields, and back to padded response
log-probs), and the rows of a nested batch: select, split, join, pad, balanced token-budget
micro-batches (:func:`micro_batches`, over verl's workloads and Karmarkar-Karp partitions) and the way
back. Each is a fixed number of tensor ops whatever B."""

from nopad.batches._balance import Workload, balanced_partitions, karmarkar_karp, micro_batch_partitions, rank_order
from nopad.batches._padding import (
    build_attention_mask_from_nested,
    embeds_padding_2_no_padding,
    left_right_2_no_padding,
    no_padding_2_padding,
    plan_left_right,
    response_from_nested,
    response_to_nested,
)
from nopad.batches._rows import (
    RowRestore,
    cat_rows,
    chunk_rows,
    micro_batches,
    pad_rows,
    select_rows,
    split_rows,
    unpad_rows,
)

__all__ = [
    "RowRestore",
    "Workload",
    "balanced_partitions",
    "build_attention_mask_from_nested",
    "cat_rows",
    "chunk_rows",
    "embeds_padding_2_no_padding",
    "karmarkar_karp",
    "left_right_2_no_padding",
    "micro_batch_partitions",
    "micro_batches",
    "no_padding_2_padding",
    "pad_rows",
    "plan_left_right",
    "rank_order",
    "response_from_nested",
    "response_to_nested",
    "select_rows",
    "split_rows",
    "unpad_rows",
]
