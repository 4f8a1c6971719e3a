"""Packed rows: several conversations end to end in one row, and the checks every row must pass.

A row of length L holds conversations c_1..c_k, each padded to a multiple of ``alignment``:

    input_ids          (L,)   the tokens, alignment padding = pad id
    target_ids         (L,)   next-token labels, shifted within each conversation (pad where none)
    token_mask         (L,)   1 where the label counts toward the loss; always 0 on the last token of
                              a conversation and on padding, since that label belongs to no conversation
    position_ids       (L,)   0, 1, ... restarting for every conversation (padding keeps counting)
    packed_cu_seqlens  (k+1,) 0 = b_0 < b_1 < ... < b_k = L, each b_i - b_{i-1} a multiple of alignment

Validation is vectorised over a whole column (flat values + per-row offsets), so opening a file of
a million rows checks every row without a Python loop over them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nopad.errors import input_error
from nopad.layout import IndexPlan, prepare_position_ids, prepare_row_ids, round_up

ROW_FIELDS = ("input_ids", "target_ids", "token_mask", "position_ids", "packed_cu_seqlens")
TOKEN_FIELDS = ROW_FIELDS[:4]
Row = dict[str, np.ndarray]


def conversation_segment(ids: Sequence[int], loss_mask: Sequence[int], alignment: int, pad_token_id: int) -> Row:
    """One conversation -> its padded segment (input/target/mask/position, no boundaries)."""
    n = len(ids)
    m = round_up(n, alignment)
    seg = {
        "input_ids": np.full(m, pad_token_id, dtype=np.int64),
        "target_ids": np.full(m, pad_token_id, dtype=np.int64),
        "token_mask": np.zeros(m, dtype=np.int64),
        "position_ids": np.arange(m, dtype=np.int64),
    }
    seg["input_ids"][:n] = ids
    seg["target_ids"][: n - 1] = ids[1:]
    seg["token_mask"][: n - 1] = loss_mask[1:]  # label t is token t+1: its mask says whether to learn it
    return seg


def join_segments(segments: Sequence[Row]) -> Row:
    """Conversations end to end -> one row with its boundaries (no repeated boundary: lengths > 0)."""
    row = {f: np.concatenate([s[f] for s in segments]) for f in TOKEN_FIELDS}
    lengths = [len(s["input_ids"]) for s in segments]
    row["packed_cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return row


@dataclass
class Columns:
    """Rows stored column-wise: ``values[f]`` flat, ``offsets[f]`` (rows+1,) where each row starts."""

    values: dict[str, np.ndarray]
    offsets: dict[str, np.ndarray]

    @property
    def num_rows(self) -> int:
        return len(self.offsets["input_ids"]) - 1

    @property
    def row_lengths(self) -> np.ndarray:
        return np.diff(self.offsets["input_ids"])

    def row(self, i: int) -> Row:
        return {f: self.values[f][self.offsets[f][i] : self.offsets[f][i + 1]] for f in self.values}

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, np.ndarray]]) -> Columns:
        values, offsets = {}, {}
        for f in ROW_FIELDS:
            parts = [np.asarray(r[f], dtype=np.int64) for r in rows]
            values[f] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            offsets[f] = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        return cls(values, offsets)

    def checksum(self) -> str:
        """sha256 over every field's offsets and values (int64 little-endian), in field order."""
        h = hashlib.sha256()
        for f in ROW_FIELDS:
            h.update(f.encode())
            h.update(np.ascontiguousarray(self.offsets[f], dtype="<i8").tobytes())
            h.update(np.ascontiguousarray(self.values[f], dtype="<i8").tobytes())
        return h.hexdigest()


def _row_ids(lengths: np.ndarray, total: int) -> np.ndarray:
    return prepare_row_ids(torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int64)), total).numpy()


def validate_columns(cols: Columns, *, pack_length: int, alignment: int = 1, vocab_size: int | None = None) -> None:
    """Check every row; raise ValueError naming the field, the first bad row and what was expected."""
    missing = [f for f in ROW_FIELDS if f not in cols.values]
    if missing:
        raise input_error("columns", None, f"fields {list(ROW_FIELDS)}", f"missing {missing}")
    tok_off = cols.offsets["input_ids"]
    lens = np.diff(tok_off)

    def fail_row(field: str, r: int, expected: str) -> None:
        got = cols.row(r)[field].tolist()
        shown = got if len(got) <= 16 else got[:8] + ["..."] + got[-4:]
        raise input_error(f"{field}", r, f"{expected}", f"{shown} (row length {int(lens[r])})")

    def fail(field: str, rows_bad: np.ndarray, expected: str) -> None:
        if rows_bad.any():
            fail_row(field, int(np.flatnonzero(rows_bad)[0]), expected)

    for f in TOKEN_FIELDS[1:]:
        fail(f, np.diff(cols.offsets[f]) != lens, "as many entries as input_ids")
    fail("input_ids", (lens <= 0) | (lens > pack_length), f"1 to pack_length {pack_length} tokens")

    cu, cu_off = cols.values["packed_cu_seqlens"], cols.offsets["packed_cu_seqlens"]
    counts = np.diff(cu_off)
    fail("packed_cu_seqlens", counts < 2, "at least 2 boundaries [0, ..., row length]")
    first, last = cu[cu_off[:-1]], cu[cu_off[1:] - 1]
    boundary_expect = f"boundaries rising strictly from 0 to the row length in steps that are multiples of {alignment}"
    fail("packed_cu_seqlens", (first != 0) | (last != lens), boundary_expect)
    seg_len = np.diff(cu)
    inside = np.ones(seg_len.shape, dtype=bool)
    inside[cu_off[1:-1] - 1] = False  # a diff that straddles two rows is not a segment
    # which row each boundary, and each token, belongs to: layout's one token -> sequence derivation
    row_of_boundary = _row_ids(counts, cu.shape[0])
    bad_seg = inside & ((seg_len <= 0) | (seg_len % alignment != 0))
    if bad_seg.any():
        fail_row("packed_cu_seqlens", int(row_of_boundary[np.flatnonzero(bad_seg)[0]]), boundary_expect)

    # per token: its position in its conversation, and whether it ends one (layout's derivations,
    # over the conversations' boundaries in the flat run of every row's tokens)
    total = int(tok_off[-1])
    starts_mask = np.ones(cu.shape, dtype=bool)
    starts_mask[cu_off[1:] - 1] = False  # the row-length boundary starts nothing
    seg_offsets = torch.from_numpy(np.append(tok_off[row_of_boundary[starts_mask]] + cu[starts_mask], total))
    position_in_segment = prepare_position_ids(seg_offsets, total).numpy()
    ends = IndexPlan(seg_offsets.diff(), seg_offsets, total=total).last_token_mask.numpy()
    token_row = _row_ids(lens, total)

    def fail_tokens(field: str, bad: np.ndarray, expected: str) -> None:
        if bad.any():
            fail_row(field, int(token_row[np.flatnonzero(bad)[0]]), expected)

    pos, mask = cols.values["position_ids"], cols.values["token_mask"]
    ids, target = cols.values["input_ids"], cols.values["target_ids"]
    fail_tokens("position_ids", pos != position_in_segment, "0, 1, ... restarting at every boundary")
    fail_tokens("token_mask", (mask != 0) & (mask != 1), "only 0 and 1")
    fail_tokens("token_mask", ends & (mask != 0), "0 on the last token of every conversation")
    if vocab_size is not None:
        fail_tokens("input_ids", (ids < 0) | (ids >= vocab_size), f"token ids in [0, {vocab_size})")
        fail_tokens("target_ids", (target < 0) | (target >= vocab_size), f"token ids in [0, {vocab_size})")
    next_ids = np.append(ids[1:], 0)
    fail_tokens("target_ids", (mask == 1) & (target != next_ids), "the next input id wherever token_mask is 1")
