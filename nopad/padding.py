"""verl-compatible conversions between padded TensorDicts and jagged nested tensors: a left-padded
prompt + right-padded response batch to nested per-token fields, and nested outputs back to padded
response log-probs (shifted by one token). Each is a fixed number of tensor ops whatever B."""

from nopad._padding import (
    build_attention_mask_from_nested,
    embeds_padding_2_no_padding,
    left_right_2_no_padding,
    no_padding_2_padding,
    plan_left_right,
    response_from_nested,
    response_to_nested,
)

__all__ = [
    "build_attention_mask_from_nested",
    "embeds_padding_2_no_padding",
    "left_right_2_no_padding",
    "no_padding_2_padding",
    "plan_left_right",
    "response_from_nested",
    "response_to_nested",
]
