"""Collate packed rows into one TensorDict, and read a collated batch back as nested conversations.

    input_ids, target_ids, token_mask, position_ids   (N, L) int64, L = the longest row; shorter rows
                                                      are padded (pad id, mask 0, position 0)
    packed_cu_seqlens                                 (N, K) int64, each row's boundaries padded with -1
    packed_cu_seqlens_lengths                         (N,) how many of the K entries are real
    packed_max_seqlen                                 (N,) the longest conversation in each row
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from nopad.packing.rows import ROW_FIELDS, TOKEN_FIELDS, Columns, validate_columns


def _padded(values: np.ndarray, offsets: np.ndarray, width: int, fill: int) -> np.ndarray:
    """Flat values + row offsets -> (rows, width) filled with ``fill`` past each row's end."""
    rows = len(offsets) - 1
    lens = np.diff(offsets)
    out = np.full((rows, width), fill, dtype=np.int64)
    row = np.repeat(np.arange(rows), lens)
    out[row, np.arange(len(values)) - offsets[row]] = values
    return out


def collate_packed(
    rows: Sequence[Mapping[str, object]], *, pad_token_id: int = 0, alignment: int = 1
) -> TensorDict:
    """Packed rows (dicts with the fields of rows.py) -> TensorDict of batch size [N].

    Every row is validated (boundaries, positions, labels; segments multiples of ``alignment``).
    A batch mixing packed rows with unpacked ones (no ``packed_cu_seqlens``) is refused: packed
    rows carry their own boundaries and must never be re-grouped with rows that do not.
    """
    if not rows:
        raise ValueError("rows: expected at least one packed row, got an empty batch")
    unpacked = [i for i, r in enumerate(rows) if "packed_cu_seqlens" not in r]
    if unpacked:
        kind = "a mix of packed and unpacked rows" if len(unpacked) < len(rows) else "only unpacked rows"
        raise ValueError(
            f"rows: expected every row packed (with packed_cu_seqlens), got {kind}: rows {unpacked[:8]} lack it"
        )
    for i, r in enumerate(rows):
        missing = [f for f in ROW_FIELDS if f not in r]
        if missing:
            raise ValueError(f"row {i}: expected fields {list(ROW_FIELDS)}, missing {missing}")
    cols = Columns.from_rows([{f: np.asarray(r[f]) for f in ROW_FIELDS} for r in rows])  # type: ignore[misc]
    width = int(cols.row_lengths.max())
    validate_columns(cols, pack_length=width, alignment=alignment)
    fills = {"input_ids": pad_token_id, "target_ids": pad_token_id, "token_mask": 0, "position_ids": 0}
    data = {f: _padded(cols.values[f], cols.offsets[f], width, fills[f]) for f in TOKEN_FIELDS}
    cu_off = cols.offsets["packed_cu_seqlens"]
    counts = np.diff(cu_off)
    cu = _padded(cols.values["packed_cu_seqlens"], cu_off, int(counts.max()), -1)
    seg = np.diff(cu, axis=1)
    seg[np.arange(seg.shape[1])[None, :] >= (counts - 1)[:, None]] = 0
    data["packed_cu_seqlens"] = cu
    data["packed_cu_seqlens_lengths"] = counts
    data["packed_max_seqlen"] = seg.max(axis=1)
    return TensorDict({k: torch.from_numpy(v) for k, v in data.items()}, batch_size=[len(rows)])


def packed_segment_lengths(batch: TensorDict) -> Tensor:
    """(S,) padded length of every conversation segment, row by row. One host sync (S)."""
    cu = batch["packed_cu_seqlens"]
    count = batch["packed_cu_seqlens_lengths"]
    k = torch.arange(cu.shape[1] - 1, device=cu.device)
    real = k.unsqueeze(0) < (count - 1).unsqueeze(1)
    return (cu[:, 1:] - cu[:, :-1])[real]


def packed_to_nested(batch: TensorDict, fields: Sequence[str] = TOKEN_FIELDS) -> dict[str, Tensor]:
    """Collated packed rows -> one jagged nested (S, j) tensor per field, one sequence per segment.

    Row padding past each row's last boundary is dropped; segments keep their alignment padding.
    Two host syncs (the segment count and the token count), whatever the batch size.
    """
    if "packed_cu_seqlens" not in batch.keys():
        raise ValueError("batch: expected packed rows carrying packed_cu_seqlens, got an unpacked batch")
    lengths = packed_segment_lengths(batch)
    cu, count = batch["packed_cu_seqlens"], batch["packed_cu_seqlens_lengths"]
    row_len = cu.gather(1, (count - 1).unsqueeze(1))  # (N, 1) the last real boundary
    width = batch["input_ids"].shape[1]
    real = torch.arange(width, device=cu.device).unsqueeze(0) < row_len
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    return {f: torch.nested.nested_tensor_from_jagged(batch[f][real], offsets) for f in fields}
