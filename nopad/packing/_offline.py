"""Offline packing: tokenized conversations -> rows of at most ``pack_length`` tokens, ahead of training.

Each conversation is first padded to the THD alignment (2*cp*tp with context parallelism), then
placed into rows by a bin-packing algorithm; the default, ``"concatenative"``, keeps the input
order and streams (a row closes when the next conversation does not fit, or as soon as it is
exactly full, so an exact fill never produces a repeated boundary: seed 002).

A conversation whose padded length exceeds ``pack_length`` is handled by an explicit policy and
counted in the :class:`PackReport`: ``"split"`` cuts it into pieces of ``pack_length`` tokens, each
packed as its own conversation (the label across a cut is lost: attention cannot cross it);
``"reject"`` leaves it out. Empty conversations are always rejected and counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nopad.core._errors import check_int, input_error
from nopad.core._layout import ceil_div, host_offsets, host_ranges, host_starts, round_up
from nopad.packing._algorithms import ALGORITHMS, bin_of_items
from nopad.packing._rows import (
    TOKEN_FIELDS,
    Columns,
    Row,
    TokenSeq,
    boundaries,
    concatenate_segments,
    restarting_positions,
    validate_columns,
)

OVERFLOW_POLICIES = ("split", "reject")


@dataclass
class PackReport:
    """What happened to every conversation; nothing is dropped without being listed here."""

    pack_length: int
    alignment: int
    conversations: int = 0
    packed_conversations: int = 0  # segments in rows (a split conversation counts once per piece)
    rows: int = 0
    real_tokens: int = 0  # conversation tokens, excluding alignment padding
    row_tokens: int = 0  # tokens stored in rows, alignment padding included
    split: list[int] = field(default_factory=list)  # indices of conversations that were split
    split_pieces: int = 0
    rejected_too_long: list[int] = field(default_factory=list)
    rejected_empty: list[int] = field(default_factory=list)

    @property
    def utilisation(self) -> float:
        """Real tokens over rows * pack_length."""
        return self.real_tokens / (self.rows * self.pack_length) if self.rows else 0.0

    def summary(self) -> dict[str, int | float]:
        return {
            "conversations": self.conversations,
            "rows": self.rows,
            "packed_segments": self.packed_conversations,
            "real_tokens": self.real_tokens,
            "padding_tokens": self.row_tokens - self.real_tokens,
            "split": len(self.split),
            "split_pieces": self.split_pieces,
            "rejected_too_long": len(self.rejected_too_long),
            "rejected_empty": len(self.rejected_empty),
            "utilisation": round(self.utilisation, 6),
        }


def _check_config(
    pack_length: Any, alignment: Any, pad_token_id: Any, overflow: Any, algorithm: Any
) -> tuple[int, int, int]:
    """THE check of pack_conversations' settings; returns pack_length, alignment, pad_token_id as ints."""
    alignment = check_int(alignment, "alignment", low=1)
    pack_length = check_int(pack_length, "pack_length", low=1)
    pad_token_id = check_int(pad_token_id, "pad_token_id", low=0)
    if pack_length % alignment:
        raise input_error("pack_length", None, f"a positive multiple of the alignment {alignment}", f"{pack_length}")
    if not isinstance(overflow, str) or overflow not in OVERFLOW_POLICIES:
        raise input_error("overflow", None, f"one of {OVERFLOW_POLICIES}", f"{overflow!r}")
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise input_error("algorithm", None, f"one of {sorted(ALGORITHMS)}", f"{algorithm!r}")
    return pack_length, alignment, pad_token_id


@dataclass
class _Conversations:
    """The input, as two lists read once from the iterable: each conversation's ids and loss mask."""

    ids: list[TokenSeq]
    masks: list[TokenSeq]

    @classmethod
    def read(cls, conversations: Iterable[tuple[TokenSeq, TokenSeq]]) -> _Conversations:
        """The pairs, as they come; numpy arrays are checked to hold integers (ids) or 0/1 numbers
        (masks) by their dtype: a bool array of ids would be cast to 0/1 tokens, a uint64 one past
        2**63 would wrap negative. Lists of ids are converted here, once, and checked the same way."""
        ids: list[TokenSeq] = []
        masks: list[TokenSeq] = []
        if not isinstance(conversations, Iterable):
            expected = "an iterable of (input_ids, loss_mask) pairs"
            raise input_error("conversations", None, expected, type(conversations).__name__)
        for pair in conversations:
            try:
                seq_ids, seq_mask = pair
            except (TypeError, ValueError):
                got = f"{type(pair).__name__}" + (f" of {len(pair)}" if isinstance(pair, Sized) else "")
                raise input_error(f"conversation {len(ids)}", None, "an (ids, loss_mask) pair", got) from None
            if isinstance(seq_ids, (list, tuple)):  # converted once here (concatenating would convert it anyway)
                try:
                    seq_ids = np.asarray(seq_ids)
                except (TypeError, ValueError, OverflowError):
                    pass  # named by explain_bad_tokens when the concatenation fails
            if isinstance(seq_ids, np.ndarray) and seq_ids.dtype.kind not in "iu" and seq_ids.size:
                got = f"shape {seq_ids.shape} dtype {seq_ids.dtype}"  # bools would be cast to ids 0 and 1
                raise input_error(
                    f"input_ids conversation {len(ids)}", None, "a 1-D sequence of integer token ids", got
                )
            if isinstance(seq_ids, np.ndarray) and seq_ids.dtype == np.uint64 and seq_ids.size:
                if seq_ids.max() >= 2**63:
                    what = "token ids below 2**63 (int64)"
                    raise input_error(f"input_ids conversation {len(ids)}", None, what, f"{int(seq_ids.max())}")
            ids.append(seq_ids)
            masks.append(seq_mask)
        return cls(ids, masks)

    def lengths(self) -> np.ndarray:
        """(N,) tokens per conversation; ValueError naming the first whose mask has another length."""
        try:
            lengths = np.fromiter(map(len, self.ids), dtype=np.int64, count=len(self.ids))
            mask_lengths = np.fromiter(map(len, self.masks), dtype=np.int64, count=len(self.masks))
        except TypeError:
            self.explain_bad_tokens()
            raise
        differ = np.flatnonzero(lengths != mask_lengths)
        if differ.size:
            k = int(differ[0])
            expected = f"{lengths[k]} entries like ids"
            raise input_error(f"loss_mask conversation {k}", None, expected, f"{mask_lengths[k]}")
        return lengths

    def explain_bad_tokens(self) -> None:
        """Raise a ValueError naming the first conversation whose ids or mask is not a 1-D sequence of
        integers (ids >= 0 and below 2**63). Called once a vectorised step failed; returns if none is
        found (the caller re-raises)."""
        for k, (seq_ids, seq_mask) in enumerate(zip(self.ids, self.masks)):
            for name, seq, kinds in (("input_ids", seq_ids, "iu"), ("loss_mask", seq_mask, "iub")):
                try:
                    arr = np.asarray(seq)
                except (TypeError, ValueError, OverflowError):
                    arr = np.asarray(None)
                if name == "input_ids" and arr.ndim == 1 and arr.dtype.kind in "iu" and arr.size:
                    if arr.min() < 0 or (arr.dtype.kind == "u" and arr.max() >= 2**63):
                        bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
                        raise input_error(f"{name} conversation {k}", None, "token ids in [0, 2**63)", f"{bad}")
                if arr.ndim != 1 or (arr.size and arr.dtype.kind not in kinds):
                    what = "integer token ids" if name == "input_ids" else "0 and 1"
                    got = f"shape {arr.shape} dtype {arr.dtype}" if arr.ndim else f"{type(seq).__name__}"
                    raise input_error(f"{name} conversation {k}", None, f"a 1-D sequence of {what}", got)

    def concatenate(self, parts: list[TokenSeq], spare: np.ndarray, fill: int, out: np.ndarray) -> None:
        """``parts`` (taken from these conversations) end to end into ``out``, a bad one named."""
        try:
            concatenate_segments(parts, spare, fill, out)
        except (TypeError, ValueError, OverflowError):
            self.explain_bad_tokens()
            raise


@dataclass
class _Segments:
    """The pieces to pack, in input order: a whole conversation, or a split conversation's piece."""

    conversation: np.ndarray  # (S,) which conversation
    start: np.ndarray  # (S,) first token inside it (0 unless split)
    length: np.ndarray  # (S,) real tokens
    split: bool  # whether any conversation was cut into pieces

    def take(self, seqs: list[TokenSeq], order: np.ndarray) -> list[TokenSeq]:
        """Each segment's tokens out of ``seqs`` (one entry per conversation), in ``order``.

        A whole conversation is passed as it is; only a split one's pieces are sliced.
        """
        conv = self.conversation[order].tolist()
        if not self.split:
            return [seqs[c] for c in conv]
        start, length = self.start[order].tolist(), self.length[order].tolist()
        return [seqs[c] if n == len(seqs[c]) else seqs[c][s : s + n] for c, s, n in zip(conv, start, length)]


def _segments(lengths: np.ndarray, report: PackReport, overflow: str) -> _Segments:
    """Conversation lengths -> the segments to pack under the overflow policy (recorded in ``report``).

    A conversation longer than ``pack_length`` (padded to the alignment, a divisor of it) is split
    into pieces of ``pack_length`` tokens, the last one shorter, or rejected. Empty ones are rejected.
    """
    step = report.pack_length
    empty, too_long = lengths == 0, lengths > step
    report.conversations = len(lengths)
    report.rejected_empty = np.flatnonzero(empty).tolist()
    if overflow == "reject":
        report.rejected_too_long = np.flatnonzero(too_long).tolist()
        pieces = (~empty & ~too_long).astype(np.int64)
    else:
        report.split = np.flatnonzero(too_long).tolist()
        pieces = ceil_div(lengths, step)
        report.split_pieces = int(pieces[too_long].sum())
    conversation = np.repeat(np.arange(len(lengths)), pieces)
    start = host_ranges(np.zeros_like(pieces), pieces) * step  # 0, step, 2 * step, ... inside each conversation
    length = np.minimum(lengths[conversation] - start, step)
    return _Segments(conversation, start, length, split=bool(report.split))


def _token_columns(
    convs: _Conversations, segments: _Segments, order: np.ndarray, alignment: int, pad: int
) -> dict[str, np.ndarray]:
    """The segments in ``order``, end to end, as the four token fields.

    input_ids and the loss mask are each concatenated once, in row order; target_ids and
    token_mask are those shifted by one, with the label of each conversation's last token and of
    its padding cleared (it would be the next conversation's first token).
    """
    real = segments.length[order]
    padded = round_up(real, alignment)
    total = int(padded.sum())
    input_ids = np.empty(total, dtype=np.int64)
    convs.concatenate(segments.take(convs.ids, order), padded - real, pad, input_ids)
    if total and input_ids.view(np.uint64).max() >= 2**63:  # a negative id (pad is >= 0): one read-only pass
        convs.explain_bad_tokens()
        raise input_error("input_ids", None, "token ids >= 0", f"{int(input_ids.min())}")
    shifted = np.empty(total + 1, dtype=np.int64)  # the mask of token t lands on token t - 1's slot
    convs.concatenate(segments.take(convs.masks, order), padded - real, 0, shifted[:total])
    _check_mask_values(shifted[:total], padded, segments.conversation[order])
    token_mask = shifted[1:]
    target_ids = np.empty(total, dtype=np.int64)
    target_ids[:-1] = input_ids[1:]
    no_label = host_ranges(host_starts(padded) + real - 1, padded - real + 1)
    token_mask[no_label] = 0
    target_ids[no_label] = pad
    position_ids = np.empty(total, dtype=np.int64)
    restarting_positions(padded, position_ids)
    return {"input_ids": input_ids, "target_ids": target_ids, "token_mask": token_mask, "position_ids": position_ids}


def _check_mask_values(mask: np.ndarray, padded: np.ndarray, conversation: np.ndarray) -> None:
    """Loss mask entries must be 0 or 1 (``mask``: every segment's, end to end, padding included).

    One read-only max over the mask (as unsigned, so a negative is huge); the culprit is looked
    for only when there is one.
    """
    unsigned = mask.view(np.uint64)
    if not unsigned.size or unsigned.max() <= 1:
        return
    t = int((unsigned > 1).argmax())
    k = int(np.searchsorted(np.cumsum(padded), t, side="right"))
    raise input_error(f"loss_mask conversation {int(conversation[k])}", None, "only 0 and 1", f"{int(mask[t])}")


def _columns(convs: _Conversations, segments: _Segments, bin_of: np.ndarray, alignment: int, pad: int) -> Columns:
    """Segments and the bin of each -> the rows as columns: bin by bin, input order inside a bin."""
    order = np.argsort(bin_of, kind="stable")
    values = _token_columns(convs, segments, order, alignment, pad)
    padded = round_up(segments.length[order], alignment)
    row_sizes = np.bincount(bin_of)  # segments per row: every bin holds at least one
    values["packed_cu_seqlens"], cu_off = boundaries(padded, row_sizes)
    row_off = host_offsets(padded)[host_offsets(row_sizes)]  # where each row's first segment starts
    return Columns(values, {f: row_off for f in TOKEN_FIELDS} | {"packed_cu_seqlens": cu_off})


def pack_conversations(
    conversations: Iterable[tuple[TokenSeq, TokenSeq]],
    pack_length: int,
    *,
    alignment: int = 1,
    pad_token_id: int = 0,
    overflow: str = "split",
    algorithm: str = "concatenative",
) -> tuple[list[Row], PackReport]:
    """(token ids, loss mask) pairs -> packed rows (dicts of int64 arrays, see rows.py) and a report.

    ``loss_mask[t]`` says whether token t is to be predicted; row field ``token_mask[t]`` is then
    ``loss_mask[t+1]`` (the label of position t is token t+1), 0 on each conversation's last token.
    Every produced row is validated before it is returned: the producer never emits a row the
    reader would refuse.

    ids and masks are 1-D sequences of integers (ids >= 0; masks of 0 and 1), lists or numpy
    arrays: arrays are read in place, lists converted once. A bool or float array of ids is
    refused, not cast; ``pack_length``, ``alignment`` and ``pad_token_id`` are ints (check_int).
    The rows are views of one flat array per field. No Python loop runs over tokens or rows; the
    loops over conversations only collect them, and the bin packing loops over their lengths.
    """
    pack_length, alignment, pad_token_id = _check_config(pack_length, alignment, pad_token_id, overflow, algorithm)
    convs = _Conversations.read(conversations)
    report = PackReport(pack_length=pack_length, alignment=alignment)
    segments = _segments(convs.lengths(), report, overflow)
    # every algorithm, concatenative included, comes from algorithms.py; segments keep input order in a row
    # (an exact fill closes a row under next fit too: no zero-length segment can follow)
    bin_of = bin_of_items(round_up(segments.length, alignment), pack_length, algorithm=algorithm)
    cols = _columns(convs, segments, bin_of, alignment, pad_token_id)
    validate_columns(cols, pack_length=pack_length, alignment=alignment)
    report.rows = cols.num_rows
    report.packed_conversations = len(segments.length)
    report.real_tokens = int(segments.length.sum())
    report.row_tokens = int(cols.offsets["input_ids"][-1])
    return cols.rows(), report
