"""The meeting point: packed rows (online or offline) -> the THD batch the Megatron adapter consumes.

Both packers produce the same TensorDict (collate.py's fields). Its conversation segments,
already padded to the alignment, become a nested batch that goes through the Megatron adapter's
own plan (nopad.parallel._thd), so the CP sharding is the adapter's, never re-derived here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict
from torch import Tensor

from nopad.packing._collate import packed_to_nested
from nopad.packing._rows import TOKEN_FIELDS
from nopad.parallel._cp import CpLayout
from nopad.parallel._thd import ThdPlan, thd_sizes


@dataclass
class ThdBatch:
    """This CP rank's share of a packed batch, as one THD row.

    tokens, labels, loss_mask, position_ids: (1, T/cp) int64, T the global padded length;
    packed_seq_params: megatron-core ``PackedSeqParams(qkv_format="thd")`` with global int32 cu_seqlens;
    input_ids: nested (S, j) segments, what ``postprocess_thd`` needs to bring outputs back.
    """

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    position_ids: Tensor
    packed_seq_params: Any
    input_ids: Tensor


def packed_to_thd(
    batch: TensorDict, *, tp_size: int = 1, cp_size: int = 1, cp_rank: int = 0, cp_layout: CpLayout = "zigzag"
) -> ThdBatch:
    """Collated packed rows (N, L) -> this rank's :class:`ThdBatch`, every row's conversations in order.

    The rows' segments must already honour the run's alignment (2*cp*tp for zigzag): a file packed
    for another CP size is refused with a ValueError rather than silently re-padded. Labels, mask
    and positions are the rows' own (target_ids, token_mask, position_ids), sharded by the same plan
    as the tokens. Two host syncs (the rows' boundaries, then the adapter's plan), whatever N.
    """
    sizes = thd_sizes(tp_size, cp_size, cp_rank, cp_layout)  # the settings' one check, before the rows
    context = f" (tp={sizes.tp_size}, cp={sizes.cp_size}, {sizes.cp_layout})"
    nested = packed_to_nested(batch, TOKEN_FIELDS, alignment=sizes.alignment, context=context)
    plan = ThdPlan.from_nested(nested["input_ids"], sizes=sizes)
    return ThdBatch(
        tokens=plan.shard(nested["input_ids"]),
        labels=plan.shard(nested["target_ids"]),
        loss_mask=plan.shard(nested["token_mask"]),
        position_ids=plan.shard(nested["position_ids"]),
        packed_seq_params=plan.packed_seq_params(),
        input_ids=nested["input_ids"],
    )
