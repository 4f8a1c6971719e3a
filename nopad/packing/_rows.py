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

from nopad.core._errors import input_error
from nopad.core._layout import host_offsets, host_starts, prepare_offsets, row_ids_of

ROW_FIELDS = ("input_ids", "target_ids", "token_mask", "position_ids", "packed_cu_seqlens")
TOKEN_FIELDS = ROW_FIELDS[:4]
Row = dict[str, np.ndarray]


TokenSeq = Sequence[int] | np.ndarray


def concatenate_segments(parts: Sequence[TokenSeq], spare: np.ndarray, fill: int, out: np.ndarray) -> None:
    """Segments end to end into ``out``, each followed by ``spare[k]`` copies of ``fill`` (its alignment padding).

    One pass over the tokens: numpy arrays are read in place, lists converted once. ``out`` must
    hold exactly the total; a part that is not a 1-D sequence of integers raises numpy's
    ValueError or TypeError (the caller names the conversation).
    """
    if not len(parts):
        return
    widest = int(spare.max())
    if widest == 0:
        np.concatenate(parts, out=out, casting="same_kind")
        return
    blocks = [np.full(r, fill, dtype=np.int64) for r in range(widest + 1)]
    interleaved: list[TokenSeq] = [blocks[0]] * (2 * len(parts))
    interleaved[0::2] = parts
    interleaved[1::2] = [blocks[r] for r in spare.tolist()]
    np.concatenate(interleaved, out=out, casting="same_kind")


def restarting_positions(padded: np.ndarray, out: np.ndarray) -> None:
    """0, 1, ..., padded[k] - 1 for every segment k, end to end into ``out`` (views of one arange)."""
    if len(padded):
        count = np.arange(int(padded.max()), dtype=np.int64)
        np.concatenate([count[:m] for m in padded.tolist()], out=out)


def boundaries(padded: np.ndarray, row_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment lengths in row order and how many segments each row holds -> packed_cu_seqlens, flat
    (each row's ``[0, b_1, ..., L]``) and its (rows+1,) offsets."""
    rows, segs = len(row_sizes), len(padded)
    cu = host_offsets(padded)
    row_start = cu[host_starts(row_sizes)]  # where each row's first segment starts
    offsets = host_offsets(row_sizes + 1)
    flat = np.zeros(segs + rows, dtype=np.int64)  # each row's leading 0 stays
    segment_slot = np.arange(segs) + np.repeat(np.arange(1, rows + 1), row_sizes)
    flat[segment_slot] = cu[1:] - np.repeat(row_start, row_sizes)
    return flat, offsets


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

    def rows(self) -> list[Row]:
        """Every row, each field a view of the flat column (no copy)."""
        bounds = {f: self.offsets[f].tolist() for f in self.values}
        return [{f: self.values[f][bounds[f][i] : bounds[f][i + 1]] for f in self.values} for i in range(self.num_rows)]

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, np.ndarray]]) -> Columns:
        """Rows -> columns. Rows that are back-to-back views of one flat array per field (what
        :meth:`rows` and the packer hand out) give views of that array, not a copy: read-only use."""
        values, offsets = {}, {}
        for f in ROW_FIELDS:
            parts = [np.asarray(r[f], dtype=np.int64) for r in rows]
            joined = _back_to_back(parts)
            values[f] = joined if joined is not None else np.concatenate([np.zeros(0, dtype=np.int64), *parts])
            offsets[f] = host_offsets([len(p) for p in parts])
        return cls(values, offsets)

    def checksum(self) -> str:
        """sha256 over every field's offsets and values (int64 little-endian), in field order."""
        h = hashlib.sha256()
        for f in ROW_FIELDS:
            h.update(f.encode())
            h.update(np.ascontiguousarray(self.offsets[f], dtype="<i8").data)  # hashed in place, not copied
            h.update(np.ascontiguousarray(self.values[f], dtype="<i8").data)
        return h.hexdigest()


def _back_to_back(parts: Sequence[np.ndarray]) -> np.ndarray | None:
    """``np.concatenate(parts)`` without the copy when the parts are consecutive 1-D slices of one
    contiguous int64 array (each starts where the one before ends); None otherwise (and for no parts
    at all, which the caller concatenates into an empty array)."""
    if not parts or parts[0].base is None:
        return None
    base = parts[0].base
    if not (isinstance(base, np.ndarray) and base.ndim == 1 and base.dtype == np.int64 and base.flags.c_contiguous):
        return None
    address = base.__array_interface__["data"][0]
    start = parts[0].__array_interface__["data"][0]
    end = start
    for part in parts:
        if part.base is not base or part.ndim != 1 or (part.strides != (8,) and len(part) > 1):
            return None
        if part.__array_interface__["data"][0] != end:
            return None
        end += 8 * len(part)
    return base[(start - address) // 8 : (end - address) // 8]


def _row_ids(lengths: np.ndarray, total: int) -> np.ndarray:
    return row_ids_of(prepare_offsets(torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int64))), total).numpy()


def _first(bad: np.ndarray) -> int | None:
    """Index of the first True, or None: argmax stops at the first True of a boolean array."""
    if not bad.size:
        return None
    i = int(bad.argmax())
    return i if bad[i] else None


def _first_outside(values: np.ndarray, high: int) -> int | None:
    """Index of the first value < 0 or >= ``high``, or None.

    Read as unsigned, a negative is huge, so one max over the column (read only) settles the
    common case; the index is looked for only when there is one.
    """
    if not values.size:
        return None
    if values.dtype.kind == "i":
        values = values.view(np.dtype(f"u{values.dtype.itemsize}"))
    elif values.dtype.kind != "u":
        return _first((values < 0) | (values >= high))
    return None if values.max() < high else _first(values >= high)


def validate_columns(
    cols: Columns,
    *,
    pack_length: int,
    alignment: int = 1,
    vocab_size: int | None = None,
    pad_token_id: int | None = None,
) -> None:
    """Check every row; raise ValueError naming the field, the first bad row and what was expected.

    The per-token checks are comparisons over the flat columns (a handful of passes, no Python
    loop over rows or tokens); a bad token is traced back to its row only once one is found. With
    ``pad_token_id`` (a file's), the label of every conversation's last slot must be it: no token
    follows there, so the packer wrote the pad id, and a file whose metadata names another pad id
    was packed with another.
    """
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
    # which row each boundary belongs to: layout's one token -> sequence derivation, over boundaries
    row_of_boundary = _row_ids(counts, cu.shape[0])
    bad_seg = inside & ((seg_len <= 0) | (seg_len % alignment != 0))
    if bad_seg.any():
        fail_row("packed_cu_seqlens", int(row_of_boundary[np.flatnonzero(bad_seg)[0]]), boundary_expect)

    # every conversation's first and last token in the flat run of every row's tokens: the
    # boundaries now tile each row, so the conversations tile the run
    starts_mask = np.ones(cu.shape, dtype=bool)
    starts_mask[cu_off[1:] - 1] = False  # the row-length boundary starts nothing
    seg_first = tok_off[row_of_boundary[starts_mask]] + cu[starts_mask]
    seg_last = np.empty_like(seg_first)
    seg_last[:-1] = seg_first[1:] - 1
    seg_last[-1:] = tok_off[-1] - 1

    def fail_token(field: str, t: int | None, expected: str) -> None:
        if t is not None:  # the row holding token t: the last row starting at or before it
            fail_row(field, int(np.searchsorted(tok_off, t, side="right")) - 1, expected)

    pos, mask = cols.values["position_ids"], cols.values["token_mask"]
    ids, target = cols.values["input_ids"], cols.values["target_ids"]
    restart = "0, 1, ... restarting at every boundary"
    k = _first(pos[seg_first] != 0)  # every conversation starts at position 0 ...
    step_bad, label_bad = _first_step_and_label_errors(pos, mask, ids, target, seg_first)  # ... and steps by 1
    bad_tokens = ([] if k is None else [int(seg_first[k])]) + ([] if step_bad is None else [step_bad])
    fail_token("position_ids", min(bad_tokens, default=None), restart)
    fail_token("token_mask", _first_outside(mask, 2), "only 0 and 1")
    k = _first(mask[seg_last] != 0)
    fail_token("token_mask", None if k is None else int(seg_last[k]), "0 on the last token of every conversation")
    if pad_token_id is not None:
        k = _first(target[seg_last] != pad_token_id)
        expected = f"pad_token_id {pad_token_id} as the label of every conversation's last token (packed with another?)"
        fail_token("target_ids", None if k is None else int(seg_last[k]), expected)
    if vocab_size is not None:
        fail_token("input_ids", _first_outside(ids, vocab_size), f"token ids in [0, {vocab_size})")
        fail_token("target_ids", _first_outside(target, vocab_size), f"token ids in [0, {vocab_size})")
    # a label that counts is the next input id; a row's last token ends a conversation, so its
    # mask is 0 (checked above) and the id after it, the next row's first, is never compared
    fail_token("target_ids", label_bad, "the next input id wherever token_mask is 1")


_BLOCK = 1 << 16  # tokens per block of the elementwise checks: their temporaries stay in cache


def _first_step_and_label_errors(
    pos: np.ndarray, mask: np.ndarray, ids: np.ndarray, target: np.ndarray, seg_first: np.ndarray
) -> tuple[int | None, int | None]:
    """The first token whose position is not the one before plus 1 (conversations' first tokens
    exempt), and the first whose label counts (mask not 0) but is not the next input id; None if none.

    Both compare each token with its neighbour, so they run block by block over the flat columns,
    each block's comparisons written into the same small buffers: every column is read once.
    """
    pairs = len(pos) - 1  # token t against token t + 1
    width = max(min(_BLOCK, pairs), 0)
    step, bad, counted = np.empty(width, np.int64), np.empty(width, bool), np.empty(width, bool)
    step_bad = label_bad = None
    for lo in range(0, pairs, _BLOCK):
        hi = min(lo + _BLOCK, pairs)
        n = hi - lo
        if step_bad is None:
            np.not_equal(np.subtract(pos[lo + 1 : hi + 1], pos[lo:hi], out=step[:n]), 1, out=bad[:n])
            a, z = np.searchsorted(seg_first, [lo + 1, hi + 1])
            bad[seg_first[a:z] - 1 - lo] = False
            k = _first(bad[:n])
            step_bad = None if k is None else lo + k + 1
        if label_bad is None:
            np.not_equal(target[lo:hi], ids[lo + 1 : hi + 1], out=bad[:n])
            bad[:n] &= np.not_equal(mask[lo:hi], 0, out=counted[:n])
            k = _first(bad[:n])
            label_bad = None if k is None else lo + k
        if step_bad is not None and label_bad is not None:
            break
    return step_bad, label_bad
