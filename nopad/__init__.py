"""nopad: padded <-> nested <-> packed LLM training batches, exact and without per-row loops."""

from nopad.layout import IndexPlan, gather_rows, prepare_offsets, prepare_position_ids, prepare_row_ids, to_host
from nopad.ops import index_first_axis, index_put_first_axis, pad_input, unpad_input
from nopad.padding import (
    build_attention_mask_from_nested,
    embeds_padding_2_no_padding,
    left_right_2_no_padding,
    no_padding_2_padding,
    plan_left_right,
    response_from_nested,
    response_to_nested,
)

__version__ = "0.1.0"

__all__ = [
    "IndexPlan",
    "build_attention_mask_from_nested",
    "embeds_padding_2_no_padding",
    "gather_rows",
    "index_first_axis",
    "index_put_first_axis",
    "left_right_2_no_padding",
    "no_padding_2_padding",
    "pad_input",
    "plan_left_right",
    "prepare_offsets",
    "prepare_position_ids",
    "prepare_row_ids",
    "response_from_nested",
    "response_to_nested",
    "to_host",
    "unpad_input",
]
