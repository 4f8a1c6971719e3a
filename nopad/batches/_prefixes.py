"""A GRPO group's shared prompt once: the packed layout with shared prefixes and its plan.

GRPO samples each prompt n times, so n rows of a batch repeat the same prompt tokens. This layout
keeps each distinct prompt once, followed by each of its completions, in one packed row::

    rows (prompt | completion)        packed with shared prefixes
    0: A A A | x x                    A A A x x y z z w   (group of rows 0, 2: A's prompt, row 0's
    1: B | w                          completion, row 2's; then B's prompt and row 1's completion)
    2: A A A | y                      ^ row 0's block ^ row 2's block ^ row 1's block
                                       (leader)

Every row has one block: its completion, preceded by its group's prompt when it is the group's
leader (its first row). Attention sees one segment per row: the block's tokens as queries, the
row's whole sequence (the group's prompt, then its own completion) as keys, causal and aligned at
the end (flash-attn's bottom-right alignment), so a completion attends to its prompt and to its own
earlier tokens, never to a sibling, and a prompt attends causally to itself. A batch without shared
prompts gives the plain packed layout (every block a whole row, queries and keys the same).

Groups are found from the tokens themselves: rows are sorted by prompt length and a hash of their
prompt tokens, and every row is then compared token by token with its group's leader. A hash
collision costs sharing, never exactness (a row unequal to its leader leads its own group). Group
ids a trainer gives are used as the sort key instead and verified the same way: a group whose rows
hold different prompts is refused.

Shapes: B rows, N = the rows' tokens (prompts and completions), T = the packed row's tokens,
C = the attention's query tile. Built in a fixed number of ops whatever B, with one host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nopad.core._errors import check_int, check_integer_tensor, input_error
from nopad.core._layout import (
    as_lengths,
    ceil_div,
    check_nested,
    gather_index_dtype,
    nested_offsets,
    position_ids_of,
    prepare_offsets,
    ranges_of,
    row_ids_of,
    spread_over_tokens,
    to_host,
)
from nopad.core._torch_internals import jagged_values, wrap_jagged

# 31-bit hashing: every product stays below 2**62, so int64 never overflows on any device
_M31 = 2**31 - 1
_HASH_KEYS = ((0x2545F491, 0x6C8E9CF5, 0x1B873593), (0x5BD1E995, 0x27D4EB2F, 0x165667B1))
QUERY_TILE = 128


@dataclass(frozen=True)
class SharedPrefixPlan:
    """Where every token of a batch of (prompt, completion) rows lives in the shared-prefix layout.

    Device tensors (rows in the batch's order unless said):
        prompt_lengths, completion_lengths: (B,) int64.
        row_offsets: (B+1,) int64 offsets of the rows' tokens (prompt then completion per row).
        group: (B,) int64 the group of each row, groups numbered by their first row.
        leader: (B,) int64 the row whose prompt its group's prompt is (the group's first row).
        block_order: (B,) int64 the rows in the packed row's order (by group, then by row).
        pack_index: (T,) the rows' token each packed token is (an index into the N row tokens).
        unpack_index: (N,) the packed token each row token reads (a shared prompt's tokens read the
            one copy): ``packed[unpack_index]`` gives every row back, prompt included.
        position_ids: (T,) each packed token's position in its own row (a completion continues from
            its prompt's length).
        cu_seqlens_q: (B+1,) int32 the attention's query segments over the packed row, one per
            row in block order: the row's block.
        cu_seqlens_k: (B+1,) int32 its key segments over the gathered keys: the row's whole sequence.
        kv_index: (N,) the packed token each gathered key is (rows in block order).
        completion_offsets: (B+1,) int64 offsets of the rows' completions (as nested responses).
        logprob_index: (M,) for each completion token (rows in order), the packed token whose logits
            give its log-prob: the one before it in its row, so a completion's first token reads
            its prompt's last position, shared by the group.
        label_index: (M,) the row token (an index into the N) each completion token is: its label.
        tile_q: (tiles * C,) the packed token of each query slot of the tiles (T for an empty slot).
        tile_k: (tiles * max_seqlen_k,) the packed token of each key slot of the tiles (T: empty).
        tile_end: (tiles, C) how many of its tile's keys each query slot may see (1 for an empty one).
        tile_out: (T,) the tile slot that holds each packed token's output.

    Host ints: rows B, groups, total T, rows_total N, max_seqlen_q, max_seqlen_k, tile C, tiles,
    completion_total M.
    """

    prompt_lengths: Tensor
    completion_lengths: Tensor
    row_offsets: Tensor
    group: Tensor
    leader: Tensor
    block_order: Tensor
    pack_index: Tensor
    unpack_index: Tensor
    position_ids: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    kv_index: Tensor
    completion_offsets: Tensor
    logprob_index: Tensor
    label_index: Tensor
    tile_q: Tensor
    tile_k: Tensor
    tile_end: Tensor
    tile_out: Tensor
    rows: int
    groups: int
    total: int
    rows_total: int
    max_seqlen_q: int
    max_seqlen_k: int
    tile: int
    tiles: int
    completion_total: int

    @property
    def shared(self) -> bool:
        """True when some prompt is computed once for several rows (else: the plain packed layout)."""
        return self.total < self.rows_total

    def pack(self, values: Tensor) -> Tensor:
        """(N, *) values of the rows' tokens -> (T, *) in the packed row (one gather, autograd flows)."""
        return values.index_select(0, self.pack_index)

    def unpack(self, packed: Tensor) -> Tensor:
        """(T, *) packed values -> (N, *) every row's tokens, a shared prompt's read by each of its rows."""
        return packed.index_select(0, self.unpack_index)

    def unpack_nested(self, packed: Tensor) -> Tensor:
        """(T, *) packed values -> (B, j, *) jagged rows (prompt then completion), as the input ids were."""
        return wrap_jagged(self.unpack(packed), self.row_offsets)


# ---- the groups ------------------------------------------------------------------------------------


def _mix(tokens: Tensor, positions: Tensor, keys: tuple[int, int, int]) -> Tensor:
    """(n,) tokens at (n,) positions -> (n,) 31-bit hashes: a multiply-xorshift of both."""
    a, b, c = keys
    x = ((tokens & _M31) * a + (positions + 1) * b) & _M31
    x = ((x ^ (x >> 15)) * c) & _M31
    return ((x ^ (x >> 13)) * a) & _M31


def prompt_keys(values: Tensor, rows: Tensor, positions: Tensor, in_prompt: Tensor, batch: int) -> Tensor:
    """(B,) int64 hash of each row's prompt tokens: two 31-bit sums of the tokens' position-mixed hashes.

    ``values``, ``rows``, ``positions``, ``in_prompt``: (N,) the row tokens, the row and position of
    each, and whether it is a prompt token. Equal prompts hash equal; unequal ones collide with odds
    about 2**-62, which costs sharing, never exactness (groups are verified token by token)."""
    parts, values = [], values.to(torch.int64)  # int32 ids would overflow the products
    for keys in _HASH_KEYS:
        mixed = _mix(values, positions, keys) * in_prompt
        parts.append(mixed.new_zeros(batch).index_add_(0, rows, mixed) & _M31)
    return (parts[0] << 31) | parts[1]


def _segment_leaders(key: Tensor, lengths: Tensor) -> Tensor:
    """(B,) the first row of each row's run of equal (key, length): rows sorted by both (stable: rows
    in order within a run), runs cut where either changes, each run's smallest row its leader."""
    batch = key.shape[0]
    order = torch.argsort(key, stable=True)
    order = order.index_select(0, torch.argsort(lengths.index_select(0, order), stable=True))
    sorted_key, sorted_len = key.index_select(0, order), lengths.index_select(0, order)
    changes = (sorted_key.diff() != 0) | (sorted_len.diff() != 0)
    run = F.pad(changes.to(torch.int64), (1, 0)).cumsum(0)  # (B,) run of each sorted row
    first = torch.full((batch,), batch, dtype=torch.int64, device=key.device)
    first = first.scatter_reduce(0, run, order, reduce="amin")
    return torch.empty_like(order).index_copy_(0, order, first.index_select(0, run))


def _unequal_to_leader(
    values: Tensor, offsets: Tensor, rows: Tensor, positions: Tensor, prompts: Tensor, leader: Tensor
) -> Tensor:
    """(B,) bool: the row's prompt differs from its leader's, in length or in any token."""
    batch = prompts.shape[0]
    leader_prompts = prompts.index_select(0, leader)
    leader_start = offsets.index_select(0, leader).index_select(0, rows)
    comparable = positions < torch.minimum(prompts, leader_prompts).index_select(0, rows)
    own = torch.arange(values.shape[0], device=values.device)
    other = values.index_select(0, torch.where(comparable, leader_start + positions, own))
    differs = ((other != values) & comparable).to(torch.int64)
    return (prompts.new_zeros(batch).index_add_(0, rows, differs) > 0) | (prompts != leader_prompts)


# ---- the plan --------------------------------------------------------------------------------------


def plan_shared_prefixes(
    input_ids: Tensor,
    prompt_lengths: Any,
    *,
    group_ids: Any = None,
    share: bool = True,
    tile: int = QUERY_TILE,
) -> SharedPrefixPlan:
    """(B, j) jagged rows of prompt then completion ids + (B,) prompt lengths -> the shared-prefix plan.

    ``group_ids``: (B,) integers, rows of one group meant to share their prompt; used instead of the
    hash and verified (a group whose rows' prompts differ is a ValueError naming the first such row).
    ``share=False`` gives every row its own group (the plain packed layout, for comparison).
    ``tile``: the query tile of the exact attention over the plan. Prompts must hold >= 1 token;
    completions may be empty (their row is its prompt; the block of a non-leader is then empty).
    A fixed number of ops whatever B; one host sync (the sizes, with the checks folded into it).
    """
    check_nested(input_ids, "input_ids")
    values = jagged_values(input_ids)
    check_integer_tensor(values, "input_ids")
    offsets = nested_offsets(input_ids).to(torch.int64)
    batch = offsets.shape[0] - 1
    prompts = as_lengths(prompt_lengths, "prompt_lengths").to(values.device)
    if prompts.shape != (batch,):
        raise input_error("prompt_lengths", None, f"({batch},) one per row", f"shape {tuple(prompts.shape)}")
    tile = check_int(tile, "tile", low=1)
    ids = None
    if group_ids is not None:
        ids = as_lengths(group_ids, "group_ids").to(values.device)
        if ids.shape != (batch,):
            raise input_error("group_ids", None, f"({batch},) one per row", f"shape {tuple(ids.shape)}")
    return _plan(values, offsets, prompts, ids, share, tile)


def _plan(
    values: Tensor, offsets: Tensor, prompts: Tensor, ids: Tensor | None, share: bool, tile: int
) -> SharedPrefixPlan:
    device, batch, n = values.device, prompts.shape[0], values.shape[0]
    row_range = torch.arange(batch, device=device)
    lengths = offsets.diff()
    given, prompts = prompts, prompts.clamp(min=0).minimum(lengths)  # in bounds until the check refuses
    completions = lengths - prompts
    rows, positions = row_ids_of(offsets, n), position_ids_of(offsets, n)
    in_prompt = positions < prompts.index_select(0, rows)
    if not share:
        found = leader = row_range
        bad = torch.zeros(batch, dtype=torch.bool, device=device)
    else:
        key = prompt_keys(values, rows, positions, in_prompt, batch) if ids is None else ids
        found = _segment_leaders(key, prompts if ids is None else torch.zeros_like(prompts))
        bad = _unequal_to_leader(values, offsets, rows, positions, prompts, found)
        leader = torch.where(bad, row_range, found)  # a collision: the row leads its own group
    is_leader = leader == row_range
    group = (is_leader.to(torch.int64).cumsum(0) - 1).index_select(0, leader)
    block_order = torch.argsort(group, stable=True)
    q_len = (completions + prompts * is_leader).index_select(0, block_order)
    k_len = lengths.index_select(0, block_order)
    bad_prompt = (given < 1) | (given > lengths)
    first_bad = torch.where(bad_prompt, row_range, batch).min()
    first_unequal = torch.where(bad, row_range, batch).min()
    total, groups, max_q, max_k, wrong_row, unequal_row, m = to_host(
        q_len.sum(), is_leader.sum(), q_len.max(), k_len.max(), first_bad, first_unequal, completions.sum()
    )
    if wrong_row < batch:
        got = f"{int(given[wrong_row])} of the row's {int(lengths[wrong_row])} tokens"
        raise input_error("prompt_lengths", wrong_row, "a prompt of at least 1 token, within its row", got)
    if ids is not None and unequal_row < batch:
        other = int(found[unequal_row])
        raise input_error(
            "group_ids",
            unequal_row,
            f"the prompt of row {other}, whose group id {int(ids[unequal_row])} it carries",
            "a prompt that differs from it (group ids must group rows of equal prompt tokens)",
        )
    cu_q, cu_k = prepare_offsets(q_len), prepare_offsets(k_len)
    skip = k_len - q_len  # the row's tokens before its block: its shared prompt, for a non-leader
    block_of_row = torch.empty_like(block_order).index_copy_(0, block_order, row_range)
    block_start = cu_q.index_select(0, block_of_row)  # (B,) row order
    prompt_start = block_start.index_select(0, leader)
    completion_start = block_start + prompts * is_leader
    starts_in_rows = offsets[:-1].index_select(0, block_order)
    pack_index = spread_over_tokens(starts_in_rows + skip - cu_q[:-1], cu_q, total, plus_position=True)
    position_ids = spread_over_tokens(skip - cu_q[:-1], cu_q, total, plus_position=True)
    # a row token reads the packed token at: its group's prompt, then its own completion
    firsts, spans = torch.stack([prompt_start, completion_start], 1), torch.stack([prompts, completions], 1)
    unpack_index = ranges_of(firsts.flatten(), spans.flatten(), n)  # (B, 2) ranges, rows in order
    kv_index = ranges_of(firsts.index_select(0, block_order).flatten(), spans.index_select(0, block_order).flatten(), n)
    label_index = ranges_of(offsets[:-1] + prompts, completions, m)
    logprob_index = unpack_index.index_select(0, label_index - 1)  # the token before, in its own row
    tile = max(1, min(tile, max_q))  # no tile longer than the longest block
    tiles = total // tile + batch  # enough for every block's last, partial tile
    tile_q, tile_k, tile_end, tile_out = _tiles(cu_q, cu_k, q_len, k_len, kv_index, total, tile, tiles, max_k)
    return SharedPrefixPlan(
        prompt_lengths=prompts,
        completion_lengths=completions,
        row_offsets=offsets,
        group=group,
        leader=leader,
        block_order=block_order,
        pack_index=pack_index,
        unpack_index=unpack_index,
        position_ids=position_ids,
        cu_seqlens_q=cu_q.to(torch.int32),
        cu_seqlens_k=cu_k.to(torch.int32),
        kv_index=kv_index,
        completion_offsets=prepare_offsets(completions),
        logprob_index=logprob_index,
        label_index=label_index,
        tile_q=tile_q,
        tile_k=tile_k,
        tile_end=tile_end,
        tile_out=tile_out,
        rows=batch,
        groups=groups,
        total=total,
        rows_total=n,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        tile=tile,
        tiles=tiles,
        completion_total=m,
    )


def _tiles(
    cu_q: Tensor,
    cu_k: Tensor,
    q_len: Tensor,
    k_len: Tensor,
    kv_index: Tensor,
    total: int,
    tile: int,
    tiles: int,
    max_k: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The query tiles of the exact attention: each row's block cut every ``tile`` queries, each tile
    with the keys of its row up to its last query (padded to ``max_k``). Tiles past the blocks' own
    are empty. Returns tile_q (tiles * C,), tile_k (tiles * max_k,), tile_end (tiles, C), tile_out (T,)."""
    device = cu_q.device
    tile_offsets = prepare_offsets(ceil_div(q_len, tile))
    block = row_ids_of(tile_offsets, tiles)  # tiles past the last block's are given it, and are empty
    first = position_ids_of(tile_offsets, tiles) * tile  # the tile's first query in its block
    count = (q_len.index_select(0, block) - first).clamp(0, tile)  # (tiles,) queries in the tile
    slot = torch.arange(tile, device=device)
    valid = slot < count.unsqueeze(1)
    tile_q = torch.where(valid, cu_q.index_select(0, block).unsqueeze(1) + first.unsqueeze(1) + slot, total)
    skip = (k_len - q_len).index_select(0, block).unsqueeze(1)
    tile_end = torch.where(valid, skip + first.unsqueeze(1) + slot + 1, 1)
    key = torch.arange(max_k, device=device)
    last = torch.where(count > 0, skip.squeeze(1) + first + count, 0)  # an empty tile reads no key
    seen = key < last.unsqueeze(1)
    gathered = F.pad(kv_index, (0, 1), value=total)  # slot N: an empty key
    key_slot = torch.where(seen, cu_k.index_select(0, block).unsqueeze(1) + key, kv_index.shape[0])
    # the largest index of the plan (tiles x max_k): int32 where it fits halves its memory
    tile_k = gathered.index_select(0, key_slot.flatten()).to(gather_index_dtype(total + 1))
    tile_out = spread_over_tokens(tile_offsets[:-1] * tile - cu_q[:-1], cu_q, total, plus_position=True)
    return tile_q.flatten(), tile_k, tile_end, tile_out


def join_prompts(prompts: Tensor, completions: Tensor) -> tuple[Tensor, Tensor]:
    """(B, j) jagged prompt ids + (B, j) jagged completion ids -> (B, j) jagged rows of both, and the
    (B,) prompt lengths: what :func:`plan_shared_prefixes` takes. One gather, no sync."""
    check_nested(prompts, "prompts")
    check_nested(completions, "completions")
    p_off, c_off = nested_offsets(prompts).to(torch.int64), nested_offsets(completions).to(torch.int64)
    if p_off.shape != c_off.shape:
        raise input_error("completions", None, f"{p_off.shape[0] - 1} rows like prompts", f"{c_off.shape[0] - 1}")
    p_vals, c_vals = jagged_values(prompts), jagged_values(completions)
    p_len, c_len = p_off.diff(), c_off.diff()
    firsts = torch.stack([p_off[:-1], p_vals.shape[0] + c_off[:-1]], 1).flatten()
    index = ranges_of(firsts, torch.stack([p_len, c_len], 1).flatten(), p_vals.shape[0] + c_vals.shape[0])
    return wrap_jagged(torch.cat([p_vals, c_vals]).index_select(0, index), p_off + c_off), p_len
