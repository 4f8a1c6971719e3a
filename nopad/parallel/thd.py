"""The THD plan: where every real token of a packed batch sits in one CP rank's share of the padded buffer.

One plan = one host sync (the padded total and the longest padded segment, fetched together);
every shard is a fixed number of tensor ops whatever the batch size. The Megatron adapter
(:mod:`nopad.engines.megatron`) and the packers (:mod:`nopad.packing.thd`) both shard through it,
so the CP layout has one derivation. ``PackedSeqParams`` is megatron-core's when it is installed,
else a stand-in with the same fields.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nopad.compat import renamed_attribute, renamed_keyword
from nopad.errors import input_error
from nopad.layout import IndexPlan, check_nested, is_nested, nested_offsets, prepare_offsets, prepare_row_ids, to_host
from nopad.parallel.cp import (
    CpLayout,
    check_cp_args,
    cp_alignment,
    fp8_alignment,
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
        source_starts: (B,) int64 where each sequence starts in the (source_len, *) values it is read from.
        total: int, real tokens; ``padded_total``: int, T, the global padded buffer length.
        source_len: int, tokens in the values it shards (``total`` unless built with source offsets).
        cu_seqlens_padded: (B+1,) int32 global padded boundaries, ending at T.
        padded_lengths: (B,) int64 each sequence's padded segment (tail padding folded into the last).
        padded_max_seqlen: int, the longest padded segment (``max_seqlen_q/kv`` of PackedSeqParams).
        alignment: int, the multiple every padded segment is.
        plan: the :class:`~nopad.layout.IndexPlan` of the real tokens (row ids, positions, labels).
        local_len: int, T / cp_size, the slots this rank holds.
        global_index: (local_len,) int64 global padded slot of each local slot.
        segment: (local_len,) int64 the sequence each local slot belongs to.
        offset_in_segment: (local_len,) int64 each local slot's position inside its padded segment.
    """

    def __init__(
        self,
        lengths: Tensor,
        source_starts: Tensor,
        padded_lengths: Tensor,
        *,
        total: int,
        padded_total: int,
        padded_max_seqlen: int,
        source_len: int,
        tp_size: int,
        cp_size: int,
        cp_rank: int,
        cp_layout: CpLayout,
        alignment: int,
    ):
        self.lengths, self.source_starts = lengths, source_starts
        self.padded_lengths = padded_lengths
        self.total, self.padded_total, self.padded_max_seqlen = total, padded_total, padded_max_seqlen
        self.plan = IndexPlan.from_lengths(lengths, width=padded_max_seqlen, total=total)
        self.source_len = source_len
        self.tp_size, self.cp_size, self.cp_rank, self.cp_layout = tp_size, cp_size, cp_rank, cp_layout
        self.alignment = alignment
        self.cu_seqlens_padded = prepare_offsets(padded_lengths).to(torch.int32)
        self.local_len = padded_total // cp_size
        self.global_index = shard_index(self.cu_seqlens_padded, self.local_len, cp_size, cp_rank, cp_layout)
        cu = self.cu_seqlens_padded.to(torch.int64)
        # the segment of every local slot: layout's one token -> sequence derivation, over the padded buffer
        self.segment = prepare_row_ids(padded_lengths, padded_total).index_select(0, self.global_index)
        self.offset_in_segment = self.global_index - cu[self.segment]  # slot's position inside its padded segment
        self._real = self.offset_in_segment < lengths[self.segment]
        self._last = self.offset_in_segment == lengths[self.segment] - 1  # the last real token of its sequence
        self._unshard_index: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def position_ids(self) -> Tensor:
        """(1, local_len) int64: position of each slot's token in its own sequence; 0 on padding slots."""
        return torch.where(self._real, self.offset_in_segment, 0).unsqueeze(0)

    @property
    def padding_mask(self) -> Tensor:
        """(1, local_len) bool: True on alignment padding slots."""
        return (~self._real).unsqueeze(0)

    def source_index(self, need_roll: bool = False) -> Tensor:
        """(local_len,) row of the (source_len, *) values each local slot reads (0 on padding slots).

        ``need_roll`` reads the NEXT token of the same sequence; the last real token of a sequence
        has none and, like padding, reads 0 (:meth:`shard` puts ``pad_value`` there: nopad's one
        convention for the label slot no loss trains on).
        """
        src = self.source_starts[self.segment] + self.offset_in_segment + int(need_roll)
        return torch.where(self._reads(need_roll), src, 0)

    def _reads(self, need_roll: bool) -> Tensor:
        """(local_len,) True where a slot reads a real value: a real token (and, with need_roll, not a last one)."""
        return self._real & ~self._last if need_roll else self._real

    def shard(self, values: Tensor, *, need_roll: bool = False, pad_value: float | int = 0) -> Tensor:
        """Per-token (total, *) values or nested (B, j, *) -> this rank's (1, local_len, *) THD shard.

        Padding slots hold ``pad_value``; ``need_roll`` gives next-token labels, with ``pad_value`` at
        each sequence's last token (nopad's one convention for the label slot no loss trains on).
        Autograd flows back to ``values``. No sync.
        """
        flat = self._values(values)
        out = flat.index_select(0, self.source_index(need_roll))
        real = self._reads(need_roll).view(-1, *([1] * (flat.dim() - 1)))
        return torch.where(real, out, torch.as_tensor(pad_value, dtype=out.dtype, device=out.device)).unsqueeze(0)

    def unshard_index(self) -> Tensor:
        """(total,) where each real token sits in the rank-major gathered buffer (cp_size * local_len):
        the way back for :func:`~nopad.engines.megatron.postprocess_thd`. Computed once. No sync."""
        if self._unshard_index is None:
            self._unshard_index = unshard_index(
                self.cu_seqlens_padded, self.lengths, self.total, self.local_len, self.cp_size, self.cp_layout
            )
        return self._unshard_index

    def shard_routed_experts(self, routed_experts: Tensor, num_experts: int) -> Tensor:
        """(total, *, topk) or nested (B, j, *, topk) expert ids -> (1, local_len, *, topk) shard.

        Alignment slots get distinct experts spread round-robin over ``num_experts`` (slot g, pick k
        -> (g * topk + k) % num_experts), so replaying the router does not pile padding on expert 0.
        """
        flat = self._values(routed_experts)
        if flat.dim() < 2:
            raise input_error("routed_experts", None, "(total, ..., topk)", f"shape {tuple(flat.shape)}")
        topk = flat.shape[-1]
        if not 0 < topk <= num_experts:
            raise input_error("num_experts", None, f">= topk {topk} (distinct experts per slot)", f"{num_experts}")
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
            max_seqlen_q=self.padded_max_seqlen,
            max_seqlen_kv=self.padded_max_seqlen,
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
            x = check_nested(x, "tensor").values()
        if x.dim() < 1 or x.shape[0] != self.source_len:
            raise input_error("tensor", None, f"{self.source_len} tokens on dim 0", f"shape {tuple(x.shape)}")
        return x

    def __repr__(self) -> str:
        return (
            f"ThdPlan(batch={self.batch_size}, total={self.total}, padded={self.padded_total}, "
            f"cp={self.cp_rank}/{self.cp_size} {self.cp_layout}, alignment={self.alignment})"
        )

    # ---- constructors, named like IndexPlan's ------------------------------------------------
    @classmethod
    def from_lengths(cls, lengths: Tensor, **kwargs: Any) -> ThdPlan:
        """:func:`build_thd_plan`: this CP rank's plan from (B,) lengths. ONE host sync."""
        return build_thd_plan(lengths, **kwargs)

    @classmethod
    def from_nested(cls, input_ids_nested: Tensor, **kwargs: Any) -> ThdPlan:
        """:func:`thd_plan`: this CP rank's plan from a jagged nested (B, j, *) tensor. ONE host sync."""
        return thd_plan(input_ids_nested, **kwargs)

    # ---- old names, one release --------------------------------------------------------------
    source_offsets = renamed_attribute("ThdPlan", "source_offsets", "source_starts")
    total_padded = renamed_attribute("ThdPlan", "total_padded", "padded_total")
    max_seqlen = renamed_attribute("ThdPlan", "max_seqlen", "padded_max_seqlen")  # the longest PADDED segment
    align = renamed_attribute("ThdPlan", "align", "alignment")


def build_thd_plan(
    lengths: Tensor,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_layout: CpLayout = "zigzag",
    use_fp8_padding: bool = False,
    pad_to_length_bucket: int | None = None,
    source_starts: Tensor | None = None,
    source_len: int | None = None,
    field: str = "lengths",
    source_offsets: Tensor | None = None,
) -> ThdPlan:
    """Plan this CP rank's THD shard from (B,) sequence lengths. ONE host sync.

    ``source_starts`` (B,) (formerly ``source_offsets``) says where each sequence starts in the flat
    values of ``source_len`` tokens later passed to :meth:`ThdPlan.shard` (default: back to back,
    ``cumsum(lengths)``), so offline packed rows (N, L) with row padding can be sharded from
    ``rows.flatten()`` directly.
    Raises ValueError naming the field and row for an empty sequence or one that runs past the
    source, and for out-of-range sizes, rank, layout or bucket.
    """
    check_cp_args(tp_size, cp_size, cp_rank, cp_layout)
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.shape[0] == 0 or lengths.dtype.is_floating_point:
        got = f"{lengths.dtype} of shape {tuple(lengths.shape)}"
        raise input_error(f"{field}", None, "a non-empty 1-D integer tensor", f"{got}")
    if pad_to_length_bucket is not None and (not isinstance(pad_to_length_bucket, int) or pad_to_length_bucket <= 0):
        raise input_error("pad_to_length_bucket", None, "a positive int or None", f"{pad_to_length_bucket!r}")
    lengths = lengths.to(torch.int64)
    align = cp_alignment(tp_size, cp_size, cp_layout)
    total_multiple = align
    if use_fp8_padding:
        align, fp8_total = fp8_alignment(align)
        total_multiple = math.lcm(align, fp8_total)
    if pad_to_length_bucket is not None:
        total_multiple = math.lcm(total_multiple, pad_to_length_bucket)
    padded = prepare_padded_lengths(lengths, align, total_multiple)
    source_offsets = renamed_keyword("build_thd_plan", "source_offsets", "source_starts", source_offsets, source_starts)
    if source_offsets is None:
        source_offsets = prepare_offsets(lengths)[:-1]
    source_offsets = torch.as_tensor(source_offsets, device=lengths.device).to(torch.int64)
    if source_offsets.shape != lengths.shape:
        raise input_error("source_starts", None, f"shape {tuple(lengths.shape)}", f"{tuple(source_offsets.shape)}")
    ends = source_offsets + lengths
    total, padded_total, padded_max_seqlen, min_len, first, last_end = to_host(
        lengths.sum(), padded.sum(), padded.max(), lengths.min(), source_offsets.min(), ends.max()
    )
    if min_len < 1:
        row = int((lengths < 1).nonzero()[0])
        raise input_error(f"{field}", row, "a sequence of >= 1 token", f"length {int(lengths[row])}")
    source_len = total if source_len is None else source_len
    if first < 0 or last_end > source_len:
        row = int(((source_offsets < 0) | (ends > source_len)).nonzero()[0])
        raise input_error(
            "source_starts",
            row,
            f"a sequence inside the {source_len} source tokens",
            f"start {int(source_offsets[row])} length {int(lengths[row])}",
        )
    return ThdPlan(
        lengths,
        source_offsets,
        padded,
        total=total,
        padded_total=padded_total,
        padded_max_seqlen=padded_max_seqlen,
        source_len=source_len,
        tp_size=tp_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_layout=cp_layout,
        alignment=align,
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
    check_nested(input_ids_nested, "input_ids")
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
