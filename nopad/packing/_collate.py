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

from nopad.core._errors import check_int, check_integer_tensor, input_error
from nopad.core._layout import position_ids_of, prepare_offsets, row_ids_of, spread_over_tokens, to_host, wrap_jagged
from nopad.packing._rows import ROW_FIELDS, TOKEN_FIELDS, Columns, validate_columns

# The attribute that marks a nested mask as label-aligned (a packed file's token_mask): sft_loss
# (nopad/losses/_losses.py, which reads the same name) refuses such a mask given as a per-token loss_mask.
LABEL_ALIGNED_ATTR = "_nopad_label_aligned"


def _padded(values: np.ndarray, offsets: np.ndarray, width: int, fill: int) -> np.ndarray:
    """Flat values + row offsets -> (rows, width) filled with ``fill`` past each row's end."""
    rows = len(offsets) - 1
    lens = np.diff(offsets)
    out = np.full((rows, width), fill, dtype=np.int64)
    row = np.repeat(np.arange(rows), lens)
    out[row, np.arange(len(values)) - offsets[row]] = values
    return out


def _row_mappings(rows: object) -> Sequence[Mapping[str, object]]:
    if not isinstance(rows, Sequence) or isinstance(rows, (str, bytes)):
        raise input_error("rows", None, "a sequence of packed rows (dicts of arrays)", type(rows).__name__)
    for i, r in enumerate(rows):
        if not isinstance(r, Mapping):
            raise input_error("rows", i, "a dict of the row fields", type(r).__name__)
    return rows


def check_row_arrays(rows: object) -> None:
    """Rows must be a sequence of mappings holding every row field as a 1-D integer array or list.

    Nothing is converted silently: a float, bool or 2-D field is refused naming the row and field
    (np.asarray(..., dtype=int64) would round 2.5 to 2).
    """
    for i, r in enumerate(_row_mappings(rows)):
        missing = [f for f in ROW_FIELDS if f not in r]
        if missing:
            raise input_error("rows", i, f"fields {list(ROW_FIELDS)}", f"missing {missing}")
        for f in ROW_FIELDS:
            a = np.asarray(r[f])
            integer = a.dtype.kind == "i" or (a.dtype.kind == "u" and a.dtype.itemsize < 8)
            if a.ndim != 1 or not (integer or a.size == 0):
                raise input_error(f, i, "a 1-D array of integers", f"{a.ndim}-D {a.dtype}")


def negative_id_error(cols: Columns) -> ValueError | None:
    """The first negative input or target id, naming its row (no vocabulary size is needed to see it)."""
    for f in ("input_ids", "target_ids"):
        bad = np.flatnonzero(cols.values[f] < 0)
        if bad.size:
            row = int(np.searchsorted(cols.offsets[f], bad[0], side="right")) - 1
            return input_error(f, row, "token ids >= 0", f"{int(cols.values[f][bad[0]])}")
    return None


def collate_packed(rows: Sequence[Mapping[str, object]], *, pad_token_id: int = 0, alignment: int = 1) -> TensorDict:
    """Packed rows (dicts with the fields of rows.py) -> TensorDict of batch size [N].

    Every row is validated (boundaries, positions, labels; segments multiples of ``alignment``).
    A batch mixing packed rows with unpacked ones (no ``packed_cu_seqlens``) is refused: packed
    rows carry their own boundaries and must never be re-grouped with rows that do not.
    """
    _row_mappings(rows)
    if not rows:
        raise input_error("rows", None, "at least one packed row", "an empty batch")
    unpacked = [i for i, r in enumerate(rows) if "packed_cu_seqlens" not in r]
    if unpacked:
        kind = "a mix of packed and unpacked rows" if len(unpacked) < len(rows) else "only unpacked rows"
        raise input_error(
            "rows",
            None,
            "every row packed (with packed_cu_seqlens)",
            f"{kind}: rows {unpacked[:8]} lack it",
        )
    check_row_arrays(rows)
    pad_token_id = check_int(pad_token_id, "pad_token_id", low=0)
    alignment = check_int(alignment, "alignment", low=1)
    cols = Columns.from_rows([{f: np.asarray(r[f]) for f in ROW_FIELDS} for r in rows])  # type: ignore[misc]
    width = int(cols.row_lengths.max())
    validate_columns(cols, pack_length=width, alignment=alignment)
    if (negative := negative_id_error(cols)) is not None:
        raise negative
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


def _broken_rows(
    batch: TensorDict, cu: Tensor, count: Tensor, real: Tensor, seg: Tensor, row_len: Tensor, width: int
) -> Tensor:
    """(N,) rows whose boundaries do not describe their tokens: they do not run 0 < b_1 < ... <= the
    row's width with a count in [2, K], or (where the batch has positions) the positions are not
    0, 1, ... restarting at each boundary and 0 past the last one. A boundary moved into the row's
    padding, or a count that shrank and left real tokens past the last boundary, is caught here
    rather than feeding padding to the model or dropping tokens. Device ops only, no sync.
    """
    broken = (count < 2) | (count > cu.shape[1]) | (cu[:, 0] != 0) | (row_len > width)
    broken |= (real & (seg <= 0)).any(1)
    if "position_ids" in batch.keys():
        # the one a boundary starts: boundaries past a row's count set to width, so every slot finds
        # the last boundary at or before it (searchsorted over each row's sorted boundaries)
        k = torch.arange(cu.shape[1], device=cu.device).unsqueeze(0)
        starts = torch.where(k < count.unsqueeze(1), cu, width).contiguous()
        slot = torch.arange(width, device=cu.device).expand(cu.shape[0], width).contiguous()
        first = torch.searchsorted(starts, slot, right=True).sub_(1).clamp_(0, cu.shape[1] - 1)
        expected = slot - starts.gather(1, first)
        expected = expected.masked_fill_(slot >= row_len.unsqueeze(1), 0)
        broken |= (batch["position_ids"] != expected).any(1)
    return broken


def _broken_error(batch: TensorDict, broken: Tensor, cu: Tensor, count: Tensor, width: int) -> ValueError:
    """The error for the first row :func:`_broken_rows` flags (an error path: it reads the row)."""
    r = int(broken.nonzero()[0])
    n = int(count[r])
    bounds = cu[r, : max(0, min(n, cu.shape[1]))].tolist()
    expected = f"0 < b_1 < ... <= width {width}, with position_ids 0, 1, ... restarting at each and 0 past the last"
    return input_error(
        "packed_cu_seqlens",
        r,
        f"boundaries that match the row's tokens: {expected}",
        f"count {n}, boundaries {bounds}; collate the rows again (collate_packed)",
    )


def packed_to_nested(
    batch: TensorDict, fields: Sequence[str] = TOKEN_FIELDS, *, alignment: int = 1, context: str = ""
) -> dict[str, Tensor]:
    """Collated packed rows -> one jagged nested (S, j) tensor per field, one sequence per segment.

    Row padding past each row's last boundary is dropped; segments keep their alignment padding.
    Every segment must be a multiple of ``alignment`` (ValueError naming the row otherwise).
    ONE host sync (segment count, token count and the alignment check, fetched together),
    whatever the batch size: the gathers are computed from the boundaries, not by boolean masks.

    The fields share one offsets tensor, so the result is a micro-batch that the HF/FSDP engine
    takes as it is (``prepare_model_inputs`` reads ``input_ids`` and ``position_ids``) and that
    :func:`nopad.losses.sft_loss` takes with the log-probs: ``token_mask`` is label-aligned (1 where
    the NEXT token is learned), and sft_loss uses it as it is under that name. The returned
    ``token_mask`` is marked as label-aligned, so sft_loss also refuses it given as a per-token
    ``loss_mask`` (which it would shift a second time).
    """
    if not isinstance(batch, TensorDict) or "packed_cu_seqlens" not in batch.keys():
        got = "an unpacked batch" if isinstance(batch, TensorDict) else type(batch).__name__
        raise input_error("batch", None, "packed rows carrying packed_cu_seqlens", got)
    if isinstance(fields, str):
        raise input_error("fields", None, "a list of field names", f"the string {fields!r} (write [{fields!r}])")
    missing = [k for k in ("packed_cu_seqlens_lengths", "input_ids", *fields) if k not in batch.keys()]
    if missing:
        raise input_error("batch", None, "the fields of collate_packed or pack_online", f"missing {missing}")
    alignment = check_int(alignment, "alignment", low=1)
    cu, count = batch["packed_cu_seqlens"], batch["packed_cu_seqlens_lengths"]
    check_integer_tensor(cu, "packed_cu_seqlens")  # a dtype check (float boundaries would index nothing)
    check_integer_tensor(count, "packed_cu_seqlens_lengths")
    width = batch["input_ids"].shape[1]
    if cu.dim() != 2 or count.shape != cu.shape[:1]:
        got = f"packed_cu_seqlens {tuple(cu.shape)}, packed_cu_seqlens_lengths {tuple(count.shape)}"
        raise input_error("batch", None, "(N, K) boundaries and (N,) counts", got)
    segs_per_row = (count - 1).clamp_(0, cu.shape[1] - 1)
    seg = cu[:, 1:] - cu[:, :-1]  # (N, K-1); entries past a row's count are meaningless
    real = torch.arange(seg.shape[1], device=cu.device).unsqueeze(0) < segs_per_row.unsqueeze(1)
    row_len = cu.gather(1, segs_per_row.unsqueeze(1)).squeeze(1)
    misaligned = real & (seg % alignment != 0)
    broken = _broken_rows(batch, cu, count, real, seg, row_len, width)
    n_seg, total, bad, n_broken = to_host(segs_per_row.sum(), row_len.sum(), misaligned.any(), broken.any())
    if n_broken:
        raise _broken_error(batch, broken, cu, count, width)
    if bad:
        r = int(misaligned.any(1).nonzero()[0])
        raise input_error(
            "packed_cu_seqlens",
            r,
            f"segment lengths that are multiples of {alignment}{context}",
            f"boundaries {cu[r, : int(count[r])].tolist()}; repack for this parallel layout",
        )
    seg_offsets = prepare_offsets(segs_per_row)  # counted by this function: their sum is n_seg
    lengths = seg[row_ids_of(seg_offsets, n_seg), position_ids_of(seg_offsets, n_seg)]
    # token k of row r sits at r * width + k in the flattened rows
    row_offsets = prepare_offsets(row_len)
    rows = torch.arange(row_len.shape[0], device=cu.device)
    flat = spread_over_tokens(rows * width - row_offsets[:-1], row_offsets, total, plus_position=True)
    offsets = prepare_offsets(lengths)
    out = {f: wrap_jagged(batch[f].reshape(-1).index_select(0, flat), offsets) for f in fields}
    if "token_mask" in out:
        setattr(out["token_mask"], LABEL_ALIGNED_ATTR, True)
    return out
