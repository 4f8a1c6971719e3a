"""nopad: padded <-> nested <-> packed LLM training batches, exact and without per-row loops.

The conversions a forward pass needs are here; the rest lives in its room, one folder each
(docs/architecture.md): ``nopad.core``, ``nopad.batches``, ``nopad.parallel``, ``nopad.modeling``,
``nopad.engines``, ``nopad.losses``, ``nopad.packing``, ``nopad.integrations.verl``; and
``nopad.diagnostics``, ``nopad.synthetic``. ``import nopad`` loads neither transformers nor verl.
"""

from nopad.batches import (
    build_attention_mask_from_nested,
    embeds_padding_2_no_padding,
    left_right_2_no_padding,
    no_padding_2_padding,
    plan_left_right,
    response_from_nested,
    response_to_nested,
)
from nopad.core import IndexPlan
from nopad.diagnostics import OpCounter

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
