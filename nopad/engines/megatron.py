"""Megatron-core adapter: nested batches <-> one CP-sharded THD row plus ``PackedSeqParams``.

Forward::

    tokens, params, position_ids = preprocess_thd(input_ids, cp_size=2, cp_rank=r)   # (1, T/2) each
    output = model(tokens, position_ids, packed_seq_params=params)                   # (1, T/2, *)
    nested = postprocess_thd(output, params, input_ids, cp_size=2, cp_rank=r)        # (B, j, *)

Companion per-token tensors (labels, loss masks, MoE routed_experts) go through the SAME plan::

    plan = thd_plan(input_ids, cp_size=2, cp_rank=r)
    labels = plan.shard(input_ids, need_roll=True)
    loss_mask = plan.shard(loss_mask_nested)
    experts = plan.shard_routed_experts(routed_experts_nested, num_experts=64)

One plan = one host sync (the padded total and the longest padded segment, fetched together);
every shard and the way back are a fixed number of tensor ops whatever the batch size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nopad.layout import is_nested, nested_offsets, prepare_offsets, ragged_dim, to_host
from nopad.parallel import (
    CpLayout,
    check_cp_args,
    cp_alignment,
    fp8_alignment,
    gather_cp_shards,
    prepare_padded_lengths,
    shard_index,
    unshard_index,
)


@dataclass
class FallbackPackedSeqParams:
    """Same field names as megatron-core 0.16's PackedSeqParams, for installs without it."""

    qkv_format: str | None = None
    cu_seqlens_q: Tensor | None = None
    cu_seqlens_kv: Tensor | None = None
    cu_seqlens_q_padded: Tensor | None = None
    cu_seqlens_kv_padded: Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    local_cp_size: int | None = None
    cp_group: Any = None


def _has_field(params: Any, name: str) -> bool:
    """Whether megatron-core's own PackedSeqParams knows ``name`` (our fallback is never warned about)."""
    if not type(params).__module__.startswith("megatron"):
        return True
    return name in getattr(type(params), "__dataclass_fields__", {})


@functools.cache
def packed_seq_params_class() -> type:
    """megatron-core's ``PackedSeqParams`` when it is installed, else :class:`FallbackPackedSeqParams`."""
    try:
        with warnings.catch_warnings():  # megatron-core announces missing TransformerEngine/Apex on import
            warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
            from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError:
        return FallbackPackedSeqParams
    return PackedSeqParams


# ---- the plan ------------------------------------------------------------------------------------
class ThdPlan:
    """Where every real token of a batch sits in this CP rank's share of the padded THD buffer.

    Attributes:
        lengths: (B,) int64 real tokens per sequence.
        source_offsets: (B,) int64 where each sequence starts in the (source_len, *) values it is read from.
        total: int, real tokens; ``total_padded``: int, T, the global padded buffer length.
        source_len: int, tokens in the values it shards (``total`` unless built with source offsets).
        cu_seqlens_padded: (B+1,) int32 global padded boundaries, ending at T.
        max_seqlen: int, the longest padded segment.
        local_len: int, T / cp_size, the slots this rank holds.
        global_index: (local_len,) int64 global padded slot of each local slot.
    """

    def __init__(
        self,
        lengths: Tensor,
        source_offsets: Tensor,
        padded_lengths: Tensor,
        *,
        total: int,
        total_padded: int,
        max_seqlen: int,
        source_len: int,
        tp_size: int,
        cp_size: int,
        cp_rank: int,
        cp_layout: CpLayout,
        align: int,
    ):
        self.lengths, self.source_offsets = lengths, source_offsets
        self.padded_lengths = padded_lengths
        self.total, self.total_padded, self.max_seqlen = total, total_padded, max_seqlen
        self.source_len = source_len
        self.tp_size, self.cp_size, self.cp_rank, self.cp_layout = tp_size, cp_size, cp_rank, cp_layout
        self.align = align
        self.cu_seqlens_padded = prepare_offsets(padded_lengths).to(torch.int32)
        self.local_len = total_padded // cp_size
        self.global_index = shard_index(self.cu_seqlens_padded, self.local_len, cp_size, cp_rank, cp_layout)
        cu = self.cu_seqlens_padded.to(torch.int64)
        self._segment = torch.searchsorted(cu, self.global_index, right=True) - 1  # contiguous shards cut segments
        self._offset = self.global_index - cu[self._segment]  # slot's position inside its padded segment
        self._real = self._offset < lengths[self._segment]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def position_ids(self) -> Tensor:
        """(1, local_len) int64: position of each slot's token in its own sequence; 0 on padding slots."""
        return torch.where(self._real, self._offset, 0).unsqueeze(0)

    @property
    def padding_mask(self) -> Tensor:
        """(1, local_len) bool: True on alignment padding slots."""
        return (~self._real).unsqueeze(0)

    def source_index(self, need_roll: bool = False) -> Tensor:
        """(local_len,) row of the (source_len, *) values each local slot reads (0 on padding slots).

        ``need_roll`` reads the NEXT token of the same sequence; the last real token of a sequence
        reads the sequence's FIRST token (a roll within the sequence, as verl's need_roll does).
        """
        offset = self._offset
        if need_roll:
            offset = (offset + 1) % self.lengths[self._segment]
        src = self.source_offsets[self._segment] + offset
        return torch.where(self._real, src, 0)

    def shard(self, values: Tensor, *, need_roll: bool = False, pad_value: float | int = 0) -> Tensor:
        """Per-token (total, *) values or nested (B, j, *) -> this rank's (1, local_len, *) THD shard.

        Padding slots hold ``pad_value``; ``need_roll`` gives next-token labels (see :meth:`source_index`).
        Autograd flows back to ``values``. No sync.
        """
        flat = self._values(values)
        out = flat.index_select(0, self.source_index(need_roll))
        real = self._real.view(-1, *([1] * (flat.dim() - 1)))
        return torch.where(real, out, torch.as_tensor(pad_value, dtype=out.dtype, device=out.device)).unsqueeze(0)

    def shard_routed_experts(self, routed_experts: Tensor, num_experts: int) -> Tensor:
        """(total, *, topk) or nested (B, j, *, topk) expert ids -> (1, local_len, *, topk) shard.

        Alignment slots get distinct experts spread round-robin over ``num_experts`` (slot g, pick k
        -> (g * topk + k) % num_experts), so replaying the router does not pile padding on expert 0.
        """
        flat = self._values(routed_experts)
        if flat.dim() < 2:
            raise ValueError(f"routed_experts: expected (total, ..., topk), got shape {tuple(flat.shape)}")
        topk = flat.shape[-1]
        if not 0 < topk <= num_experts:
            raise ValueError(f"num_experts: expected >= topk {topk} (distinct experts per slot), got {num_experts}")
        out = flat.index_select(0, self.source_index())
        pick = torch.arange(topk, device=out.device)
        spread = (self.global_index.view(-1, *([1] * (out.dim() - 1))) * topk + pick) % num_experts
        real = self._real.view(-1, *([1] * (out.dim() - 1)))
        return torch.where(real, out, spread.to(out.dtype)).unsqueeze(0)

    def packed_seq_params(self) -> Any:
        """``PackedSeqParams(qkv_format="thd")`` with the GLOBAL padded cu_seqlens for q and kv.

        Megatron's own pretraining passes padded boundaries as cu_seqlens_q/kv too. The layout is
        also recorded as ``cp_partition_mode`` (a field in newer megatron-core; megatron-core 0.16.1
        has none and its TransformerEngine CP attention assumes zigzag).
        """
        cu = self.cu_seqlens_padded
        params = packed_seq_params_class()(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )
        params.cp_partition_mode = self.cp_layout
        if self.cp_layout == "contiguous" and self.cp_size > 1 and not _has_field(params, "cp_partition_mode"):
            warnings.warn(
                "cp_layout='contiguous' with a PackedSeqParams that has no cp_partition_mode field: "
                "this megatron-core's TransformerEngine CP attention assumes the zigzag layout and will "
                "attend across the wrong chunks; use cp_layout='zigzag' with it",
                stacklevel=2,
            )
        return params

    def _values(self, x: Tensor) -> Tensor:
        if is_nested(x):
            if ragged_dim(x) != 1:
                raise ValueError(f"tensor: expected the ragged dim at 1 (B, j, *), got it at {ragged_dim(x)}")
            x = x.values()
        if x.dim() < 1 or x.shape[0] != self.source_len:
            raise ValueError(f"tensor: expected {self.source_len} tokens on dim 0, got shape {tuple(x.shape)}")
        return x

    def __repr__(self) -> str:
        return (
            f"ThdPlan(batch={self.batch_size}, total={self.total}, padded={self.total_padded}, "
            f"cp={self.cp_rank}/{self.cp_size} {self.cp_layout}, align={self.align})"
        )


def build_thd_plan(
    lengths: Tensor,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_layout: CpLayout = "zigzag",
    use_fp8_padding: bool = False,
    pad_to_length_bucket: int | None = None,
    source_offsets: Tensor | None = None,
    source_len: int | None = None,
    field: str = "lengths",
) -> ThdPlan:
    """Plan this CP rank's THD shard from (B,) sequence lengths. ONE host sync.

    ``source_offsets`` (B,) says where each sequence starts in the flat values of ``source_len``
    tokens later passed to :meth:`ThdPlan.shard` (default: back to back, ``cumsum(lengths)``), so
    offline packed rows (N, L) with row padding can be sharded from ``rows.flatten()`` directly.
    Raises ValueError naming the field and row for an empty sequence or one that runs past the
    source, and for out-of-range sizes, rank, layout or bucket.
    """
    check_cp_args(tp_size, cp_size, cp_rank, cp_layout)
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.shape[0] == 0 or lengths.dtype.is_floating_point:
        got = f"{lengths.dtype} of shape {tuple(lengths.shape)}"
        raise ValueError(f"{field}: expected a non-empty 1-D integer tensor, got {got}")
    if pad_to_length_bucket is not None and (not isinstance(pad_to_length_bucket, int) or pad_to_length_bucket <= 0):
        raise ValueError(f"pad_to_length_bucket: expected a positive int or None, got {pad_to_length_bucket!r}")
    lengths = lengths.to(torch.int64)
    align = cp_alignment(tp_size, cp_size, cp_layout)
    total_multiple = align
    if use_fp8_padding:
        align, fp8_total = fp8_alignment(align)
        total_multiple = math.lcm(align, fp8_total)
    if pad_to_length_bucket is not None:
        total_multiple = math.lcm(total_multiple, pad_to_length_bucket)
    padded = prepare_padded_lengths(lengths, align, total_multiple)
    if source_offsets is None:
        source_offsets = prepare_offsets(lengths)[:-1]
    source_offsets = torch.as_tensor(source_offsets, device=lengths.device).to(torch.int64)
    if source_offsets.shape != lengths.shape:
        raise ValueError(f"source_offsets: expected shape {tuple(lengths.shape)}, got {tuple(source_offsets.shape)}")
    ends = source_offsets + lengths
    total, total_padded, max_seqlen, min_len, first, last_end = to_host(
        lengths.sum(), padded.sum(), padded.max(), lengths.min(), source_offsets.min(), ends.max()
    )
    if min_len < 1:
        row = int((lengths < 1).nonzero()[0])
        raise ValueError(f"{field} row {row}: expected a sequence of >= 1 token, got length {int(lengths[row])}")
    source_len = total if source_len is None else source_len
    if first < 0 or last_end > source_len:
        row = int(((source_offsets < 0) | (ends > source_len)).nonzero()[0])
        raise ValueError(
            f"source_offsets row {row}: expected a sequence inside the {source_len} source tokens, "
            f"got start {int(source_offsets[row])} length {int(lengths[row])}"
        )
    return ThdPlan(
        lengths,
        source_offsets,
        padded,
        total=total,
        total_padded=total_padded,
        max_seqlen=max_seqlen,
        source_len=source_len,
        tp_size=tp_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_layout=cp_layout,
        align=align,
    )


def thd_plan(
    input_ids_nested: Tensor,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_layout: CpLayout = "zigzag",
    use_fp8_padding: bool = False,
    pad_to_length_bucket: int | None = None,
) -> ThdPlan:
    """:func:`build_thd_plan` from a jagged nested (B, j, *) tensor's offsets. ONE host sync.

    Shard the batch's companions (labels, loss masks, routed experts) with the returned plan.
    """
    _check_nested(input_ids_nested, "input_ids")
    return build_thd_plan(
        nested_offsets(input_ids_nested).diff(),
        tp_size=tp_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_layout=cp_layout,
        use_fp8_padding=use_fp8_padding,
        pad_to_length_bucket=pad_to_length_bucket,
        field="input_ids",
    )


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
    sequence before sharding, so a label at a shard edge is the true next token. The label of a
    sequence's LAST token is its first token (no next token exists; mask it out of any loss).
    ``position_ids`` are the slot's own positions either way.
    """
    plan = thd_plan(
        input_ids_nested,
        tp_size=tp_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_layout=cp_layout,
        use_fp8_padding=use_fp8_padding,
        pad_to_length_bucket=pad_to_length_bucket,
    )
    return plan.shard(input_ids_nested, need_roll=need_roll), plan.packed_seq_params(), plan.position_ids


def postprocess_thd(
    output: Tensor,
    packed_seq_params: Any,
    input_ids_nested: Tensor,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_group=None,
    cp_layout: CpLayout = "zigzag",
) -> Tensor:
    """This rank's (1, T/cp, *) output -> nested (B, j, *) over the whole batch. No host sync.

    All-gathers the CP shards over ``cp_group`` (default: the world group), keeping this rank's
    autograd graph (other shards arrive detached), undoes the layout and drops alignment padding.
    The result shares ``input_ids_nested``'s offsets, so it lines up with every other nested field.
    """
    check_cp_args(1, cp_size, cp_rank, cp_layout)
    _check_nested(input_ids_nested, "input_ids")
    offsets = nested_offsets(input_ids_nested)
    batch = offsets.shape[0] - 1
    cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    if cu.dim() != 1 or cu.shape[0] != batch + 1:
        raise ValueError(f"packed_seq_params.cu_seqlens_q_padded: expected shape ({batch + 1},), got {tuple(cu.shape)}")
    if output.dim() < 2 or output.shape[0] != 1:
        raise ValueError(f"output: expected shape (1, T/cp, ...), got {tuple(output.shape)}")
    local_len = output.shape[1]
    gathered = gather_cp_shards(output[0], cp_size, cp_rank, cp_group).flatten(0, 1)
    total = input_ids_nested.values().shape[0]
    index = unshard_index(cu, offsets.diff(), total, local_len, cp_size, cp_layout)
    values = gathered.index_select(0, index)
    return torch.nested.nested_tensor_from_jagged(
        values,
        offsets,
        min_seqlen=getattr(input_ids_nested, "_maybe_min_seqlen", None),
        max_seqlen=getattr(input_ids_nested, "_maybe_max_seqlen", None),
    )


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

    def replace(self, **changes) -> ParallelDims:
        return dataclasses.replace(self, **changes)


def from_parallel_state() -> ParallelDims:
    """Read tp/cp size, cp rank and cp group from megatron-core's ``parallel_state``.

    Raises ImportError without megatron-core and ValueError when its model parallel groups are
    not initialised (call ``parallel_state.initialize_model_parallel`` first).
    """
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        raise ValueError("parallel_state: expected megatron-core model parallel groups to be initialised, they are not")
    return ParallelDims(
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        cp_size=mpu.get_context_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(),
        cp_group=mpu.get_context_parallel_group(),
    )


def _check_nested(x: Tensor, field: str) -> None:
    if not is_nested(x):
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{field}: expected a jagged nested tensor (B, j, ...), got a dense tensor of shape {shape}")
    if x.layout != torch.jagged:
        raise ValueError(f"{field}: expected layout=torch.jagged, got {x.layout}")
    if ragged_dim(x) != 1:
        raise ValueError(f"{field}: expected the ragged dim at 1 (B, j, ...), got it at {ragged_dim(x)}")
