"""The core, below every other room: :class:`IndexPlan`, where each real token of a batch lives in the
padded, nested and packed layouts (built once per batch, it moves every per-token field with the same
gather or scatter; ``prepare_*`` derive offsets, positions and row ids from lengths), and flash-attn's
``bert_padding`` primitives without flash-attn. Beside them, privately: the one error format and the
checks, the identity memo, the kernel probe, torch's internals."""

from nopad.core._layout import IndexPlan, prepare_offsets, prepare_position_ids, prepare_row_ids
from nopad.core._ops import index_first_axis, index_put_first_axis, pad_input, unpad_input

__all__ = [
    "IndexPlan",
    "index_first_axis",
    "index_put_first_axis",
    "pad_input",
    "prepare_offsets",
    "prepare_position_ids",
    "prepare_row_ids",
    "unpad_input",
]
