"""Context-parallel (CP) index math for packed THD batches, and the collective that undoes it.

A packed batch of B sequences is laid out as one padded buffer of ``T`` slots: sequence i occupies
``[cu[i], cu[i+1])`` (``cu`` = ``cu_seqlens_padded``), real tokens first, alignment padding after.
Each of the ``W = cp_size`` ranks holds ``T / W`` of those slots:

- zigzag (load balance under causal masking): every segment is split into ``2W`` chunks of
  ``c_i = L_i / 2W`` slots and rank r keeps chunks ``r`` and ``2W-1-r`` of EVERY segment, in
  segment order. TransformerEngine's example: cu=[0, 8, 16], W=2 gives rank 0
  [0, 1, 6, 7, 8, 9, 14, 15] and rank 1 [2, 3, 4, 5, 10, 11, 12, 13].
- contiguous: rank r keeps slots ``[r*T/W, (r+1)*T/W)`` of the whole buffer.

A rank's share is a run of CHUNKS (zigzag: two per segment; otherwise one per segment): within a
chunk, consecutive local slots are consecutive padded slots of one segment. :func:`rank_chunks`
derives them once, with the same arithmetic on a numpy array (the THD plan, on the host) or a tensor
(:func:`zigzag_shard_index`, on the device); :func:`real_token_pieces` does the same for the way back.
A slot (or token) finds its chunk (or piece) with one op (:func:`run_of_each`) and is one addition
away from its index, so every (T,)-sized index costs a fixed handful of ops.

Everything here is arithmetic on (B,)-sized arrays plus one search: no Python loop over
sequences or ranks, and no host sync (callers pass the sizes they already know on the host).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from nopad.core._errors import check_int, free_to_read, input_error
from nopad.core._layout import as_lengths, host_offsets, integer_values, prepare_offsets, round_up

CpLayout = Literal["zigzag", "contiguous"]
CP_LAYOUTS = ("zigzag", "contiguous")


# ---- alignment ----------------------------------------------------------------------------------
def cp_alignment(tp_size: int = 1, cp_size: int = 1, cp_layout: CpLayout = "zigzag") -> int:
    """Multiple every padded segment must be: tp*cp*2 (zigzag, cp > 1), tp*cp (contiguous), tp (cp == 1)."""
    tp_size, cp_size, _, cp_layout = check_cp_args(tp_size, cp_size, 0, cp_layout)
    return alignment_of(tp_size, cp_size, cp_layout)


def alignment_of(tp_size: int, cp_size: int, cp_layout: CpLayout) -> int:
    """:func:`cp_alignment` of sizes :func:`check_cp_args` has checked (callers that checked them once)."""
    if cp_size == 1:
        return tp_size
    return tp_size * cp_size * (2 if cp_layout == "zigzag" else 1)


def fp8_alignment(alignment: int) -> tuple[int, int]:
    """(per-segment, total) multiples for FP8 GEMMs: lcm(16, alignment) per segment, alignment * 128 in total."""
    alignment = check_int(alignment, "alignment", low=1)
    return math.lcm(16, alignment), alignment * 128


def padded_lengths_of(lengths: np.ndarray, alignment: int, total_multiple: int) -> np.ndarray:
    """Host (B,) lengths -> (B,) int64 lengths rounded up to ``alignment``; the last one also absorbs the
    padding that rounds the TOTAL up to ``total_multiple`` (a multiple of ``alignment``, as the THD
    plan's checked settings make it).

    Tail padding is folded into the last segment because a cu_seqlens that ends short of the
    buffer makes TransformerEngine's partitioning return duplicate and missing tokens.
    """
    padded = round_up(lengths, alignment) if alignment > 1 else lengths.astype(np.int64)  # a new array
    padded_total = int(padded.sum())
    padded[-1:] += round_up(padded_total, total_multiple) - padded_total
    return padded


# ---- chunks: the one derivation of a rank's share --------------------------------------------------
def _stack_flat(parts: list[Any]) -> Any:
    """Interleave equally shaped (..., n) arrays or tensors -> (..., n * len(parts)): part j of item i at i*len+j."""
    stacked: Any
    if isinstance(parts[0], Tensor):
        stacked = torch.stack(parts, -1)
    else:  # filled in place: np.stack's checks cost more than the copy on small arrays
        stacked = np.empty((*parts[0].shape, len(parts)), dtype=parts[0].dtype)
        for j, part in enumerate(parts):
            stacked[..., j] = part
    return stacked.reshape(*stacked.shape[:-2], -1)


def rank_chunks(cu_seqlens_padded: Any, local_len: int, cp_size: int, cp_rank: Any, cp_layout: CpLayout) -> tuple:
    """This rank's share of the padded buffer as chunks: ``(ends (C,), shift (..., C))``.

    ``cu_seqlens_padded`` (B+1,) int64, a numpy array or a tensor (the same arithmetic on either);
    ``cp_rank`` an int, or (zigzag only) a (W, 1) tensor of ranks for every rank at once. C = 2B under
    zigzag with cp > 1 (chunks ``r`` and ``2W-1-r`` of each segment), else B (the segments, cut to
    this rank's window). Local slot ``q`` lies in chunk ``k = #(ends <= q)`` (``searchsorted(...,
    right=True)``; empty chunks are skipped), of segment ``k // (C // B)``, at position
    ``q + shift[k]`` inside that padded segment. No sync.
    """
    if cp_layout == "zigzag" and cp_size > 1:
        local = cu_seqlens_padded // cp_size  # segment boundaries in the local buffer (segment order kept)
        start = local[:-1]
        chunk = (local[1:] - start) // 2  # L_i / 2W
        ends = _stack_flat([start + chunk, local[1:]])
        # first chunk: position r*c + (q - start); second: (2W-1-r)*c + (q - start - c)
        first = cp_rank * chunk - start
        second = (2 * cp_size - 2 - cp_rank) * chunk - start
        return ends, _stack_flat([first, second])
    base = cp_rank * local_len  # this rank's window [base, base + local_len) of the global buffer
    return cu_seqlens_padded[1:] - base, base - cu_seqlens_padded[:-1]


def real_token_pieces(cu_seqlens_padded: Any, lengths: Any, local_len: int, cp_size: int, cp_layout: CpLayout) -> tuple:
    """The way back as pieces of the packed batch: ``(ends (P,), shift (P,))``, numpy or torch.

    Packed token ``t`` (sequences back to back from 0) lies in piece ``p = #(ends <= t)`` and sits at
    ``t + shift[p]`` of the rank-major gathered buffer (cp_size * local_len). A piece is the part of
    one sequence's real tokens inside one chunk: 2*cp_size per sequence under zigzag (some empty),
    else one. No sync.
    """
    token_starts: Any = prepare_offsets(lengths) if isinstance(lengths, Tensor) else host_offsets(lengths)
    cu = cu_seqlens_padded
    if cp_layout != "zigzag" or cp_size == 1:  # the gathered buffer is the padded buffer itself
        return token_starts[1:], cu[:-1] - token_starts[:-1]
    width, on_torch = 2 * cp_size, isinstance(lengths, Tensor)
    k: Any = torch.arange(width, device=lengths.device) if on_torch else np.arange(width)
    minimum = torch.minimum if on_torch else np.minimum
    chunk = ((cu[1:] - cu[:-1]) // width)[:, None]  # (B, 1)
    first = token_starts[:-1, None]
    ends = first + minimum((k + 1) * chunk, lengths[:, None])  # chunk k holds positions [k*c, (k+1)*c)
    rank = minimum(k, width - 1 - k)  # chunk k sits on rank k (k < W) or 2W-1-k
    local = cu[:-1, None] // cp_size + (k // cp_size) * chunk  # where chunk k starts on its rank
    shift = rank * local_len + local - k * chunk - first
    return ends.reshape(-1), shift.reshape(-1)


# ---- runs: which chunk or piece each slot or token falls in -------------------------------------
def run_of_each(items: Tensor, *, ends: Tensor | None = None, sizes: Tensor | None = None) -> Tensor:
    """(n,) the run (chunk or piece) each of ``items = arange(n)`` falls in: ``#(ends <= item)``.

    Runs are consecutive, given by ``ends`` (R,) non-decreasing exclusive ends (empty runs allowed),
    or by ``sizes`` (R,) counts clipped to [0, n) and summing to n (:func:`run_sizes`). One op, no
    sync: with sizes a repeat of run ids (linear in n: on a CPU 30x cheaper than a search), with ends
    one binary search per item (one GPU kernel however long a run is; a repeat spends a warp per run).
    """
    if sizes is not None:
        return torch.repeat_interleave(sizes, output_size=items.shape[0])
    if ends is None:
        raise input_error("ends", None, "the runs' ends or sizes", "neither")
    return torch.searchsorted(ends, items, right=True)


def pieces_to_index(shift: Tensor, n: int, *, ends: Tensor | None = None, sizes: Tensor | None = None) -> Tensor:
    """(n,) ``i + shift[run of i]`` (runs as in :func:`run_of_each`): every slot or token of a run of
    chunks or pieces, each one addition away from its index, in 4 ops. No sync."""
    i = torch.arange(n, device=shift.device)
    return i + shift.index_select(0, run_of_each(i, ends=ends, sizes=sizes))


def run_sizes(ends: np.ndarray, n: int) -> np.ndarray:
    """Host (R,) run ends -> (R,) run sizes inside [0, n), the ``sizes`` of :func:`run_of_each`."""
    clipped = np.minimum(np.maximum(ends, 0), n)  # (np.clip and np.diff(prepend=) cost 10x more on small arrays)
    sizes = clipped.copy()
    sizes[1:] -= clipped[:-1]
    return sizes


# ---- shard indices ------------------------------------------------------------------------------
def zigzag_shard_index(cu_seqlens_padded: Tensor, local_len: int, cp_size: int, cp_rank: int | None = None) -> Tensor:
    """Global padded slots held by ``cp_rank``: (local_len,); or by every rank: (cp_size, local_len).

    ``cu_seqlens_padded`` (B+1,) global boundaries, each segment a multiple of 2*cp_size;
    ``local_len`` = T / cp_size. No sync.
    """
    cu = cu_seqlens_padded.to(torch.int64)
    rank = torch.arange(cp_size, device=cu.device).unsqueeze(1) if cp_rank is None else cp_rank
    ends, shift = rank_chunks(cu, local_len, cp_size, rank, "zigzag")
    q = torch.arange(local_len, device=cu.device)
    chunk = run_of_each(q, ends=ends)
    return q + shift[..., chunk] + cu[chunk // 2]


def contiguous_shard_index(local_len: int, cp_size: int, cp_rank: int | None = None, device=None) -> Tensor:
    """Global padded slots held by ``cp_rank`` (local_len,), or by every rank (cp_size, local_len)."""
    if cp_rank is None:
        return torch.arange(cp_size * local_len, device=device).view(cp_size, local_len)
    return torch.arange(cp_rank * local_len, (cp_rank + 1) * local_len, device=device)


def shard_index(
    cu_seqlens_padded: Tensor, local_len: int, cp_size: int, cp_rank: int | None, cp_layout: CpLayout
) -> Tensor:
    """Global padded slots held by one rank (local_len,) or all ranks (cp_size, local_len). No sync.

    Under zigzag the boundaries must run from 0 to cp_size * local_len in segments that are
    multiples of 2 * cp_size: checked where free (boundaries in host memory); on a device they
    are not read (a sync) and the caller vouches for them."""
    cu_seqlens_padded, local_len, cp_size, cp_layout = _index_args(cu_seqlens_padded, local_len, cp_size, cp_layout)
    if cp_rank is not None:
        check_cp_args(1, cp_size, cp_rank, cp_layout)
    if cp_layout == "zigzag" and cp_size > 1:
        if free_to_read(cu_seqlens_padded):
            check_padded_boundaries(cu_seqlens_padded, None, local_len, cp_size, cp_layout)
        return zigzag_shard_index(cu_seqlens_padded, local_len, cp_size, cp_rank)
    return contiguous_shard_index(local_len, cp_size, cp_rank, cu_seqlens_padded.device)


def unshard_index(
    cu_seqlens_padded: Tensor, lengths: Tensor, total: int, local_len: int, cp_size: int, cp_layout: CpLayout
) -> Tensor:
    """(total,) position of every REAL token in the rank-major gathered buffer (cp_size * local_len).

    The inverse of :func:`shard_index` restricted to real tokens (alignment padding is dropped):
    ``gathered.flatten(0, 1)[unshard_index(...)]`` is the packed (total, *) batch. No sync. The
    boundaries must run from 0 to cp_size * local_len, each segment holding its sequence (a multiple
    of 2 * cp_size under zigzag), and ``total`` be the lengths' sum: checked where free (host
    memory); on a device not read (a sync), the caller vouching for them.
    """
    cu_seqlens_padded, local_len, cp_size, cp_layout = _index_args(cu_seqlens_padded, local_len, cp_size, cp_layout)
    lengths = as_lengths(lengths, "lengths", non_empty=False)
    total = check_int(total, "total", low=0)
    if free_to_read(cu_seqlens_padded, lengths):
        check_padded_boundaries(cu_seqlens_padded, lengths, local_len, cp_size, cp_layout)
        if int(lengths.sum()) != total:
            raise input_error("total", None, f"the sum of the lengths, {int(lengths.sum())}", f"{total}")
    return real_tokens_index(cu_seqlens_padded, lengths, total, local_len, cp_size, cp_layout)


def _index_args(cu: Any, local_len: Any, cp_size: Any, cp_layout: Any) -> tuple[Tensor, int, int, CpLayout]:
    """The checks of the shard index functions' arguments: boundaries by THE reading of an integer
    argument (a tensor kept as it is, its values not read: the index math casts it where it needs
    to, so no op is added), the sizes and layout as :func:`check_cp_args` has them. No sync."""
    values = integer_values(cu, "cu_seqlens_padded")
    cu = values if isinstance(values, Tensor) else torch.from_numpy(values)
    local_len = check_int(local_len, "local_len", low=0)
    _, cp_size, _, cp_layout = check_cp_args(1, cp_size, 0, cp_layout)
    return cu, local_len, cp_size, cp_layout


def real_tokens_index(
    cu_seqlens_padded: Tensor, lengths: Tensor, total: int, local_len: int, cp_size: int, cp_layout: CpLayout
) -> Tensor:
    """:func:`unshard_index` of boundaries its caller has checked."""
    cu = cu_seqlens_padded.to(torch.int64)
    ends, shift = real_token_pieces(cu, lengths.to(torch.int64), local_len, cp_size, cp_layout)
    return pieces_to_index(shift, total, ends=ends)


# ---- collectives --------------------------------------------------------------------------------
def gather_cp_shards(local: Tensor, cp_size: int, cp_rank: int, group=None) -> Tensor:
    """(local_len, *) on each rank -> (cp_size, local_len, *) on every rank.

    Other ranks' shards arrive detached; this rank's slot IS ``local``, so its autograd graph is
    kept and a loss over the gathered batch sends each rank exactly its own shard's gradient.
    """
    if not isinstance(local, Tensor) or getattr(local, "is_nested", False):
        got = "a nested tensor" if isinstance(local, Tensor) else type(local).__name__
        raise input_error("local", None, "a dense (local_len, ...) tensor", got)
    _, cp_size, cp_rank, _ = check_cp_args(1, cp_size, cp_rank, "contiguous")
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


def gather_cp_flat(local: Tensor, cp_size: int, cp_rank: int, group=None) -> Tensor:
    """(local_len, *) on each rank -> (cp_size * local_len, *) rank-major on every rank; ``local``
    itself when cp_size == 1 (no op at all). See :func:`gather_cp_shards`."""
    if cp_size == 1:
        return local
    return gather_cp_shards(local, cp_size, cp_rank, group).flatten(0, 1)


# ---- argument checks ----------------------------------------------------------------------------
def check_padded_boundaries(
    cu: Tensor,
    lengths: Tensor | None,
    local_len: int,
    cp_size: int,
    cp_layout: str,
    *,
    field: str = "cu_seqlens_padded",
    slots: str = "local_len",
    hint: str = "",
) -> None:
    """Host boundaries of a padded batch: from 0 to cp_size * local_len, each segment holding its
    sequence's ``lengths`` (when given) and, under zigzag CP, splitting into 2 x cp_size chunks.
    A read of host memory: callers check only where it is free. ValueError naming ``field``."""
    bounds = cu.numpy().astype(np.int64)
    padded_total = cp_size * local_len
    if bounds.size == 0 or bounds[0] != 0 or bounds[-1] != padded_total:
        expected = f"boundaries from 0 to {padded_total} (cp_size {cp_size} x {slots})"
        got = f"{bounds[0]}..{bounds[-1]}{hint}" if bounds.size else "none"
        raise input_error(field, None, expected, got)
    segments = np.diff(bounds)
    held = np.zeros_like(segments) if lengths is None else lengths.numpy().astype(np.int64)
    if held.shape != segments.shape:
        raise input_error("lengths", None, f"{segments.size} lengths, one per segment of {field}", f"{held.size}")
    multiple = 2 * cp_size if cp_layout == "zigzag" and cp_size > 1 else 1
    bad = np.flatnonzero((segments < held) | (segments % multiple != 0))
    if bad.size:
        i = int(bad[0])
        held_words = "of >= 0 slots" if lengths is None else f"holding the sequence's {int(held[i])} tokens"
        expected = f"a padded segment {held_words}, a multiple of {multiple}"
        raise input_error(field, i, expected, f"{int(segments[i])}{hint}")


def check_cp_args(tp_size: Any, cp_size: Any, cp_rank: Any, cp_layout: Any) -> tuple[int, int, int, CpLayout]:
    """THE check of the parallel sizes: ValueError naming the argument when a size, rank or layout is
    out of range. Sizes and rank are ints by :func:`nopad.core._errors.check_int` (numpy ints accepted, a
    bool refused); returns them as Python ints with the layout."""
    tp_size = check_int(tp_size, "tp_size", low=1)
    cp_size = check_int(cp_size, "cp_size", low=1)
    cp_rank = check_int(cp_rank, "cp_rank")
    if not 0 <= cp_rank < cp_size:
        raise input_error("cp_rank", None, f"an int in [0, cp_size={cp_size})", f"{cp_rank!r}")
    if not isinstance(cp_layout, str) or cp_layout not in CP_LAYOUTS:
        raise input_error("cp_layout", None, f"one of {CP_LAYOUTS}", f"{cp_layout!r}")
    return tp_size, cp_size, cp_rank, cp_layout  # type: ignore[return-value]
