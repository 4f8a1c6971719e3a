"""Context-parallel (CP) index math for packed THD batches, and the collective that undoes it.

A packed batch of B sequences is laid out as one padded buffer of ``T`` slots: sequence i occupies
``[cu[i], cu[i+1])`` (``cu`` = ``cu_seqlens_padded``), real tokens first, alignment padding after.
Each of the ``W = cp_size`` ranks holds ``T / W`` of those slots:

- zigzag (load balance under causal masking): every segment is split into ``2W`` chunks of
  ``c_i = L_i / 2W`` slots and rank r keeps chunks ``r`` and ``2W-1-r`` of EVERY segment, in
  segment order. TransformerEngine's example: cu=[0, 8, 16], W=2 gives rank 0
  [0, 1, 6, 7, 8, 9, 14, 15] and rank 1 [2, 3, 4, 5, 10, 11, 12, 13].
- contiguous: rank r keeps slots ``[r*T/W, (r+1)*T/W)`` of the whole buffer.

Everything here is arithmetic on (B,)-sized tensors plus one gather: no Python loop over
sequences or ranks, and no host sync (callers pass the sizes they already know on the host).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from nopad.errors import input_error
from nopad.layout import prepare_offsets, prepare_position_ids, prepare_row_ids, round_up

CpLayout = Literal["zigzag", "contiguous"]
CP_LAYOUTS = ("zigzag", "contiguous")


# ---- alignment ----------------------------------------------------------------------------------
def cp_alignment(tp_size: int = 1, cp_size: int = 1, cp_layout: CpLayout = "zigzag") -> int:
    """Multiple every padded segment must be: tp*cp*2 (zigzag, cp > 1), tp*cp (contiguous), tp (cp == 1)."""
    check_cp_args(tp_size, cp_size, 0, cp_layout)
    if cp_size == 1:
        return tp_size
    return tp_size * cp_size * (2 if cp_layout == "zigzag" else 1)


def fp8_alignment(alignment: int) -> tuple[int, int]:
    """(per-segment, total) multiples for FP8 GEMMs: lcm(16, alignment) per segment, alignment * 128 in total."""
    return math.lcm(16, alignment), alignment * 128


def prepare_padded_lengths(lengths: Tensor, alignment: int, total_multiple: int = 1) -> Tensor:
    """(B,) lengths -> (B,) int64 lengths rounded up to ``alignment``; the last one also absorbs the
    padding that rounds the TOTAL up to ``total_multiple`` (which must be a multiple of ``alignment``).

    Tail padding is folded into the last segment because a cu_seqlens that ends short of the
    buffer makes TransformerEngine's partitioning return duplicate and missing tokens. No sync.
    """
    if total_multiple % alignment:
        raise input_error(
            "total_multiple", None, f"a multiple of the segment alignment {alignment}", f"{total_multiple}"
        )
    lengths = lengths.to(torch.int64)
    padded = round_up(lengths, alignment)
    tail = round_up(padded.sum(), total_multiple) - padded.sum()
    return torch.cat([padded[:-1], padded[-1:] + tail])


# ---- shard indices ------------------------------------------------------------------------------
def zigzag_shard_index(cu_seqlens_padded: Tensor, local_len: int, cp_size: int, cp_rank: int | None = None) -> Tensor:
    """Global padded slots held by ``cp_rank``: (local_len,); or by every rank: (cp_size, local_len).

    ``cu_seqlens_padded`` (B+1,) global boundaries, each segment a multiple of 2*cp_size;
    ``local_len`` = T / cp_size. No sync.
    """
    cu = cu_seqlens_padded.to(torch.int64)
    seg_len = cu.diff()
    seg = prepare_row_ids(seg_len // cp_size, local_len)  # the local buffer keeps segment order
    chunk = seg_len[seg] // (2 * cp_size)
    q = torch.arange(local_len, device=cu.device) - cu[seg] // cp_size
    rank = torch.arange(cp_size, device=cu.device).unsqueeze(1) if cp_rank is None else cp_rank
    first_half = q < chunk
    within = torch.where(first_half, rank * chunk + q, (2 * cp_size - 1 - rank) * chunk + q - chunk)
    return cu[seg] + within


def contiguous_shard_index(local_len: int, cp_size: int, cp_rank: int | None = None, device=None) -> Tensor:
    """Global padded slots held by ``cp_rank`` (local_len,), or by every rank (cp_size, local_len)."""
    if cp_rank is None:
        return torch.arange(cp_size * local_len, device=device).view(cp_size, local_len)
    return torch.arange(cp_rank * local_len, (cp_rank + 1) * local_len, device=device)


def shard_index(
    cu_seqlens_padded: Tensor, local_len: int, cp_size: int, cp_rank: int | None, cp_layout: CpLayout
) -> Tensor:
    """Global padded slots held by one rank (local_len,) or all ranks (cp_size, local_len). No sync."""
    if cp_layout == "zigzag" and cp_size > 1:
        return zigzag_shard_index(cu_seqlens_padded, local_len, cp_size, cp_rank)
    return contiguous_shard_index(local_len, cp_size, cp_rank, cu_seqlens_padded.device)


def unshard_index(
    cu_seqlens_padded: Tensor, lengths: Tensor, total: int, local_len: int, cp_size: int, cp_layout: CpLayout
) -> Tensor:
    """(total,) position of every REAL token in the rank-major gathered buffer (cp_size * local_len).

    The inverse of :func:`shard_index` restricted to real tokens (alignment padding is dropped):
    ``gathered.flatten(0, 1)[unshard_index(...)]`` is the packed (total, *) batch. No sync.
    """
    cu = cu_seqlens_padded.to(torch.int64)
    lengths = lengths.to(torch.int64)
    row = prepare_row_ids(lengths, total)
    pos = prepare_position_ids(prepare_offsets(lengths), total)
    if cp_layout != "zigzag" or cp_size == 1:
        return cu[row] + pos
    chunk = cu.diff()[row] // (2 * cp_size)
    k = pos // chunk
    first_half = k < cp_size
    rank = torch.where(first_half, k, 2 * cp_size - 1 - k)
    local = cu[row] // cp_size + pos - k * chunk + torch.where(first_half, 0, chunk)
    return rank * local_len + local


# ---- collectives --------------------------------------------------------------------------------
def gather_cp_shards(local: Tensor, cp_size: int, cp_rank: int, group=None) -> Tensor:
    """(local_len, *) on each rank -> (cp_size, local_len, *) on every rank.

    Other ranks' shards arrive detached; this rank's slot IS ``local``, so its autograd graph is
    kept and a loss over the gathered batch sends each rank exactly its own shard's gradient.
    """
    if cp_size == 1:
        return local.unsqueeze(0)
    if not dist.is_initialized():
        expected = f"torch.distributed to be initialised for cp_size={cp_size}"
        raise input_error("cp_size", None, expected, "no process group")
    world = dist.get_world_size(group)
    if world != cp_size:
        raise input_error("cp_group", None, f"a group of cp_size={cp_size} ranks", f"{world}")
    shards = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(shards, local.detach().contiguous(), group=group)
    shards[cp_rank] = local
    return torch.stack(shards)


# ---- argument checks ----------------------------------------------------------------------------
def check_cp_args(tp_size: int, cp_size: int, cp_rank: int, cp_layout: str) -> None:
    """ValueError naming the argument when a size, rank or layout is out of range."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise input_error("tp_size", None, "an int >= 1", f"{tp_size!r}")
    if not isinstance(cp_size, int) or cp_size < 1:
        raise input_error("cp_size", None, "an int >= 1", f"{cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise input_error("cp_rank", None, f"an int in [0, cp_size={cp_size})", f"{cp_rank!r}")
    if cp_layout not in CP_LAYOUTS:
        raise input_error("cp_layout", None, f"one of {CP_LAYOUTS}", f"{cp_layout!r}")
