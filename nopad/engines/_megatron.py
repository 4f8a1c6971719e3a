"""Megatron-core adapter: nested batches <-> one CP-sharded THD row plus ``PackedSeqParams``.

Forward::

    tokens, params, position_ids = preprocess_thd(input_ids, cp_size=2, cp_rank=r)   # (1, T/2) each
    output = model(tokens, position_ids, packed_seq_params=params)                   # (1, T/2, *)
    nested = postprocess_thd(output, params, input_ids, cp_size=2, cp_rank=r)        # (B, j, *)

Companion per-token tensors (labels, loss masks, MoE routed_experts) go through the SAME plan::

    plan = ThdPlan.from_nested(input_ids, cp_size=2, cp_rank=r)
    labels = plan.shard(input_ids, need_roll=True)
    loss_mask = plan.shard(loss_mask_nested)
    experts = plan.shard_routed_experts(routed_experts_nested, num_experts=64)

One plan = one host read (the batch's offsets, in one copy; none for a plan made from host lengths,
see :meth:`ThdPlan.from_lengths`); every shard and the way back are a fixed number of
tensor ops whatever the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from nopad.core._errors import check_flag, free_to_read, input_error
from nopad.core._layout import check_nested, is_nested, jagged_values, nested_offsets, wrap_jagged
from nopad.core._torch_internals import cached_seqlens
from nopad.modeling._logprobs import checked_head
from nopad.parallel._cp import CpLayout, check_cp_args, check_padded_boundaries, gather_cp_flat, real_tokens_index
from nopad.parallel._thd import ThdPlan, thd_sizes


# ---- the adapter ---------------------------------------------------------------------------------
def preprocess_thd(
    input_ids_nested: Tensor,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_layout: CpLayout = "zigzag",
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    pad_to_length_bucket: int | None = None,
) -> tuple[Tensor, Any, Tensor]:
    """Nested (B, j, *) -> ``(tokens (1, T/cp, *), packed_seq_params, position_ids (1, T/cp))``. ONE host sync.

    Each sequence is padded to a multiple of tp*cp*2 (zigzag, cp > 1), tp*cp (contiguous) or tp
    (cp == 1); ``use_fp8_padding`` rounds each to lcm(16, that) and the total to that*128;
    ``pad_to_length_bucket`` rounds the total to a multiple of the bucket. All tail padding is
    folded into the last segment. ``cu_seqlens`` are int32, global (not per rank), padded; the
    same tensor is used for q and kv. Padding slots hold 0 and position 0.

    ``need_roll`` returns next-token labels instead of tokens: the roll happens within each
    sequence before sharding, so a label at a shard edge is the true next token. The label slot of a
    sequence's LAST token holds 0, like padding (no next token exists; mask it out of any loss).
    ``position_ids`` are the slot's own positions either way.
    ``need_roll`` and ``use_fp8_padding`` are real bools (a string "false" is refused, not truthy).
    """
    need_roll = check_flag(need_roll, "need_roll")
    use_fp8_padding = check_flag(use_fp8_padding, "use_fp8_padding")
    sizes = thd_sizes(tp_size, cp_size, cp_rank, cp_layout, use_fp8_padding, pad_to_length_bucket)
    plan = ThdPlan.from_nested(input_ids_nested, sizes=sizes)
    return plan.shard(input_ids_nested, need_roll=need_roll), plan.packed_seq_params(), plan.position_ids


CU_FIELD = "packed_seq_params.cu_seqlens_q_padded"


def postprocess_thd(
    output: Tensor,
    packed_seq_params: Any,
    input_ids_nested: Tensor,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_group=None,
    cp_layout: CpLayout | None = None,
    plan: ThdPlan | None = None,
) -> Tensor:
    """This rank's (1, T/cp, *) output -> nested (B, j, *) over the whole batch. No host sync.

    All-gathers the CP shards over ``cp_group`` (default: the world group), keeping this rank's
    autograd graph (other shards arrive detached), undoes the layout and drops alignment padding.
    The result shares ``input_ids_nested``'s offsets, so it lines up with every other nested field.
    ``plan`` (the :class:`ThdPlan` that sharded the batch) supplies cp_size, cp_rank and the layout;
    without it, ``cp_layout`` defaults to the one recorded in ``packed_seq_params``
    (``cp_partition_mode``, which :meth:`ThdPlan.packed_seq_params` sets), else zigzag.

    The plan, the params and the batch must belong together. Checked on the host where free: the
    plan's batch size, token total and slots per rank; the batch's offsets being the plan's own
    (identity) or, on the CPU, equal to its lengths; the params' padded boundaries being the plan's
    (identity) or, on the CPU, equal to them, and without a plan, holding every sequence and ending
    at cp_size times the output's slots. Boundaries on a device that are other tensors are not read
    (a host sync): a batch, params or output of another batch there give a wrong result or an
    out-of-range index.
    """
    if plan is not None and not isinstance(plan, ThdPlan):
        raise input_error("plan", None, "the ThdPlan that sharded the batch, or None", type(plan).__name__)
    if not isinstance(output, Tensor) or is_nested(output):
        got = "a nested tensor" if is_nested(output) else type(output).__name__
        raise input_error("output", None, "the model's dense (1, T/cp, ...) output", got)
    if plan is not None:
        cp_size, cp_rank, cp_layout = plan.cp_size, plan.cp_rank, plan.cp_layout
    layout: CpLayout = cp_layout or getattr(packed_seq_params, "cp_partition_mode", None) or "zigzag"
    _, cp_size, cp_rank, layout = check_cp_args(1, cp_size, cp_rank, layout)
    check_nested(input_ids_nested, "input_ids")
    offsets = nested_offsets(input_ids_nested)
    batch = offsets.shape[0] - 1
    cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if cu is None:
        cu = getattr(packed_seq_params, "cu_seqlens_q", None)
    if not isinstance(cu, Tensor):
        got = type(packed_seq_params).__name__ if cu is None else f"cu_seqlens_q_padded of type {type(cu).__name__}"
        raise input_error("packed_seq_params", None, "the PackedSeqParams of preprocess_thd (padded cu_seqlens)", got)
    if cu.dim() != 1 or cu.shape[0] != batch + 1:
        raise input_error(CU_FIELD, None, f"shape ({batch + 1},)", f"{tuple(cu.shape)}")
    if output.dim() < 2 or output.shape[0] != 1:
        raise input_error("output", None, "shape (1, T/cp, ...)", f"{tuple(output.shape)}")
    local_len = output.shape[1]
    total = jagged_values(input_ids_nested).shape[0]
    if plan is not None:
        _check_plan(plan, cu, input_ids_nested, batch, total, local_len)
    elif free_to_read(cu, offsets):
        words = {"slots": "the output's slots", "hint": " (the params of another batch?)"}
        check_padded_boundaries(cu, offsets.diff(), local_len, cp_size, layout, field=CU_FIELD, **words)
    gathered = gather_cp_flat(output[0], cp_size, cp_rank, cp_group)
    if plan is not None:
        index = plan.unshard_index()  # the plan's own inverse, computed once
    else:
        index = real_tokens_index(cu, offsets.diff(), total, local_len, cp_size, layout)
    values = gathered.index_select(0, index)
    return wrap_jagged(values, offsets, **_seqlens(input_ids_nested))


def _check_plan(plan: ThdPlan, cu: Tensor, input_ids: Tensor, batch: int, total: int, local_len: int) -> None:
    """The plan is this batch's and this output's: host facts, then boundaries where free."""
    if (plan.batch_size, plan.total, plan.local_len) != (batch, total, local_len):
        expected = f"the ThdPlan of this batch and output: {batch} sequences, {total} tokens, {local_len} slots"
        got = f"{plan.batch_size} sequences, {plan.total} tokens, {plan.local_len} slots"
        raise input_error("plan", None, expected, got)
    plan.check_boundaries(input_ids, "input_ids")
    if cu is plan.cu_seqlens_padded or not free_to_read(cu):
        return
    theirs = cu.numpy().astype(np.int64)
    if not np.array_equal(theirs, plan.host_cu_seqlens):
        expected = f"the plan's padded boundaries {plan.host_cu_seqlens.tolist()[:9]}"
        raise input_error(CU_FIELD, None, expected, f"{theirs.tolist()[:9]}")


# ---- the output head -------------------------------------------------------------------------------
def thd_logprobs(
    hidden: Tensor,
    weight: Tensor,
    input_ids_nested: Tensor,
    plan: ThdPlan,
    packed_seq_params: Any,
    *,
    bias: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    calculate_entropy: bool = False,
    tp_group: Any = None,
    sequence_parallel: bool = False,
    cp_group: Any = None,
    chunk_size: int | None = None,
) -> dict[str, Tensor]:
    """A Megatron model's last hidden states and output layer -> {"log_probs": nested (B, j),
    "entropy": nested (B, j) if asked}, never the (T, V / tp) logits. No host sync.

    ``hidden``: this rank's output of the model's decoder (``post_process=False``, or the input of its
    ``output_layer``), Megatron's [s, b, h] layout with b = 1, ``(local_len, 1, H)`` (``(local_len / tp,
    1, H)`` under ``sequence_parallel``), for the THD row that ``plan`` (the :class:`ThdPlan` of
    :func:`preprocess_thd`) sharded over context parallelism. ``weight`` (and ``bias``): the
    ColumnParallelLinear ``output_layer.weight`` (``bias``), this rank's (V / tp, H) vocabulary shard
    of ``tp_group`` (the whole (V, H) without one), or the shared embedding of a tied model. The labels
    are the batch's next tokens, sharded by the same plan (``plan.shard(input_ids, need_roll=True)``);
    ``temperature`` a float or a per-sequence (B,) tensor.

    The head runs on the rank's slots through :func:`nopad.modeling.head_log_probs` (vocabulary-parallel
    over ``tp_group``: two all-reduces of O(T) floats per call, the gradient of hidden summed over the
    ranks as the column-parallel layer hands it back), and the results come back through
    :func:`postprocess_thd` (gathered over ``cp_group``, the way back of the plan, padding dropped), on
    the batch's offsets: ``no_padding_2_padding`` reads the response log-probs from them. A sequence's
    last token gets log-prob 0 (its label belongs to no sequence). Equal to megatron-core's
    ``vocab_parallel_cross_entropy`` on the full logits.
    """
    if not isinstance(plan, ThdPlan):
        raise input_error("plan", None, "the ThdPlan that sharded the batch", type(plan).__name__)
    calculate_entropy = check_flag(calculate_entropy, "calculate_entropy")
    sequence_parallel = check_flag(sequence_parallel, "sequence_parallel")
    if not isinstance(hidden, Tensor) or hidden.dim() != 3 or hidden.shape[1] != 1:
        got = f"shape {tuple(hidden.shape)}" if isinstance(hidden, Tensor) else type(hidden).__name__
        raise input_error("hidden", None, "Megatron's (local_len, 1, hidden) decoder output of one THD row", got)
    labels = plan.shard(input_ids_nested, need_roll=True)[0]
    log_probs, entropy = checked_head(
        hidden[:, 0],
        weight,
        labels,
        temperature,
        calculate_entropy,
        chunk_size,
        bias=bias,
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
        per_row=(plan.batch_size, plan.segment),
    )
    per_slot = log_probs if entropy is None else torch.stack([log_probs, entropy], -1)
    nested = postprocess_thd(per_slot.unsqueeze(0), packed_seq_params, input_ids_nested, plan=plan, cp_group=cp_group)
    values = jagged_values(nested)
    last = plan.plan.last_token_mask.to(values.device)
    lp = values if entropy is None else values[:, 0]
    out = {"log_probs": wrap_jagged(torch.where(last, 0.0, lp), nested_offsets(nested), **_seqlens(nested))}
    if entropy is not None:
        out["entropy"] = wrap_jagged(values[:, 1], nested_offsets(nested), **_seqlens(nested))
    return out


def _seqlens(nested: Tensor) -> dict[str, Any]:
    low, high = cached_seqlens(nested)
    return {"min_seqlen": low, "max_seqlen": high}


# ---- megatron-core parallel state ----------------------------------------------------------------
@dataclass(frozen=True)
class ParallelDims:
    """Tensor/context-parallel sizes and rank, as :func:`preprocess_thd`/:func:`postprocess_thd` take them."""

    tp_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Any = None

    def preprocess_kwargs(self) -> dict[str, int]:
        return {"tp_size": self.tp_size, "cp_size": self.cp_size, "cp_rank": self.cp_rank}

    def postprocess_kwargs(self) -> dict[str, Any]:
        return {"cp_size": self.cp_size, "cp_rank": self.cp_rank, "cp_group": self.cp_group}


def from_parallel_state() -> ParallelDims:
    """Read tp/cp size, cp rank and cp group from megatron-core's ``parallel_state``.

    Raises ImportError without megatron-core and ValueError when its model parallel groups are
    not initialised (call ``parallel_state.initialize_model_parallel`` first).
    """
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        raise input_error("parallel_state", None, "megatron-core model parallel groups to be initialised", "none")
    return ParallelDims(
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        cp_size=mpu.get_context_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(),
        cp_group=mpu.get_context_parallel_group(),
    )
