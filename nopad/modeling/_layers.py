"""Packed forms of the layers that carry state along the sequence: one packed row of several
sequences in, each sequence computed as if it ran alone out. Pure torch, any device, autograd.

Softmax attention keeps the sequences of a packed row apart through its mask or its varlen kernel.
These layers carry a state from token to token instead, and in one packed row that state would flow
from each sequence into the next. Each form restarts it where a sequence starts::

    causal_conv1d      depthwise causal conv (kernel K): a tap that would reach into the previous
                       sequence reads zero, as a sequence alone reads its left zero padding
    gated_delta_rule   the chunked gated delta rule (Qwen3.5, Qwen3-Next, OLMo hybrid): each
                       head's (d_k, d_v) state starts at zero in every sequence
    ssd_scan           Mamba2's chunked state-space scan (Bamba, Granite-4.0-H, Nemotron-H,
                       Falcon-H1, Zamba2): each head's (d_head, d_state) state likewise

The chunked forms use the aligned layout (:class:`ChunkLayout`): every sequence sits on whole
chunks of its own, its last chunk zero-filled, exactly as that sequence alone is zero-padded to a
chunk multiple. No chunk straddles a boundary, so the work inside chunks (the bulk) runs batched
over every chunk of the row, with the arithmetic of a sequence run alone. Only the recurrence
crosses chunks, and it runs over the chunk index *within* a sequence: step c advances every
sequence that has a c-th chunk, so the loop has as many steps as the longest sequence has chunks,
whatever the number of sequences, and a fixed number of tensor ops per step. (An exact in-chunk
mask would keep chunks full, but a chunk touching several sequences then needs a state per
sequence inside it; the aligned layout costs at most chunk - 1 zero slots per sequence.)

A :class:`SharedPrefixRow` (a GRPO group's prompt once, then its completions: the shared-prefix
layout of :mod:`nopad.batches._prefixes`) is served by the same three entries: each completion
continues from its prompt's final state (the conv reads the prompt's last K - 1 inputs; the delta
rule and the scan run the prompts as one packed row, then the completions as another, each from its
prompt's final state gathered by ``completion_group``). Where a kernel takes an initial state per
packed sequence and returns each one's final state with its gradient, both runs are the kernel's:
flash-linear-attention's gated delta rule (``initial_state`` (N, H, D_k, D_v), chosen as for a
plain row). The others cannot, so a shared-prefix row runs their torch forms and refuses them
forced, by name: causal-conv1d takes no initial states with ``seq_idx`` (the torch conv is K
gathers), and mamba-ssm's scan takes one initial state per batch row, which ``seq_idx`` resets to
zero at every later sequence, its per-sequence final states forward-only.

Under torch.compile the routing hands these forms a :class:`BoundedRow` instead: the boundaries, the
token count and a bound on the longest sequence, no host lengths, so dynamo traces them whole. Its
:class:`DenseChunkLayout` puts every sequence on the longest's chunk count (the chunks past a
sequence's end are zeros, which leave the state as it is): the graph depends on that count alone.

Shapes: T tokens of the packed row, N sequences, H heads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from nopad.core._errors import check_flag, check_int, input_error
from nopad.core._layout import (
    IndexPlan,
    ceil_div,
    device_to_host,
    host_lengths,
    host_offsets,
    host_starts,
    host_to_device,
    position_ids_of,
    spread_over_tokens,
)
from nopad.core._memo import tag
from nopad.core._probe import probe

# the tag of boundaries whose row is kept on them (a shared-prefix row's): not derivable from them
ROW_OF_ITS_OWN = "row of its own"


class PackedRow:
    """The sequences of one packed row, as the state-carrying layers read them.

    ``cu_seqlens`` (N+1,) int64 on the row's device, ``lengths`` (N,) int64 on the host,
    ``position_ids`` (T,) each token's position in its own sequence. Built once per forward and
    shared by all its layers; the chunk layouts are cached on it, one per chunk size.
    """

    def __init__(self, cu_seqlens: Tensor, lengths: np.ndarray) -> None:
        self.cu_seqlens = cu_seqlens.to(torch.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.total = int(self.lengths.sum())
        self.position_ids = position_ids_of(self.cu_seqlens, self.total)
        self._layouts: dict[int, ChunkLayout] = {}
        self._padded: IndexPlan | None = None

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor, lengths: np.ndarray | None = None) -> PackedRow:
        """From (N+1,) boundaries; ``lengths`` their host lengths when known, else one host sync."""
        if lengths is None:
            lengths = np.diff(device_to_host(cu_seqlens.to(torch.int64)))
        return cls(cu_seqlens, lengths)

    @classmethod
    def from_lengths(cls, lengths: Any, device: torch.device | str = "cpu") -> PackedRow:
        """From host lengths (a sequence of ints or an integer array, each >= 0; nothing is rounded).
        No sync (a tensor of lengths is read: one host sync where it is on a device)."""
        lengths = host_lengths(lengths, "lengths", low=0)
        cu = host_to_device(host_offsets(lengths), torch.device(device))
        return cls(cu, lengths)

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @property
    def count(self) -> int:
        """N, the number of sequences."""
        return len(self.lengths)

    @property
    def seq_idx(self) -> Tensor:
        """(1, T) int32 index of each token's sequence: the boundaries as causal-conv1d and mamba-ssm take them."""
        rows = torch.arange(self.count, device=self.device, dtype=torch.int64)
        return spread_over_tokens(rows, self.cu_seqlens, self.total).to(torch.int32).unsqueeze(0)

    def to_padded(self, x: Tensor) -> Tensor:
        """(T, *rest) -> (N, longest, *rest): one row per sequence, right-padded with zeros. One gather."""
        return self._padded_plan().unpack(x)

    def from_padded(self, y: Tensor) -> Tensor:
        """(N, longest, *rest) -> (T, *rest): the inverse of :meth:`to_padded`."""
        return self._padded_plan().pack(y)

    def _padded_plan(self) -> IndexPlan:
        if self._padded is None:
            longest, shortest = self._extent()
            lengths = self.cu_seqlens.diff()
            self._padded = IndexPlan(
                lengths,
                self.cu_seqlens,
                total=self.total,
                width=longest,
                starts=torch.zeros_like(lengths),
                max_seqlen=longest,
                min_seqlen=shortest,
            )
        return self._padded

    def _extent(self) -> tuple[int, int | None]:
        """The longest sequence's length (or a bound on it) and the shortest's (None where not known)."""
        return (int(self.lengths.max()), int(self.lengths.min())) if len(self.lengths) else (0, 0)

    def layout(self, chunk: int) -> ChunkLayout:
        """The aligned chunk layout of this row for ``chunk``-token chunks (cached)."""
        if chunk not in self._layouts:
            self._layouts[chunk] = ChunkLayout(self, chunk)
        return self._layouts[chunk]


class ChunkLayout:
    """A packed row on whole chunks, sequence by sequence, in step-major order.

    Sequence i of L_i tokens takes n_i = ceil(L_i / chunk) chunks. Sequences are ranked longest
    first; step c holds the c-th chunk of every sequence with n_i > c, in rank order, so the
    sequences a step advances are always a prefix of the ranking and their chunks one contiguous
    slice of the chunk axis. ``steps`` is that slice per step, ``(first chunk, count)``, counts
    non-increasing; ``slots`` (T,) is where each token sits in the flat (num_chunks * chunk) buffer.
    Host math on the row's lengths and one host->device copy; no sync.
    """

    def __init__(self, row: PackedRow, chunk: int) -> None:
        self.chunk = chunk
        chunks = ceil_div(row.lengths, chunk)  # n_i
        order = np.argsort(-chunks, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        longest = int(chunks.max()) if len(chunks) else 0
        counts = (chunks[None, :] > np.arange(longest)[:, None]).sum(1)  # sequences with a c-th chunk
        firsts = host_starts(counts)
        self.num_chunks = int(counts.sum())
        self.steps = list(zip(firsts.tolist(), counts.tolist()))
        first_d, rank_d = host_to_device(np.concatenate([firsts, rank]).astype(np.int64), row.device).split(
            [longest, len(rank)]
        )
        positions = row.position_ids
        step = positions // chunk
        seq = spread_over_tokens(rank_d, row.cu_seqlens, row.total)  # each token's sequence rank
        self.slots = (first_d[step] + seq) * chunk + positions % chunk
        self._order, self._rank = order, rank_d
        self._order_d: Tensor | None = None

    def by_rank(self, per_sequence: Tensor) -> Tensor:
        """(N, *rest) one entry per sequence -> (N, *rest) in rank order (longest first): the order of
        the state rows the recurrence advances. One gather."""
        if self._order_d is None:
            self._order_d = host_to_device(self._order.astype(np.int64), self._rank.device)
        return per_sequence.index_select(0, self._order_d)

    def by_sequence(self, per_rank: Tensor) -> Tensor:
        """(N, *rest) in rank order -> (N, *rest) one entry per sequence: the inverse of :meth:`by_rank`."""
        return per_rank.index_select(0, self._rank)

    def recur(
        self, initial: Tensor, advance: Callable[[slice, Tensor], tuple[Tensor, Tensor]], final_state: bool
    ) -> tuple[list[Tensor], Tensor | None]:
        """The recurrence across chunks, from ``initial`` (N, *state) each sequence's state before its
        first chunk, in rank order (:meth:`by_rank`). ``advance(chunks, state)``: a step's slice of the
        chunk axis and the states of the sequences it advances -> that step's output and their states
        after it. Returns the steps' outputs and, with ``final_state``, (N, *state) each sequence's
        state after its last chunk (its initial one for a sequence with no chunk), else None."""
        advancing = self.steps[0][1] if self.steps else 0
        state, outputs, finished = initial[:advancing], [], []
        for step, (first, count) in enumerate(self.steps):
            # the sequences that have this chunk: a prefix (longest first)
            output, state = advance(slice(first, first + count), state[:count])
            outputs.append(output)
            if final_state:  # the states of the sequences whose last chunk this step was
                finished.append(state[self.finishing(step) :])
        if not final_state:
            return outputs, None
        return outputs, self.by_sequence(torch.cat([*reversed(finished), initial[advancing:]]))

    def finishing(self, step: int) -> int:
        """How many sequences advance past step ``step`` (the rest, up to that step's count, end there)."""
        return self.steps[step + 1][1] if step + 1 < len(self.steps) else 0

    def to_chunks(self, x: Tensor) -> Tensor:
        """(T, *rest) -> (num_chunks, chunk, *rest), zeros in the slots no token fills."""
        flat = x.new_zeros((self.num_chunks * self.chunk, *x.shape[1:])).index_copy(0, self.slots, x)
        return flat.view(self.num_chunks, self.chunk, *x.shape[1:])

    def from_chunks(self, y: Tensor) -> Tensor:
        """(num_chunks, chunk, *rest) -> (T, *rest): the tokens back in packed order."""
        return y.flatten(0, 1).index_select(0, self.slots)


class BoundedRow(PackedRow):
    """A packed row known by its boundaries on the device, its token count and a bound on its
    longest sequence, with no host lengths: the row a compiled forward builds (torch.compile traces
    it whole: no host read, no sync; the token count and the number of sequences stay symbolic).

    ``cu_seqlens`` (N+1,), ``total`` T, ``longest`` at least the longest sequence's length (the
    forward's ``max_length_q``; a smaller one fails the chunk layout's copy). Its chunk layouts are
    :class:`DenseChunkLayout`: every sequence on the longest's chunk count, so their one host int is
    that count (a compiled forward's graph is specialised on it, not on the lengths).
    """

    def __init__(self, cu_seqlens: Tensor, total: int, longest: int) -> None:
        self.cu_seqlens = cu_seqlens.to(torch.int64)
        self.total = total
        self.longest = longest
        self.position_ids = position_ids_of(self.cu_seqlens, total)
        self._layouts: dict[int, ChunkLayout] = {}
        self._padded = None

    @property
    def count(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    def _extent(self) -> tuple[int, int | None]:
        return self.longest, None

    def layout(self, chunk: int) -> ChunkLayout:
        """The dense chunk layout of this row for ``chunk``-token chunks (cached)."""
        if chunk not in self._layouts:
            self._layouts[chunk] = DenseChunkLayout(self, chunk)
        return self._layouts[chunk]


class DenseChunkLayout(ChunkLayout):
    """A :class:`ChunkLayout` with no host lengths: each of the N sequences on S = ceil(longest /
    chunk) chunks of its own, step-major (step c's chunks are c*N .. c*N + N - 1, sequence order),
    the chunks past a sequence's end all zeros. A zero chunk leaves the delta rule's and the scan's
    state as it is (decay exp(0) = 1, no key, no input), so every sequence advances at every step and
    its final state is the last step's. Costs N * S chunks where the aligned layout takes the sum
    of the sequences' own counts: the price of a graph that does not depend on the lengths."""

    def __init__(self, row: BoundedRow, chunk: int) -> None:
        self.chunk = chunk
        count = row.count
        self.num_chunks = ceil_div(row.longest, chunk) * count
        self.steps = [(step * count, count) for step in range(ceil_div(row.longest, chunk))]
        positions = row.position_ids
        rows = torch.arange(count, device=row.device, dtype=torch.int64)
        seq = spread_over_tokens(rows, row.cu_seqlens, row.total)  # each token's sequence
        self.slots = ((positions // chunk) * count + seq) * chunk + positions % chunk

    def by_rank(self, per_sequence: Tensor) -> Tensor:
        return per_sequence

    def by_sequence(self, per_rank: Tensor) -> Tensor:
        return per_rank

    def finishing(self, step: int) -> int:
        return self.steps[step][1] if step + 1 < len(self.steps) else 0


class SharedPrefixRow(PackedRow):
    """A packed row in the shared-prefix layout (:mod:`nopad.batches._prefixes`): blocks, each an
    optional prompt then a completion; a completion continues its group's prompt, the one in the
    nearest block before it that has one (its group's leader).

    As a :class:`PackedRow` its sequences are the 2B parts (prompt part, completion part of each
    block, empty ones kept), so the boundaries handed to a layer tell where each part starts. The
    state layers' forms read it whole: a prompt runs from a zero state; a completion starts from its
    prompt's final state (the delta rule's and the scan's recurrent state, the conv's last K - 1
    inputs), as if it ran right after its prompt alone. Fixed ops whatever B: each form runs the
    prompts as one packed row, then the completions as another, their initial states gathered by
    ``completion_group``.

    Built from host lengths (block order): ``prompt_parts`` (B,) the prompt tokens each block holds
    (0 for a group's other rows), ``completions`` (B,); the first block must hold a prompt. Host math
    and host->device copies; no sync.

    Device tensors: ``prompt_tokens`` (Tp,), ``completion_tokens`` (Tc,) the packed tokens of the
    prompts and of the completions; ``merge`` (T,) where each packed token is in their concatenation;
    ``completion_group`` (B,) the prompt (group) each completion continues. ``prompts`` (G sequences)
    and ``completion_row`` (B sequences) are the two rows the recurrent forms run.
    """

    def __init__(self, prompt_parts: np.ndarray, completions: np.ndarray, device: torch.device | str = "cpu") -> None:
        prompt_parts = np.asarray(prompt_parts, dtype=np.int64)
        completions = np.asarray(completions, dtype=np.int64)
        blocks = len(prompt_parts)
        leads = prompt_parts > 0
        if completions.shape != (blocks,) or (blocks and not leads[0]) or (prompt_parts < 0).any():
            got = f"prompt parts {prompt_parts.tolist()}, completions {completions.tolist()}"
            raise input_error("row", None, "blocks of a prompt (>= 0 tokens, the first > 0) and a completion", got)
        device = torch.device(device)
        parts = np.stack([prompt_parts, completions], 1).reshape(-1)  # (2B,) prompt, completion, ...
        part_offsets = host_offsets(parts)
        super().__init__(host_to_device(part_offsets, device), parts)
        tag(self.cu_seqlens, ROW_OF_ITS_OWN)  # a compiled forward reads this row, never a plain one of them
        group = np.cumsum(leads) - 1  # (B,) the group of each block: its prompt's index among the prompts
        lead_block = np.flatnonzero(leads)[group] if blocks else group
        prompt_offsets, completion_offsets = host_offsets(prompt_parts), host_offsets(completions)
        # per part, for the conv: the end of the prompt it continues and that prompt's length (0: none)
        before_end = np.stack([np.zeros(blocks, np.int64), part_offsets[1:-1:2][lead_block]], 1).reshape(-1)
        before_len = np.stack([np.zeros(blocks, np.int64), prompt_parts[lead_block]], 1).reshape(-1)
        prompt_lengths = prompt_parts[leads]  # (G,) one per group, in group order
        fields = [
            part_offsets[0:-1:2],  # (B,) where each block's prompt part starts in the row
            part_offsets[1:-1:2],  # (B,) ... its completion part
            prompt_offsets,  # (B+1,) the prompt parts' offsets among the prompts' tokens
            completion_offsets,  # (B+1,) the completions' among the completions' tokens
            host_offsets(prompt_lengths),  # (G+1,) the prompts' row
            group,
            before_end,
            before_len,
        ]
        prompt_at, completion_at, prompt_cu, completion_cu, groups_cu, group_d, end_d, len_d = host_to_device(
            np.concatenate(fields), device
        ).split([len(f) for f in fields])
        self.prompt_total, self.completion_total = int(prompt_offsets[-1]), int(completion_offsets[-1])
        self.prompt_tokens = spread_over_tokens(
            prompt_at - prompt_cu[:-1], prompt_cu, self.prompt_total, plus_position=True
        )
        self.completion_tokens = spread_over_tokens(
            completion_at - completion_cu[:-1], completion_cu, self.completion_total, plus_position=True
        )
        order = torch.cat([self.prompt_tokens, self.completion_tokens])
        self.merge = torch.empty_like(order).index_copy_(0, order, torch.arange(self.total, device=device))
        self.completion_group = group_d
        self.prompts = PackedRow(groups_cu, prompt_lengths)
        self.completion_row = PackedRow(completion_cu, completions)
        self._before_end = spread_over_tokens(end_d, self.cu_seqlens, self.total)
        self._before_len = spread_over_tokens(len_d, self.cu_seqlens, self.total)
        self._taps: dict[int, Tensor] = {}

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(T, *rest) -> (Tp, *rest) the prompts' tokens, (Tc, *rest) the completions'. Two gathers."""
        return x.index_select(0, self.prompt_tokens), x.index_select(0, self.completion_tokens)

    def join(self, prompts: Tensor, completions: Tensor) -> Tensor:
        """The inverse of :meth:`split`: (Tp, *rest), (Tc, *rest) -> (T, *rest) in the packed row's order."""
        return torch.cat([prompts, completions]).index_select(0, self.merge)

    def conv_taps(self, kernel: int) -> Tensor:
        """(K - 1, T): for tap j (1..K-1) the packed token j steps back in each token's own sequence
        (a completion's first taps read its prompt's last tokens), T where that is before the start.
        Cached per kernel size."""
        if kernel not in self._taps:
            at = torch.arange(self.total, device=self.device)
            offset, end, length = self.position_ids, self._before_end, self._before_len
            taps = []
            for j in range(1, kernel):
                back = j - offset  # > 0: how far into the prompt before the part the tap reaches
                prior = torch.where(back <= length, end - back, self.total)
                taps.append(torch.where(offset >= j, at - j, prior))
            self._taps[kernel] = torch.stack(taps) if taps else at.new_zeros((0, self.total))
        return self._taps[kernel]


# ---- causal depthwise conv -----------------------------------------------------------------------


def _activation(activation: str | Callable | None) -> Callable[[Tensor], Tensor]:
    if activation is None:
        return lambda x: x
    if callable(activation):
        return activation
    if activation in ("silu", "swish"):
        return F.silu
    from transformers.activations import ACT2FN  # only models from transformers name other activations

    return ACT2FN[activation]


def torch_causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    positions: Tensor,
    *,
    activation: str | Callable | None = None,
    history: Tensor | None = None,
) -> Tensor:
    """(C, T) channels by packed tokens -> (C, T), the depthwise causal conv of each sequence alone.

    ``weight`` (C, K); ``positions`` (T,) each token's position in its own sequence (a tap j steps
    back is used only where ``positions >= j``); ``history`` (C, K - 1) the inputs just before the
    first token (another rank's, under sequence parallelism), zeros when None. Computed in
    ``weight``'s dtype, returned in ``x``'s, as transformers' reference conv does. K taps: a fixed
    number of ops.
    """
    C, T = x.shape
    K = weight.shape[-1]
    if weight.shape != (C, K):
        raise input_error("weight", None, f"({C}, kernel) for {C} channels", f"{tuple(weight.shape)}")
    xw = x.to(weight.dtype)
    extended = torch.cat([xw.new_zeros((C, K - 1)) if history is None else history.to(xw.dtype), xw], dim=1)
    # tap j: x[:, t - j], read where token t's own sequence reaches that far back
    taps = (torch.where(positions >= j, extended[:, K - 1 - j : K - 1 - j + T], 0.0) for j in range(1, K))
    return _conv_of_taps(xw, weight, bias, taps, activation).to(x.dtype)


def _shared_causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None, row: SharedPrefixRow, activation: str | Callable | None
) -> Tensor:
    """:func:`torch_causal_conv1d` over a shared-prefix row: (C, T) -> (C, T), a completion's first
    taps reading its prompt's last inputs (:meth:`SharedPrefixRow.conv_taps`). K gathers."""
    xw = x.to(weight.dtype)
    padded = F.pad(xw, (0, 1))  # column T: the zero a tap before a sequence's start reads
    taps = (padded.index_select(1, at) for at in row.conv_taps(weight.shape[-1]))
    return _conv_of_taps(xw, weight, bias, taps, activation).to(x.dtype)


def _conv_of_taps(
    x: Tensor, weight: Tensor, bias: Tensor | None, taps: Iterable[Tensor], activation: str | Callable | None
) -> Tensor:
    """The depthwise conv's sum: (C, T) ``x`` and (K - 1) ``taps`` (C, T), tap j each token's input j
    steps back (zero before its sequence), in ``weight``'s dtype -> (C, T), bias added and activated.
    The taps come one at a time (a generator), so no more than one is held beside the sum."""
    K = weight.shape[-1]
    out = x * weight[:, K - 1 : K]
    for j, tap in enumerate(taps, 1):
        out = out + tap * weight[:, K - 1 - j : K - j]
    if bias is not None:
        out = out + bias[:, None]
    return _activation(activation)(out)


# ---- the chunked gated delta rule ------------------------------------------------------------------


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as flash-linear-attention normalises q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _causal(chunk: int, device: torch.device, diagonal: int) -> Tensor:
    return torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril(diagonal)


def torch_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    row: PackedRow,
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    initial_state: Tensor | None = None,
    final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule of each sequence of a packed row, its state reset at every start.

    q, k (T, H_k, D_k); v (T, H, D_v); g (T, H) log decay (<= 0); beta (T, H). H_k divides H (each
    query/key head serves H / H_k consecutive value heads). Per token t of a sequence, with state
    S (D_k, D_v) starting at zero: S = exp(g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t.
    ``scale`` defaults to D_k ** -0.5; ``use_qk_l2norm`` normalises q and k first. Computed in
    float32, chunk by chunk (:class:`ChunkLayout`); returns (T, H, D_v) in q's dtype, and with
    ``final_state`` (N, H, D_k, D_v) float32 each sequence's state after its last token (its initial
    one for an empty sequence), else None. ``initial_state`` (N, H, D_k, D_v): each sequence's state
    at its start where given, instead of zero.
    """
    dtype = q.dtype
    T, H, Dv = v.shape
    if k.shape[1] != H:  # grouped values: repeat each query/key head for the value heads it serves
        q, k = (x.repeat_interleave(H // k.shape[1], dim=1) for x in (q, k))
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    layout = row.layout(chunk_size)
    # (chunks, H, chunk, D) and (chunks, H, chunk): heads next to the chunk axis, as a batch of chunks
    q, k, v = (layout.to_chunks(x).transpose(1, 2) for x in (q, k, v))
    g, beta = (layout.to_chunks(x).transpose(1, 2) for x in (g, beta))
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    # exp(decay_i - decay_j) for j <= i: the decay between two positions of a chunk
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~_causal(layout.chunk, q.device, 0), -math.inf)
    pairwise = pairwise.exp()
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # The chunk's delta-rule updates in closed form (the UT transform): (I + strictly_lower(A)) X = B
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * pairwise
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_decayed = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]

    def advance(c: slice, state: Tensor) -> tuple[Tensor, Tensor]:
        v_new = new_values[c] - k_cumdecay[c] @ state
        output = q_decayed[c] @ state + intra[c] @ v_new
        return output, state * chunk_decay[c] + k_decayed[c].transpose(-1, -2) @ v_new

    shape = (row.count, H, k.shape[-1], Dv)
    initial = q.new_zeros(shape) if initial_state is None else layout.by_rank(initial_state.float())
    outputs, finals = layout.recur(initial, advance, final_state)
    out = torch.cat(outputs) if outputs else v.new_zeros((0, H, layout.chunk, Dv))
    return layout.from_chunks(out.transpose(1, 2)).to(dtype), finals


def _gdn_form(fla: bool, chunk_size: int, scale: float | None, use_qk_l2norm: bool) -> Callable:
    """The gated delta rule run by row, (q, k, v, g, beta, row, initial_state=, final_state=) -> (out,
    finals): flash-linear-attention's with ``fla`` (its own chunking), else the torch form's."""
    if fla:
        return functools.partial(_gdn_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm)
    return functools.partial(torch_gated_delta_rule, chunk_size=chunk_size, scale=scale, use_qk_l2norm=use_qk_l2norm)


def _shared_run(
    run: Callable[..., tuple[Tensor, Tensor | None]], row: SharedPrefixRow, **tokens: Tensor | None
) -> Tensor:
    """A recurrent form over a shared-prefix row: the prompts from a zero state, then each completion
    from its prompt's final state. Two packed runs of ``run`` (keyword inputs, ``row`` and
    ``final_state`` or ``initial_state`` -> the output and the final states, as
    :func:`torch_gated_delta_rule`) and a gather; the output like the form's. ``tokens``: the inputs
    with a token axis, each split between the two runs (None passes as None)."""
    halves = {name: (None, None) if t is None else row.split(t) for name, t in tokens.items()}
    to_prompts, to_completions = ({name: half[i] for name, half in halves.items()} for i in (0, 1))
    prompts, finals = run(row=row.prompts, final_state=True, **to_prompts)
    assert finals is not None
    initial = finals.index_select(0, row.completion_group)  # backward: each completion's share, summed
    completions, _ = run(row=row.completion_row, initial_state=initial, **to_completions)
    return row.join(prompts, completions)


# ---- Mamba2's chunked state-space scan ------------------------------------------------------------


def _segment_sums(a: Tensor) -> Tensor:
    """(..., L) -> (..., L, L): [i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the diagonal.

    Summed directly (a masked cumsum), not as a difference of prefix sums, which would lose the
    small terms of a long decay to cancellation.
    """
    L = a.shape[-1]
    expanded = a[..., None].expand(*a.shape, L).masked_fill(~_causal(L, a.device, -1), 0)
    return expanded.cumsum(-2).masked_fill(~_causal(L, a.device, 0), -math.inf)


def torch_ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    row: PackedRow,
    *,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_state: Tensor | None = None,
    final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Mamba2's selective state-space scan of each sequence of a packed row, its state reset at every start.

    x (T, H, P); dt (T, H); A (H,); B, C (T, G, N) with G dividing H. Per token t of a sequence,
    with state S (P, N) per head starting at zero, dt_t = clamp(softplus(dt_t + dt_bias)) (as
    asked): S = exp(dt_t A) S + dt_t x_t B_t^T; y_t = S C_t + D x_t, then y_t * silu(z_t) if ``z``.
    Computed in float32, chunk by chunk (:class:`ChunkLayout`); returns (T, H, P) float32, as
    transformers' reference scan does, and with ``final_state`` (N, H, P, N_state) float32 each
    sequence's state after its last token (its initial one for an empty sequence), else None.
    ``initial_state`` (N, H, P, N_state): each sequence's state at its start where given, instead of zero.
    """
    T, H, P = x.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1]).float()
    x = x.float()
    B, C = (y.float().repeat_interleave(H // y.shape[1], dim=1) for y in (B, C))  # (T, H, N)
    skip = None if D is None else x * (D.float()[:, None] if D.dim() == 1 else D.float())
    layout = row.layout(chunk_size)
    xs = layout.to_chunks(x * dt[..., None])  # (chunks, L, H, P)
    a = layout.to_chunks(A.float() * dt).transpose(1, 2)  # (chunks, H, L) log decays
    B, C = layout.to_chunks(B), layout.to_chunks(C)  # (chunks, L, H, N)
    decay = a.cumsum(-1)
    # inside each chunk: attention-like scores C_l . B_s, decayed from s to l
    scores = torch.einsum("clhn,cshn->chls", C, B) * _segment_sums(a).exp()
    y = torch.einsum("chls,cshp->clhp", scores, xs)
    # each chunk's own contribution to the state at its end
    to_end = (decay[..., -1:] - decay).exp()  # (chunks, H, L)
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", B, to_end, xs)
    chunk_decay = decay[..., -1].exp()[..., None, None]  # (chunks, H, 1, 1)

    def advance(c: slice, state: Tensor) -> tuple[Tensor, Tensor]:
        return state, state * chunk_decay[c] + chunk_states[c]

    shape = (row.count, H, P, B.shape[-1])
    initial = xs.new_zeros(shape) if initial_state is None else layout.by_rank(initial_state.float())
    entering, finals = layout.recur(initial, advance, final_state)  # the state each chunk starts from
    starts = torch.cat(entering) if entering else chunk_states
    y = y + torch.einsum("clhn,chpn,chl->clhp", C, starts, decay.exp())
    out = layout.from_chunks(y)
    if skip is not None:
        out = out + skip
    if z is not None:
        out = out * F.silu(z.float())
    return out, finals


# ---- Mamba's selective scan --------------------------------------------------------------------------


def torch_selective_scan(
    u: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
) -> Tensor:
    """Mamba's selective scan of sequences one per row (mamba-ssm's ``selective_scan_fn`` layout):
    ``u``, ``dt``, ``z`` (N, D, L); ``A`` (D, S); ``B``, ``C`` (N, S, L) -> (N, D, L). The recurrence
    of transformers' own torch Mamba (a zero state at each row's start, one step per position: a
    row right-padded with zeros after its sequence computes that sequence as it runs alone). For the
    transformers releases (before 5.20) that ship no torch form of the primitive."""
    dtype = u.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    decay = torch.exp(A[None, :, None, :] * dt[..., None])  # (N, D, L, S)
    inputs = dt[..., None] * B.transpose(1, 2)[:, None].float() * u[..., None].float()
    state = u.new_zeros((u.shape[0], u.shape[1], A.shape[-1]))
    steps = []
    for t in range(u.shape[-1]):
        state = decay[:, :, t] * state + inputs[:, :, t]
        steps.append(torch.matmul(state.to(dtype), C[:, :, t, None].to(dtype))[..., 0])
    out = torch.stack(steps, dim=-1) if steps else u.new_zeros(u.shape)
    if D is not None:
        out = out + u * D[None, :, None]
    if z is not None:
        out = out * F.silu(z)
    return out


# ---- the optional CUDA kernels ---------------------------------------------------------------------
# causal-conv1d, flash-linear-attention and mamba-ssm keep packed sequences apart themselves, given
# the boundaries. Each is used on CUDA where it is installed and passes its probe (once per process
# and device: a small packed case, forward and backward, must run and equal the torch form above);
# everywhere else, and for calls a kernel does not serve, the torch form runs. Nothing to install.
# On a shared-prefix row only fla serves (a state per packed sequence in and out, with its gradient):
# its probe runs both rows; causal-conv1d and mamba-ssm cannot (_NO_STATE_PER_SEQUENCE).


def _load_causal_conv1d() -> Callable:
    from causal_conv1d import causal_conv1d_fn

    return causal_conv1d_fn


def _load_fla() -> Callable:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _load_mamba_ssm() -> Callable:
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return mamba_chunk_scan_combined


# the form each kernel serves -> (its package, how to load its entry point); tests substitute loaders
KERNELS: dict[str, tuple[str, Callable[[], Callable]]] = {
    "causal_conv1d": ("causal-conv1d", _load_causal_conv1d),
    "gated_delta_rule": ("flash-linear-attention", _load_fla),
    "ssd_scan": ("mamba-ssm", _load_mamba_ssm),
}
KERNEL_DEVICES = ("cuda",)
_LOADED: dict[str, Callable | None] = {}


def _kernel(form: str) -> Callable | None:
    """The installed kernel of ``form``, or None when it is missing or cannot load here. Once."""
    if form not in _LOADED:
        try:
            _LOADED[form] = KERNELS[form][1]()
        except Exception:  # noqa: BLE001 - not installed, or installed without what it needs (CUDA, Triton)
            _LOADED[form] = None
    return _LOADED[form]


def kernel_refusal(form: str, device: torch.device) -> str | None:
    """Why ``form``'s kernel does not run here (not installed, not this device, failed its probe), or None."""
    package = KERNELS[form][0]
    if device.type not in KERNEL_DEVICES:
        return f"{package} runs on {' or '.join(KERNEL_DEVICES)}, not {device.type}"
    if _kernel(form) is None:
        return f"{package} is not installed (or cannot load here)"
    return _probe(form, str(device))


@functools.cache
def _probe(form: str, device: str) -> str | None:
    """None when the kernel runs a small packed case here and equals the torch form, forward and
    backward; else why not (also warned once: :func:`nopad.core._probe.probe`). Host syncs: once per
    process and device."""
    lengths = np.array([37, 1, 5, 64, 20], dtype=np.int64)
    cu = torch.from_numpy(host_offsets(lengths))  # each run's own row: made in its context

    def on_row(run: Callable) -> Callable:
        def call(*tensors: Tensor) -> list[Tensor]:
            *inputs, cu = tensors
            return [run(*inputs, PackedRow(cu, lengths))]

        return call

    return probe(
        KERNELS[form][0],
        on_row(_KERNEL_RUNS[form]),
        on_row(_TORCH_RUNS[form]),
        _probe_inputs(form, int(lengths.sum())),
        device,
        constants=[cu],
        tol=1e-2,
        instead="the torch form runs instead",
    )


def _probe_inputs(form: str, T: int) -> list[Tensor]:
    """Small random inputs of ``form`` for ``T`` tokens, the same every time (CPU, float32)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, low: float = -1.0, high: float = 1.0) -> Tensor:
        return torch.rand(*shape, generator=g) * (high - low) + low

    if form == "causal_conv1d":
        return [rand(8, T), rand(8, 4), rand(8)]
    if form == "gated_delta_rule":
        return [rand(T, 2, 16), rand(T, 2, 16), rand(T, 2, 16), rand(T, 2, low=-1.0, high=0.0), rand(T, 2, low=0.0)]
    return [rand(T, 4, 8), rand(T, 4), rand(4, low=-2.0, high=-0.5), rand(T, 1, 8), rand(T, 1, 8)]


def _conv_kernel(x, weight, bias, row, activation="silu"):
    # causal-conv1d reads seq_idx only from a channel-last (1, C, T) input
    channel_last = x.t().contiguous().t().unsqueeze(0)
    return _kernel("causal_conv1d")(channel_last, weight, bias, seq_idx=row.seq_idx, activation=activation)[0]


def _gdn_kernel(q, k, v, g, beta, row, scale=None, use_qk_l2norm=True, initial_state=None, final_state=False):
    """fla's chunk_gated_delta_rule over ``row``: (T, H, D_v), and (N, H, D_k, D_v) float32 each
    sequence's final state with ``final_state`` (else None); ``initial_state`` (N, H, D_k, D_v) each
    sequence's start (fla returns its gradient)."""
    if k.shape[1] != v.shape[1]:
        q, k = (x.repeat_interleave(v.shape[1] // k.shape[1], dim=1) for x in (q, k))
    out, finals = _kernel("gated_delta_rule")(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        scale=scale,
        initial_state=initial_state,
        output_final_state=final_state,
        cu_seqlens=row.cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    return out[0], finals


def _ssd_kernel(x, dt, A, B, C, row, chunk_size=16, z=None, **options):
    options.setdefault("dt_softplus", True)
    z = None if z is None else z[None]  # mamba-ssm asserts z.shape == x.shape: batched like x
    out = _kernel("ssd_scan")(x[None], dt[None], A, B[None], C[None], chunk_size, z=z, seq_idx=row.seq_idx, **options)
    return out[0] if isinstance(out, Tensor) else out[0][0]


def _gdn_probe(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, row: PackedRow, fla: bool) -> Tensor:
    """What gated_delta_rule asks of fla, on the probe's 127 tokens: the packed row [37, 1, 5, 64, 20],
    then the same tokens as a shared-prefix row (a 37-token prompt with completions of 1 and 5, a
    64-token one, exactly fla's chunk, with 20 and an empty one), each completion from its prompt's
    final state. (2T, H, D_v): the two outputs, fla's with ``fla``, else the torch forms'."""
    shared = SharedPrefixRow(np.array([37, 0, 64, 0]), np.array([1, 5, 20, 0]), row.device)
    form = _gdn_form(fla, 64, None, True)
    return torch.cat([form(q, k, v, g, beta, row)[0], _shared_run(form, shared, q=q, k=k, v=v, g=g, beta=beta)])


_KERNEL_RUNS: dict[str, Callable] = {
    "causal_conv1d": _conv_kernel,
    "gated_delta_rule": functools.partial(_gdn_probe, fla=True),
    "ssd_scan": _ssd_kernel,
}
_TORCH_RUNS: dict[str, Callable] = {
    "causal_conv1d": lambda x, w, b, row: torch_causal_conv1d(x, w, b, row.position_ids, activation="silu"),
    "gated_delta_rule": functools.partial(_gdn_probe, fla=False),
    "ssd_scan": lambda x, dt, A, B, C, row: torch_ssd_scan(x, dt, A, B, C, row, chunk_size=16, dt_softplus=True)[0],
}


# ---- the checks at the public entries: shapes, dtypes and host ints only (no op, no sync) -----------


def _floats(x: Any, field: str, shape: str, ndim: int) -> Tensor:
    """``x`` is a dense floating-point tensor of ``ndim`` dims (``shape`` its words, as "(T, H, D)")."""
    if not isinstance(x, Tensor) or x.is_nested:
        got = "a nested tensor" if isinstance(x, Tensor) else type(x).__name__
        raise input_error(field, None, f"a dense floating-point {shape} tensor", got)
    if not x.dtype.is_floating_point:
        raise input_error(field, None, f"a floating-point {shape} tensor", f"dtype {x.dtype}")
    if x.dim() != ndim:
        raise input_error(field, None, f"a {shape} tensor", f"shape {tuple(x.shape)}")
    return x


def _shaped(x: Any, field: str, shape: str, expected: tuple[int, ...], why: str) -> Tensor:
    """:func:`_floats`, of exactly the shape ``expected`` (``why``: what it is bound by)."""
    _floats(x, field, shape, len(expected))
    if tuple(x.shape) != expected:
        raise input_error(field, None, f"shape {expected} {why}", f"shape {tuple(x.shape)}")
    return x


def _check_row(row: Any, tokens: int, field: str) -> PackedRow:
    """``row`` is a :class:`PackedRow` of ``tokens`` tokens (``field`` the tensor that has them)."""
    if not isinstance(row, PackedRow):
        raise input_error("row", None, "a nopad.modeling.PackedRow (PackedRow.from_lengths)", type(row).__name__)
    if row.total != tokens:
        raise input_error(field, None, f"{row.total} tokens (the row's total) on its token axis", f"{tokens}")
    return row


def _check_activation(activation: Any) -> None:
    """None, a callable, or the name of an activation transformers knows ("silu", "gelu", ...)."""
    if activation is None or callable(activation) or activation in ("silu", "swish"):
        return
    words = "None, a callable or an activation's name (as transformers' ACT2FN names them)"
    if not isinstance(activation, str):
        raise input_error("activation", None, words, repr(activation))
    from transformers.activations import ACT2FN

    if activation not in ACT2FN:
        raise input_error("activation", None, words, repr(activation))


def _check_conv(x: Any, weight: Any, bias: Any, row: Any, activation: Any) -> None:
    """causal_conv1d's arguments: x (C, T), weight (C, K), bias (C,) or None, T the row's tokens."""
    _floats(x, "x", "(channels, tokens)", 2)
    C, T = x.shape
    _floats(weight, "weight", "(channels, kernel)", 2)
    if weight.shape[0] != C or weight.shape[1] < 1:
        raise input_error(
            "weight", None, f"shape ({C}, kernel >= 1) for x's {C} channels", f"shape {tuple(weight.shape)}"
        )
    if bias is not None:
        _shaped(bias, "bias", "(channels,)", (C,), f"for x's {C} channels")
    _check_row(row, T, "x")
    _check_activation(activation)


def _check_gdn(q: Any, k: Any, v: Any, g: Any, beta: Any, row: Any, chunk_size: Any, use_qk_l2norm: Any) -> None:
    """gated_delta_rule's arguments: q, k (T, H_k, D_k); v (T, H, D_v); g, beta (T, H); H_k divides H."""
    _floats(v, "v", "(tokens, heads, d_v)", 3)
    T, H, _ = v.shape
    _floats(q, "q", "(tokens, key heads, d_k)", 3)
    if q.shape[0] != T or q.shape[1] < 1 or H % q.shape[1]:
        expected = f"shape ({T}, key heads dividing {H}, d_k) for v of shape {tuple(v.shape)}"
        raise input_error("q", None, expected, f"shape {tuple(q.shape)}")
    _shaped(k, "k", "(tokens, key heads, d_k)", tuple(q.shape), "like q")
    for field, x in (("g", g), ("beta", beta)):
        _shaped(x, field, "(tokens, heads)", (T, H), f"for v of shape {tuple(v.shape)}")
    _check_row(row, T, "v")
    check_int(chunk_size, "chunk_size", low=1)
    check_flag(use_qk_l2norm, "use_qk_l2norm")


def _check_ssd(x: Any, dt: Any, A: Any, B: Any, C: Any, row: Any, chunk_size: Any, options: dict[str, Any]) -> None:
    """ssd_scan's arguments: x (T, H, P); dt (T, H); A (H,); B, C (T, G, N), G dividing H; D (H,) or
    (H, P), z like x, dt_bias (H,) where given."""
    _floats(x, "x", "(tokens, heads, head dim)", 3)
    T, H, P = x.shape
    like_x = f"for x of shape {tuple(x.shape)}"
    _shaped(dt, "dt", "(tokens, heads)", (T, H), like_x)
    _shaped(A, "A", "(heads,)", (H,), like_x)
    _floats(B, "B", "(tokens, groups, state)", 3)
    if B.shape[0] != T or B.shape[1] < 1 or H % B.shape[1]:
        expected = f"shape ({T}, groups dividing {H}, state) {like_x}"
        raise input_error("B", None, expected, f"shape {tuple(B.shape)}")
    _shaped(C, "C", "(tokens, groups, state)", tuple(B.shape), "like B")
    _check_row(row, T, "x")
    check_int(chunk_size, "chunk_size", low=1)
    D, z, dt_bias = options["D"], options["z"], options["dt_bias"]
    if D is not None:
        _floats(D, "D", "(heads,) or (heads, head dim)", D.dim() if isinstance(D, Tensor) and D.dim() == 2 else 1)
        if tuple(D.shape) not in ((H,), (H, P)):
            raise input_error("D", None, f"shape ({H},) or ({H}, {P}) {like_x}", f"shape {tuple(D.shape)}")
    if z is not None:
        _shaped(z, "z", "(tokens, heads, head dim)", (T, H, P), "like x")
    if dt_bias is not None:
        _shaped(dt_bias, "dt_bias", "(heads,)", (H,), like_x)
    check_flag(options["dt_softplus"], "dt_softplus")


# Why a form's kernel cannot run a shared-prefix row: each completion must start from its prompt's
# state, and these kernels take no initial state per sequence of a packed row.
_NO_STATE_PER_SEQUENCE = {
    "causal_conv1d": "causal-conv1d takes no initial states with seq_idx (it asserts initial_states is None)",
    "ssd_scan": "mamba-ssm's mamba_chunk_scan_combined takes one initial state per batch row, which "
    "seq_idx resets to zero at every later sequence, and returns per-sequence final states without a backward",
}


def _torch_only(form: str, kernel: str) -> None:
    """A shared-prefix row runs ``form`` in torch: ``kernel`` must be "auto" or "torch"; the kernel's
    own name is refused saying why it cannot serve (:data:`_NO_STATE_PER_SEQUENCE`)."""
    if kernel in ("auto", "torch"):
        return
    package = KERNELS[form][0]
    got = f"{package!r} ({_NO_STATE_PER_SEQUENCE[form]})" if kernel == package else repr(kernel)
    raise input_error("kernel", None, "'auto' or 'torch' for a shared-prefix row", got)


def _use_kernel(form: str, kernel: str, device: torch.device) -> bool:
    """Whether a call runs ``form``'s CUDA kernel: ``kernel`` is "auto" (where it runs here), "torch"
    (never) or the kernel's package name (required: ValueError saying why it cannot run)."""
    package = KERNELS[form][0]
    if kernel not in ("auto", "torch", package):
        raise input_error("kernel", None, f"'auto', 'torch' or {package!r}", repr(kernel))
    if kernel == "torch":
        return False
    why = kernel_refusal(form, device)
    if why is not None and kernel == package:
        raise input_error("kernel", None, "a kernel that runs here ('auto' and 'torch' do)", f"{package!r}: {why}")
    return why is None


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    row: PackedRow,
    *,
    activation: str | Callable | None = None,
    kernel: str = "auto",
) -> Tensor:
    """(C, T) channels by the tokens of a packed row -> (C, T): each sequence's depthwise causal conv
    (``weight`` (C, K)), as if it ran alone: taps never reach into the previous sequence.

    ``kernel``: "auto" runs causal-conv1d (seq_idx) where it is installed, on CUDA, and passed its
    probe, with a ``silu`` or no activation; "torch" the torch form (:func:`torch_causal_conv1d`);
    "causal-conv1d" requires the kernel. Shapes, dtypes and the activation are checked here (no op,
    no sync): a bad one is a ValueError naming the argument, what was expected and what came. A
    :class:`SharedPrefixRow` runs the shared-prefix form in torch (K gathers): causal-conv1d takes no
    initial states with ``seq_idx``, so ``kernel="causal-conv1d"`` is refused there, saying so.
    """
    _check_conv(x, weight, bias, row, activation)
    if isinstance(row, SharedPrefixRow):
        _torch_only("causal_conv1d", kernel)
        return _shared_causal_conv1d(x, weight, bias, row, activation)
    if activation in (None, "silu", "swish") and _use_kernel("causal_conv1d", kernel, x.device):
        out = _conv_kernel(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), row, activation)
        return out.to(x.dtype)
    return torch_causal_conv1d(x, weight, bias, row.position_ids, activation=activation)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    row: PackedRow,
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    kernel: str = "auto",
) -> Tensor:
    """The chunked gated delta rule of each sequence of a packed row, its state reset at every start.

    q, k (T, H_k, D_k); v (T, H, D_v); g (T, H); beta (T, H) -> (T, H, D_v): see
    :func:`torch_gated_delta_rule`. ``kernel``: "auto" runs flash-linear-attention's
    ``chunk_gated_delta_rule(cu_seqlens=...)`` where it is installed, on CUDA, and passed its
    probe (with its own chunking); "torch" the torch form; "flash-linear-attention" requires it.
    Shapes, dtypes and ``chunk_size`` are checked here (no op, no sync). A :class:`SharedPrefixRow`
    runs the shared-prefix form with the same choice: fla (its ``initial_state`` per sequence, the
    gradient into each prompt's final state returned) or the torch form, its probe covering both.
    """
    _check_gdn(q, k, v, g, beta, row, chunk_size, use_qk_l2norm)
    form = _gdn_form(_use_kernel("gated_delta_rule", kernel, q.device), chunk_size, scale, use_qk_l2norm)
    if isinstance(row, SharedPrefixRow):
        return _shared_run(form, row, q=q, k=k, v=v, g=g, beta=beta).to(q.dtype)
    return form(q, k, v, g, beta, row)[0].to(q.dtype)


def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    row: PackedRow,
    *,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    kernel: str = "auto",
) -> Tensor:
    """Mamba2's chunked state-space scan of each sequence of a packed row, its state reset at every start.

    x (T, H, P); dt (T, H); A (H,); B, C (T, G, N) -> (T, H, P) float32: see :func:`torch_ssd_scan`.
    ``kernel``: "auto" runs mamba-ssm's ``mamba_chunk_scan_combined(seq_idx=...)`` where it is
    installed, on CUDA, and passed its probe; "torch" the torch form; "mamba-ssm" requires it.
    Shapes, dtypes and ``chunk_size`` are checked here (no op, no sync). A :class:`SharedPrefixRow`
    runs the shared-prefix form in torch: mamba-ssm takes one initial state per batch row (its
    ``seq_idx`` zeroes the state at every later sequence), not one per completion, so
    ``kernel="mamba-ssm"`` is refused there, saying so.
    """
    options: dict[str, Any] = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    _check_ssd(x, dt, A, B, C, row, chunk_size, options)
    if isinstance(row, SharedPrefixRow):
        _torch_only("ssd_scan", kernel)
        tokens = dict(x=x, dt=dt, B=B, C=C, z=options.pop("z"))
        return _shared_run(functools.partial(torch_ssd_scan, A=A, chunk_size=chunk_size, **options), row, **tokens)
    if _use_kernel("ssd_scan", kernel, x.device):
        return _ssd_kernel(x, dt, A, B, C, row, chunk_size, **options).float()
    return torch_ssd_scan(x, dt, A, B, C, row, chunk_size=chunk_size, **options)[0]


# ---- packed forms registered for whole modules ---------------------------------------------------------

REGISTERED: dict[type, Callable] = {}


def register_packed_module(cls: type, packed_forward: Callable) -> None:
    """Serve every module of class ``cls`` (subclasses included) with ``packed_forward`` in packed forwards.

    ``packed_forward(module, row, *args, **kwargs)`` is called instead of ``module.forward(*args,
    **kwargs)`` when the forward is packed, with ``row`` the :class:`PackedRow` of its sequences;
    the layer's args are those of one packed row (batch 1). A forward that is not packed runs
    ``module.forward`` as before. The layer must receive the model's kwargs (``cu_seq_lens_q``), as
    transformers' layers do; one that does not is refused when it runs. A class registered here is
    served even where nopad would refuse it: the registration is the caller's word that its form
    keeps the sequences apart.
    """
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise input_error("cls", None, "a torch.nn.Module subclass", repr(cls))
    if not callable(packed_forward):
        raise input_error("packed_forward", None, "a callable (module, row, *args, **kwargs)", repr(packed_forward))
    REGISTERED[cls] = packed_forward


def registered_form(cls: type) -> Callable | None:
    """The packed form registered for ``cls`` or its nearest registered base, or None."""
    return next((REGISTERED[klass] for klass in cls.__mro__ if klass in REGISTERED), None)
