"""The THD plan: where every real token of a packed batch sits in one CP rank's share of the padded buffer.

One plan = one host sync: the batch's offsets (or lengths) come to the host in ONE copy, and all the
per-sequence index math (padded boundaries, this rank's chunks, validation) runs there in numpy;
its results go back to the device in one (non-blocking, pinned) copy. The device then builds every
per-slot index from a fixed handful of ops whatever the batch size: one op finds each slot's chunk
(:func:`~nopad.parallel._cp.run_of_each`) and one gather reads the chunk's shift, length and source
start. The Megatron adapter
(:mod:`nopad.engines._megatron`) and the packers (:mod:`nopad.packing._thd`) both shard through it,
so the CP layout has one derivation (:func:`~nopad.parallel._cp.rank_chunks`). ``PackedSeqParams``
is megatron-core's when it is installed, else a stand-in with the same fields.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from nopad.core._errors import (
    check_flag,
    check_int,
    check_integer_tensor,
    check_optional_int,
    free_to_read,
    input_error,
)
from nopad.core._layout import (
    IndexPlan,
    as_lengths,
    check_nested,
    device_to_host,
    host_lengths,
    host_offsets,
    host_starts,
    host_to_device,
    integer_values,
    is_nested,
    jagged_values,
    nested_offsets,
    prepare_offsets,
)
from nopad.parallel._cp import (
    CpLayout,
    alignment_of,
    check_cp_args,
    fp8_alignment,
    padded_lengths_of,
    pieces_to_index,
    rank_chunks,
    real_token_pieces,
    run_of_each,
    run_sizes,
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


def _is_host(device: torch.device) -> bool:
    """Whether tensors on ``device`` share the host's memory: the plan then wraps its numpy arrays
    without a copy and repeats run ids instead of searching. (One switch, so a test can take the
    device branch on a CPU.)"""
    return device.type == "cpu"


# ---- host arrays on the device --------------------------------------------------------------------
class _DeviceArrays:
    """Named host int64 arrays, put on ``device`` in ONE copy and handed out as tensors on demand.

    On a CPU each array is wrapped as it is (no copy); elsewhere they travel together, from pinned
    memory, with one non-blocking copy (the GPU does not wait for the host, the host does not wait
    for the GPU), and each name is a slice of that one buffer. No sync.
    """

    def __init__(self, arrays: dict[str, np.ndarray], device: torch.device):
        self.device, self._arrays = device, arrays
        self._tensors: dict[str, Tensor] = {}
        self._buffer: Tensor | None = None
        if not _is_host(device):
            self._buffer = host_to_device(np.concatenate(list(arrays.values())), device)

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._tensors:
            if self._buffer is None:
                self._tensors[name] = torch.from_numpy(self._arrays[name])
            else:
                start = 0
                for key, array in self._arrays.items():
                    if key == name:
                        break
                    start += array.shape[0]
                self._tensors[name] = self._buffer[start : start + self._arrays[name].shape[0]]
        return self._tensors[name]


def _runs(arrays: _DeviceArrays, name: str) -> dict[str, Tensor]:
    """The runs ``name`` as :func:`~nopad.parallel._cp.run_of_each` suits the device best: their
    sizes on a CPU (a linear repeat of run ids), their ends elsewhere (one binary-search kernel)."""
    if _is_host(arrays.device):
        return {"sizes": arrays[f"{name}_sizes"]}
    return {"ends": arrays[f"{name}_ends"]}


# ---- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ThdSizes:
    """A THD plan's checked settings (:func:`thd_sizes`) and the multiples derived from them."""

    tp_size: int
    cp_size: int
    cp_rank: int
    cp_layout: CpLayout
    alignment: int
    total_multiple: int


class ThdPlan:
    """Where every real token of a batch sits in this CP rank's share of the padded THD buffer.

    Attributes (tensors on the plan's device; the (B,)-sized ones are derived on the host):
        lengths: (B,) int64 real tokens per sequence.
        source_starts: (B,) int64 where each sequence starts in the (source_len, *) values it is read from.
        total: int, real tokens; ``padded_total``: int, T, the global padded buffer length.
        source_len: int, tokens in the values it shards (``total`` unless built with source offsets).
        cu_seqlens_padded: (B+1,) int32 global padded boundaries, ending at T.
        padded_lengths: (B,) int64 each sequence's padded segment (tail padding folded into the last).
        padded_max_seqlen: int, the longest padded segment (``max_seqlen_q/kv`` of PackedSeqParams).
        alignment: int, the multiple every padded segment is.
        plan: the :class:`~nopad.core._layout.IndexPlan` of the real tokens (row ids, positions, labels).
        local_len: int, T / cp_size, the slots this rank holds.
        global_index: (local_len,) int64 global padded slot of each local slot.
        segment: (local_len,) int64 the sequence each local slot belongs to.
        offset_in_segment: (local_len,) int64 each local slot's position inside its padded segment.
    """

    @classmethod
    def from_lengths(
        cls,
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
        device: torch.device | str | None = None,
    ) -> ThdPlan:
        """Plan this CP rank's THD shard from (B,) sequence lengths. ONE host read (of the lengths) for
        a tensor; host lengths (a sequence or numpy array) are read as they are, no tensor made.

        ``source_starts`` (B,) says where each sequence starts in the flat
        values of ``source_len`` tokens later passed to :meth:`ThdPlan.shard` (default: back to back,
        ``cumsum(lengths)``), so offline packed rows (N, L) with row padding can be sharded from
        ``rows.flatten()`` directly.
        ``device`` (default: the lengths') is where the plan's tensors live: CPU lengths with
        ``device="cuda"`` plan a GPU batch without any device sync (the index math runs on the host and
        its results travel in one non-blocking copy).
        Raises ValueError naming the field and row for an empty sequence or one that runs past the
        source, and for out-of-range sizes, rank, layout or bucket. Lengths and starts are integers (a
        float, bool or string is refused, never rounded).
        """
        sizes = thd_sizes(tp_size, cp_size, cp_rank, cp_layout, use_fp8_padding, pad_to_length_bucket)
        field = field if isinstance(field, str) else "lengths"
        values = integer_values(lengths, field)  # THE reading: a tensor kept, host input a numpy array
        source_len = check_optional_int(source_len, "source_len", low=0)
        if isinstance(values, np.ndarray):  # host lengths: no tensor made, nothing read
            starts_h = None if source_starts is None else host_lengths(source_starts, "source_starts")
            if starts_h is not None and starts_h.shape != values.shape:
                raise input_error("source_starts", None, f"shape {values.shape}", f"{starts_h.shape}")
            device = torch.device("cpu") if device is None else torch.device(device)
            starts_own = None if starts_h is None else starts_h.copy()
            return _checked_plan(values.copy(), starts_own, source_len, sizes, device, field)  # the plan's own
        lengths = values.to(torch.int64)
        read_starts = None
        if source_starts is None:
            read_lengths = device_to_host(lengths)  # int64, a fresh array
        else:
            starts = as_lengths(source_starts, "source_starts", non_empty=False).to(lengths.device)
            if starts.shape != lengths.shape:
                raise input_error("source_starts", None, f"shape {tuple(lengths.shape)}", f"{tuple(starts.shape)}")
            read_lengths, read_starts = device_to_host(torch.stack([lengths, starts]))  # both in the one read
        device = lengths.device if device is None else torch.device(device)
        return _checked_plan(read_lengths, read_starts, source_len, sizes, device, field)

    @classmethod
    def from_nested(
        cls,
        input_ids_nested: Tensor,
        *,
        tp_size: int = 1,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_layout: CpLayout = "zigzag",
        use_fp8_padding: bool = False,
        pad_to_length_bucket: int | None = None,
        sizes: ThdSizes | None = None,
    ) -> ThdPlan:
        """:meth:`from_lengths` from a jagged nested (B, j, *) tensor's offsets. ONE host read (of the offsets).

        The plan lives on the values' device; offsets already on the host cost no device sync at all.
        Shard the batch's companions (labels, loss masks, routed experts) with the returned plan.
        ``sizes``: the settings already checked (:func:`thd_sizes`); the keyword settings are then unread.
        """
        if sizes is None:  # the settings first, before the batch
            sizes = thd_sizes(tp_size, cp_size, cp_rank, cp_layout, use_fp8_padding, pad_to_length_bucket)
        check_nested(input_ids_nested, "input_ids")
        offsets = nested_offsets(input_ids_nested)
        if offsets.dim() != 1 or offsets.shape[0] < 2:
            got = f"{offsets.dtype} of shape {(max(offsets.shape[0] - 1, 0),)}"
            raise input_error("input_ids", None, "a non-empty 1-D integer tensor", got)
        host = device_to_host(offsets).astype(np.int64, copy=False)
        device = jagged_values(input_ids_nested).device  # sequences are read back to back from the first token
        return _checked_plan(host[1:] - host[:-1], None, None, sizes, device, "input_ids", offsets)

    def __init__(
        self,
        lengths: np.ndarray,
        source_starts: np.ndarray,
        source_len: int,
        sizes: ThdSizes,
        device: torch.device,
        batch_offsets: Tensor | None = None,
    ):
        """From host (B,) int64 lengths (each >= 1) and source starts, already validated. No sync.

        ``batch_offsets``: the offsets tensor of the nested batch the plan was read from (its
        identity is how :meth:`shard` and ``postprocess_thd`` know a batch as this plan's for free).
        """
        self.tp_size, self.cp_size, self.cp_rank = sizes.tp_size, sizes.cp_size, sizes.cp_rank
        self.cp_layout, self.alignment = sizes.cp_layout, sizes.alignment
        padded = padded_lengths_of(lengths, sizes.alignment, sizes.total_multiple)
        cu = host_offsets(padded)
        self.total, self.source_len = int(lengths.sum()), source_len
        self.padded_total, self.padded_max_seqlen = int(cu[-1]), int(padded.max())
        self.local_len = self.padded_total // self.cp_size
        self._host_lengths, self._host_cu = lengths, cu
        arrays = self._chunk_table(lengths, source_starts)
        arrays.update(cu=cu, lengths=lengths, source_starts=source_starts, padded_lengths=padded)
        self._device = _DeviceArrays(arrays, device)
        self._locate_slots(device)
        self._sources: dict[bool, tuple[Tensor, Tensor]] = {}
        self._unshard_index: Tensor | None = None
        self._batch_offsets = batch_offsets
        self._back_to_back = source_len == self.total and bool(np.array_equal(source_starts, host_starts(lengths)))

    def _chunk_table(self, lengths: np.ndarray, source_starts: np.ndarray) -> dict[str, np.ndarray]:
        """Host arrays of this rank's chunks: their ends and sizes (the runs a slot is found in) and
        one row each: (shift to the slot's position in its segment, the sequence's length, its source start)."""
        ends, shift = rank_chunks(self._host_cu, self.local_len, self.cp_size, self.cp_rank, self.cp_layout)
        per = self._chunks_per_segment = ends.shape[0] // lengths.shape[0]
        rows = np.empty((lengths.shape[0], per, 3), dtype=np.int64)  # (sequence, its chunk, field)
        rows[:, :, 0] = shift.reshape(-1, per)
        rows[:, :, 1] = lengths[:, None]
        rows[:, :, 2] = source_starts[:, None]
        return {"chunk_ends": ends, "chunk_sizes": run_sizes(ends, self.local_len), "chunk_rows": rows.reshape(-1)}

    def _locate_slots(self, device: torch.device) -> None:
        """Every local slot's chunk, position in its segment, length and source start, and whether it
        is padding: a fixed number of ops whatever B (one op finds the chunk, one gather reads its row)."""
        slot = torch.arange(self.local_len, device=device)
        self._chunk = run_of_each(slot, **_runs(self._device, "chunk"))
        rows = self._device["chunk_rows"].view(-1, 3).index_select(0, self._chunk)
        shift, self._slot_length, self._slot_start = rows.unbind(1)
        self.offset_in_segment = slot + shift
        self._padding = self.offset_in_segment >= self._slot_length

    # ---- per-sequence tensors, put on the device with the plan ------------------------------
    @property
    def lengths(self) -> Tensor:
        return self._device["lengths"]

    @property
    def source_starts(self) -> Tensor:
        return self._device["source_starts"]

    @property
    def padded_lengths(self) -> Tensor:
        return self._device["padded_lengths"]

    @functools.cached_property
    def cu_seqlens_padded(self) -> Tensor:
        return self._device["cu"].to(torch.int32)

    @functools.cached_property
    def plan(self) -> IndexPlan:
        lengths, host = self.lengths, self._host_lengths
        return IndexPlan(
            lengths,
            prepare_offsets(lengths),
            total=self.total,
            width=self.padded_max_seqlen,
            starts=torch.zeros_like(lengths),
            max_seqlen=int(host.max()),
            min_seqlen=int(host.min()),
        )

    @property
    def batch_size(self) -> int:
        return self._host_lengths.shape[0]

    @property
    def host_cu_seqlens(self) -> np.ndarray:
        """(B+1,) int64 numpy: the padded boundaries as the plan derived them on the host."""
        return self._host_cu

    # ---- per-slot tensors ----------------------------------------------------------------------
    @functools.cached_property
    def segment(self) -> Tensor:
        """(local_len,) int64 the sequence each local slot belongs to."""
        per = self._chunks_per_segment
        return self._chunk if per == 1 else self._chunk // per

    @functools.cached_property
    def global_index(self) -> Tensor:
        """(local_len,) int64 global padded slot of each local slot."""
        return self.offset_in_segment + self._device["cu"].index_select(0, self.segment)

    @property
    def position_ids(self) -> Tensor:
        """(1, local_len) int64: position of each slot's token in its own sequence; 0 on padding slots."""
        return torch.where(self._padding, 0, self.offset_in_segment).unsqueeze(0)  # one kernel

    @property
    def padding_mask(self) -> Tensor:
        """(1, local_len) bool: True on alignment padding slots. A copy: the plan's own mask decides
        every later shard and position, so writing into the result must not reach it."""
        return self._padding.unsqueeze(0).clone()

    def source_index(self, need_roll: bool = False) -> Tensor:
        """(local_len,) row of the (source_len, *) values each local slot reads (0 on padding slots).

        ``need_roll`` reads the NEXT token of the same sequence; the last real token of a sequence
        has none and, like padding, reads 0 (:meth:`shard` puts ``pad_value`` there: nopad's one
        convention for the label slot no loss trains on).
        """
        return self._source(check_flag(need_roll, "need_roll"))[0]

    def _source(self, need_roll: bool) -> tuple[Tensor, Tensor]:
        """(source index, skip) for every local slot, computed once per ``need_roll``: skip is True
        where the slot reads no real value (padding; with need_roll, also a sequence's last token)."""
        if need_roll not in self._sources:
            if need_roll:
                position = self.offset_in_segment + 1
                skip = position >= self._slot_length
            else:
                position, skip = self.offset_in_segment, self._padding
            # in place on the fresh sum: one kernel (an out-of-place masked_fill copies first)
            self._sources[need_roll] = ((position + self._slot_start).masked_fill_(skip, 0), skip)
        return self._sources[need_roll]

    def shard(self, values: Tensor, *, need_roll: bool = False, pad_value: float | int = 0) -> Tensor:
        """Per-token (total, *) values or nested (B, j, *) -> this rank's (1, local_len, *) THD shard.

        Padding slots hold ``pad_value``; ``need_roll`` gives next-token labels, with ``pad_value`` at
        each sequence's last token (nopad's one convention for the label slot no loss trains on).
        Autograd flows back to ``values``. No sync. A nested ``values`` must have this batch's sequence
        boundaries: its offsets tensor is the one the plan was read from (free), or, on the CPU, equal
        to it (a read of host memory); offsets that are another tensor on a device are not read.
        """
        need_roll = check_flag(need_roll, "need_roll")
        flat = self._values(values)
        index, skip = self._source(need_roll)
        out = flat.index_select(0, index)
        if flat.dim() > 1:
            skip = skip.view(-1, *([1] * (flat.dim() - 1)))
        return out.masked_fill_(skip, _pad_of(pad_value, out.dtype)).unsqueeze(0)  # out is fresh: in place

    def unshard_index(self) -> Tensor:
        """(total,) where each real token sits in the rank-major gathered buffer (cp_size * local_len):
        the way back for :func:`~nopad.engines._megatron.postprocess_thd`. Computed once, from the
        host arrays (one copy to the device, then 4 ops). No sync."""
        if self._unshard_index is None:
            host = real_token_pieces(self._host_cu, self._host_lengths, self.local_len, self.cp_size, self.cp_layout)
            ends, shift = host
            arrays = {"piece_ends": ends, "piece_sizes": run_sizes(ends, self.total), "shift": shift}
            pieces = _DeviceArrays(arrays, self.offset_in_segment.device)
            self._unshard_index = pieces_to_index(pieces["shift"], self.total, **_runs(pieces, "piece"))
        return self._unshard_index

    def shard_routed_experts(self, routed_experts: Tensor, num_experts: int) -> Tensor:
        """(total, *, topk) or nested (B, j, *, topk) expert ids -> (1, local_len, *, topk) shard.

        Alignment slots get distinct experts spread round-robin over ``num_experts`` (slot g, pick k
        -> (g * topk + k) % num_experts), so replaying the router does not pile padding on expert 0.
        Ids outside [0, num_experts) are refused where reading them is free (host memory); on a
        device they are not read (that would be a host sync).
        """
        num_experts = check_int(num_experts, "num_experts", low=1)
        flat = self._values(routed_experts)
        check_integer_tensor(flat, "routed_experts")
        if flat.dim() < 2:
            raise input_error("routed_experts", None, "(total, ..., topk)", f"shape {tuple(flat.shape)}")
        topk = flat.shape[-1]
        if not 0 < topk <= num_experts:
            raise input_error("num_experts", None, f">= topk {topk} (distinct experts per slot)", f"{num_experts}")
        if free_to_read(flat) and flat.numel() and not bool(((flat >= 0) & (flat < num_experts)).all()):
            bad = flat[(flat < 0) | (flat >= num_experts)][0].item()
            raise input_error("routed_experts", None, f"expert ids in [0, num_experts={num_experts})", f"{bad}")
        out = flat.index_select(0, self.source_index())
        pick = torch.arange(topk, device=out.device)
        spread = (self.global_index.view(-1, *([1] * (out.dim() - 1))) * topk + pick) % num_experts
        padding = self._padding.view(-1, *([1] * (out.dim() - 1)))
        return torch.where(padding, spread.to(out.dtype), out).unsqueeze(0)

    def packed_seq_params(self, params_class: type | None = None) -> Any:
        """``PackedSeqParams(qkv_format="thd")`` with the GLOBAL padded cu_seqlens for q and kv.

        Megatron's own pretraining passes padded boundaries as cu_seqlens_q/kv too. The layout is
        also recorded as ``cp_partition_mode`` (a field in newer megatron-core; megatron-core 0.16.1
        has none and its TransformerEngine CP attention assumes zigzag). ``params_class``: the class
        to build (default :func:`packed_seq_params_class`).
        """
        cu = self.cu_seqlens_padded
        params = (params_class or packed_seq_params_class())(
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
            self.check_boundaries(check_nested(x, "tensor"), "tensor")
            x = jagged_values(x)
        if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[0] != self.source_len:
            got = f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise input_error("tensor", None, f"{self.source_len} tokens on dim 0", got)
        return x

    def check_boundaries(self, nested: Tensor, field: str) -> None:
        """Refuse a nested batch whose sequences are not this plan's, where that is free: its offsets
        tensor is the one the plan was read from (identity: nothing to read), or lives on the CPU (its
        values are compared with the plan's host lengths). Offsets that are another tensor on a device
        are not read (a host sync): the caller's contract. Plans whose sequences are not read back to
        back (built with ``source_starts``) are not compared."""
        offsets = nested_offsets(nested)
        if offsets is self._batch_offsets or not self._back_to_back:
            return
        if offsets.shape[0] != self.batch_size + 1:
            raise input_error(field, None, f"{self.batch_size} sequences, this plan's", f"{offsets.shape[0] - 1}")
        if not free_to_read(offsets):
            return
        lengths = offsets.numpy().astype(np.int64)
        if not np.array_equal(lengths[1:] - lengths[:-1], self._host_lengths):
            expected = f"this plan's sequence lengths {_shown(self._host_lengths)}"
            raise input_error(field, None, expected, f"lengths {_shown(lengths[1:] - lengths[:-1])} (another batch?)")

    def __repr__(self) -> str:
        return (
            f"ThdPlan(batch={self.batch_size}, total={self.total}, padded={self.padded_total}, "
            f"cp={self.cp_rank}/{self.cp_size} {self.cp_layout}, alignment={self.alignment})"
        )


def _pad_of(pad_value: float | int, dtype: torch.dtype) -> float | int | bool:
    """``pad_value`` as ``dtype`` holds it, refused where it would change: a 2.5 is no token id, and
    casting it into an integer tensor would pad with 2 silently."""
    if dtype.is_floating_point or dtype.is_complex:
        return pad_value
    exact = float(pad_value) == int(pad_value) if isinstance(pad_value, (int, float)) else False
    if not exact or (dtype == torch.bool and pad_value not in (0, 1)):
        kind = "0 or 1" if dtype == torch.bool else "a whole number"
        raise input_error("pad_value", None, f"{kind} for a {dtype} tensor", repr(pad_value))
    return bool(pad_value) if dtype == torch.bool else int(pad_value)


def _shown(values: np.ndarray, most: int = 8) -> str:
    items = values.tolist()
    return str(items) if len(items) <= most else f"{str(items[:most])[:-1]}, ... ({len(items)} in all)]"


def thd_sizes(
    tp_size: Any = 1,
    cp_size: Any = 1,
    cp_rank: Any = 0,
    cp_layout: Any = "zigzag",
    use_fp8_padding: Any = False,
    pad_to_length_bucket: Any = None,
) -> ThdSizes:
    """THE check of a THD plan's settings (ValueError naming the argument), made once per plan, and
    the segment and total multiples derived from them."""
    tp_size, cp_size, cp_rank, cp_layout = check_cp_args(tp_size, cp_size, cp_rank, cp_layout)
    use_fp8_padding = check_flag(use_fp8_padding, "use_fp8_padding")
    pad_to_length_bucket = check_optional_int(pad_to_length_bucket, "pad_to_length_bucket", low=1)
    align = alignment_of(tp_size, cp_size, cp_layout)
    total_multiple = align
    if use_fp8_padding:
        align, fp8_total = fp8_alignment(align)
        total_multiple = math.lcm(align, fp8_total)
    if pad_to_length_bucket is not None:
        total_multiple = math.lcm(total_multiple, pad_to_length_bucket)
    return ThdSizes(tp_size, cp_size, cp_rank, cp_layout, align, total_multiple)


def _checked_plan(
    lengths: np.ndarray,
    source_starts: np.ndarray | None,
    source_len: int | None,
    sizes: ThdSizes,
    device: torch.device,
    field: str,
    batch_offsets: Tensor | None = None,
) -> ThdPlan:
    """Validate host lengths and source starts (ValueError naming the field and row), then plan.

    ``source_starts`` None: sequences back to back from 0 (always inside the source).
    """
    if lengths.min() < 1:
        row = int((lengths < 1).argmax())
        raise input_error(f"{field}", row, "a sequence of >= 1 token", f"length {int(lengths[row])}")
    source_len = int(lengths.sum()) if source_len is None else source_len
    if source_starts is None:
        source_starts = host_starts(lengths)
    else:
        outside = (source_starts < 0) | (source_starts + lengths > source_len)
        if outside.any():
            row = int(outside.argmax())
            raise input_error(
                "source_starts",
                row,
                f"a sequence inside the {source_len} source tokens",
                f"start {int(source_starts[row])} length {int(lengths[row])}",
            )
    return ThdPlan(lengths, source_starts, source_len, sizes, device, batch_offsets)
