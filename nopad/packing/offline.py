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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from nopad.packing.algorithms import ALGORITHMS, pack_lengths
from nopad.packing.rows import Columns, Row, aligned, conversation_segment, join_segments, validate_columns

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


def _check_config(pack_length: int, alignment: int, overflow: str, algorithm: str) -> None:
    if alignment < 1 or pack_length < 1 or pack_length % alignment:
        raise ValueError(f"pack_length: expected a positive multiple of the alignment {alignment}, got {pack_length}")
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow: expected one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {sorted(ALGORITHMS)}, got {algorithm!r}")


def _pieces(
    index: int, ids: Sequence[int], mask: Sequence[int], report: PackReport, overflow: str
) -> list[tuple[Sequence[int], Sequence[int]]]:
    """A conversation -> the pieces to pack under the overflow policy (recorded in ``report``)."""
    n = len(ids)
    report.conversations += 1
    if n == 0:
        report.rejected_empty.append(index)
        return []
    if aligned(n, report.alignment) <= report.pack_length:
        return [(ids, mask)]
    if overflow == "reject":
        report.rejected_too_long.append(index)
        return []
    step = report.pack_length
    report.split.append(index)
    report.split_pieces += -(-n // step)
    return [(ids[s : s + step], mask[s : s + step]) for s in range(0, n, step)]


def pack_conversations(
    conversations: Iterable[tuple[Sequence[int], Sequence[int]]],
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
    """
    _check_config(pack_length, alignment, overflow, algorithm)
    report = PackReport(pack_length=pack_length, alignment=alignment)
    segments: list[Row] = []
    rows: list[Row] = []
    open_row: list[Row] = []
    fill = 0
    for index, (ids, mask) in enumerate(conversations):
        if len(mask) != len(ids):
            raise ValueError(f"loss_mask conversation {index}: expected {len(ids)} entries like ids, got {len(mask)}")
        for piece_ids, piece_mask in _pieces(index, ids, mask, report, overflow):
            seg = conversation_segment(piece_ids, piece_mask, alignment, pad_token_id)
            report.real_tokens += len(piece_ids)
            if algorithm != "concatenative":
                segments.append(seg)
                continue
            m = len(seg["input_ids"])
            if fill + m > pack_length:
                rows.append(join_segments(open_row))
                open_row, fill = [], 0
            open_row.append(seg)
            fill += m
            if fill == pack_length:  # exact fill closes the row now: no zero-length segment can follow
                rows.append(join_segments(open_row))
                open_row, fill = [], 0
    if open_row:
        rows.append(join_segments(open_row))
    if segments:
        bins = pack_lengths([len(s["input_ids"]) for s in segments], pack_length, algorithm=algorithm)
        rows = [join_segments([segments[i] for i in sorted(b)]) for b in bins]
    report.rows = len(rows)
    report.packed_conversations = sum(len(r["packed_cu_seqlens"]) - 1 for r in rows)
    report.row_tokens = int(sum(len(r["input_ids"]) for r in rows))
    validate_columns(Columns.from_rows(rows), pack_length=pack_length, alignment=alignment)
    return rows, report


def row_lengths(rows: Sequence[Row]) -> np.ndarray:
    return np.array([len(r["input_ids"]) for r in rows], dtype=np.int64)
