"""The index plan: where each real token of a batch lives in the padded, nested and packed layouts.

A plan is built once per batch (from a mask, lengths, offsets, runs, a nested tensor or packed
position ids) and then moves every per-token field with the same gather or scatter. The
``prepare_*`` helpers are its one derivation of offsets, positions and row ids from lengths.
"""

from nopad._layout import IndexPlan, prepare_offsets, prepare_position_ids, prepare_row_ids

__all__ = ["IndexPlan", "prepare_offsets", "prepare_position_ids", "prepare_row_ids"]
