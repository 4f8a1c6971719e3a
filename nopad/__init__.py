"""nopad: padded <-> nested <-> packed LLM training batches, exact and without per-row loops."""

from nopad.diagnostics import OpCounter
from nopad.layout import (
    IndexPlan,
    gather_rows,
    is_nested,
    jagged_values,
    nested_offsets,
    prepare_offsets,
    prepare_position_ids,
    prepare_row_ids,
    ragged_dim,
    spread_over_tokens,
    to_host,
    wrap_jagged,
)
from nopad.losses import (
    LossConfig,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
    kl_penalty,
    ppo_loss,
    sft_loss,
    value_loss,
)
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
from nopad.rows import select_rows

__version__ = "0.1.0"

__all__ = [
    "IndexPlan",
    "LossConfig",
    "OpCounter",
    "agg_loss",
    "compute_policy_loss",
    "compute_value_loss",
    "is_nested",
    "jagged_values",
    "kl_penalty",
    "nested_offsets",
    "ppo_loss",
    "ragged_dim",
    "spread_over_tokens",
    "sft_loss",
    "value_loss",
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
    "select_rows",
    "to_host",
    "wrap_jagged",
    "unpad_input",
]
