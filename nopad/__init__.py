"""nopad: padded <-> nested <-> packed LLM training batches, exact and without per-row loops.

The conversions a forward pass needs are here; the rest lives in its public module:
``nopad.layout`` (the index plan), ``nopad.ops`` (flash-attn's padding primitives),
``nopad.rows`` / ``nopad.balance`` (rows of nested batches, micro-batches),
``nopad.engines.fsdp`` / ``nopad.engines.megatron`` / ``nopad.engines.leak``, ``nopad.parallel``,
``nopad.attention``, ``nopad.layers``, ``nopad.logprobs``, ``nopad.losses``, ``nopad.packing``,
``nopad.integrations.verl``, ``nopad.diagnostics`` and ``nopad.synthetic`` (docs/concepts.md: the
rooms). ``import nopad`` loads neither transformers nor verl.
"""

from nopad.diagnostics import OpCounter
from nopad.layout import IndexPlan
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
    "OpCounter",
    "build_attention_mask_from_nested",
    "embeds_padding_2_no_padding",
    "left_right_2_no_padding",
    "no_padding_2_padding",
    "plan_left_right",
    "response_from_nested",
    "response_to_nested",
]
