"""Online packing: a nested micro-batch -> packed rows of a token budget, at step time.

The bin packing runs on the host over the sequence lengths (one host sync to fetch them); moving
the tokens is a fixed number of tensor ops on the batch's device whatever the batch size. The
result has exactly the fields of a collated offline batch (collate.py), so both paths reach the
Megatron adapter through the same :func:`nopad.packing._thd.packed_to_thd`.
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from nopad.core._errors import check_int, input_error
from nopad.core._layout import (
    IndexPlan,
    check_nested,
    host_starts,
    jagged_values,
    nested_offsets,
    position_ids_of,
    round_up,
)
from nopad.packing._algorithms import ALGORITHMS, Bins, pack_lengths
from nopad.parallel._cp import CpLayout, cp_alignment


def bin_layout(bins: Bins, padded_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where each sequence goes: (bin, rank within bin, start slot within bin) per sequence, and bin fills.

    Sequences keep their input order inside a bin. Host numpy over the B lengths.
    """
    order = np.concatenate([np.sort(np.asarray(b, dtype=np.int64)) for b in bins]) if bins else np.zeros(0, np.int64)
    sizes = np.array([len(b) for b in bins], dtype=np.int64)
    bin_of_item = np.repeat(np.arange(len(bins)), sizes)
    first, begins = host_starts(sizes), host_starts(padded_lengths[order])
    seq_bin, seq_rank, seq_start = (np.empty_like(order) for _ in range(3))
    seq_bin[order] = bin_of_item
    seq_rank[order] = np.arange(len(order)) - first[bin_of_item]
    seq_start[order] = begins - begins[first][bin_of_item]
    fills = np.bincount(bin_of_item, weights=padded_lengths[order], minlength=len(bins)).astype(np.int64)
    return seq_bin, seq_rank, seq_start, fills


def _check_arguments(
    input_ids: object,
    loss_mask: object,
    pack_length: object,
    tp_size: object,
    cp_size: object,
    dp_size: object,
    min_bins: object,
    pad_token_id: object,
    algorithm: object,
) -> None:
    """Every argument's type and range, from host-side facts only (no sync)."""
    # dtype and device of the values tensors: a nested tensor's own attributes cost a Python dispatch
    ids = jagged_values(check_nested(input_ids, "input_ids", value_dims=1))
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise input_error("input_ids", None, "an integer dtype (token ids)", f"{ids.dtype}")
    if loss_mask is not None:
        mask = jagged_values(check_nested(loss_mask, "loss_mask", value_dims=1))
        if mask.device != ids.device:
            raise input_error("loss_mask", None, f"the device of input_ids ({ids.device})", f"{mask.device}")
        if mask.dtype.is_complex:
            raise input_error("loss_mask", None, "a bool, integer or float dtype of 0/1 values", f"{mask.dtype}")
    counts = {"pack_length": (pack_length, 1), "tp_size": (tp_size, 1), "cp_size": (cp_size, 1)}
    counts |= {"dp_size": (dp_size, 1), "min_bins": (min_bins, 0), "pad_token_id": (pad_token_id, 0)}
    for name, (value, low) in counts.items():
        check_int(value, name, low=low)
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise input_error("algorithm", None, f"one of {sorted(ALGORITHMS)}", f"{algorithm!r}")


def _value_flags(input_ids: Tensor, loss_mask: Tensor | None, offsets: Tensor) -> Tensor:
    """(3,) int64 on the batch's device: mask offsets differ, a mask value is not 0/1, an id is < 0.

    Device-side reductions only: they travel to the host with the lengths, in the one sync.
    """
    device = offsets.device
    negative = jagged_values(input_ids).lt(0).any().reshape(1)
    if loss_mask is None:
        return torch.cat([torch.zeros(2, dtype=torch.bool, device=device), negative]).to(torch.int64)
    mask_offsets = nested_offsets(loss_mask).to(torch.int64)
    if mask_offsets is offsets:
        differs = torch.zeros(1, dtype=torch.bool, device=device)
    elif mask_offsets.shape != offsets.shape:
        differs = torch.ones(1, dtype=torch.bool, device=device)
    else:
        differs = (mask_offsets != offsets).any().reshape(1)
    m = jagged_values(loss_mask)
    if m.dtype == torch.bool:  # 0/1 by construction
        not_01 = torch.zeros(1, dtype=torch.bool, device=device)
    else:
        not_01 = (m != 0).logical_and_(m != 1).any().reshape(1)  # NaN is neither
    return torch.cat([differs, not_01, negative]).to(torch.int64)


def _first_bad_row(field: str, x: Tensor, offsets: Tensor, expected: str) -> ValueError:
    """The error naming the first row with a bad value (an error path: its extra sync is fine)."""
    v = jagged_values(x)
    bad = (v < 0) if field == "input_ids" else (v != 0) & (v != 1)
    k = int(bad.nonzero()[0, 0])
    row = int(torch.searchsorted(offsets, torch.tensor(k, device=offsets.device), right=True)) - 1
    return input_error(field, row, expected, f"{v[k].item()!r}")


def pack_online(
    input_ids: Tensor,
    pack_length: int,
    *,
    loss_mask: Tensor | None = None,
    tp_size: int = 1,
    cp_size: int = 1,
    cp_layout: CpLayout = "zigzag",
    algorithm: str = "best_fit_decreasing",
    dp_size: int = 1,
    min_bins: int = 1,
    pad_token_id: int = 0,
) -> tuple[TensorDict, Bins]:
    """Nested (B, j) ids -> (packed rows TensorDict [N], bins: the sequence indices of each row).

    Each sequence is padded to the THD alignment of (tp, cp, layout) before packing into rows of at
    most ``pack_length`` tokens; N is a multiple of
    ``dp_size`` and at least ``min_bins``.
    ``loss_mask`` (nested like ``input_ids``, optional, default all ones) marks tokens to predict.
    A sequence longer than the budget raises ValueError (online packing never splits), and so does
    a mask value other than 0/1, a negative id, a float id dtype, a mask with other offsets or
    offsets that leave values outside every row (not from 0 to the values' end): each checked on
    the device and read in the one host sync (the lengths, which the bin packing needs); the token
    movement is a fixed number of tensor ops.
    """
    _check_arguments(input_ids, loss_mask, pack_length, tp_size, cp_size, dp_size, min_bins, pad_token_id, algorithm)
    offsets = nested_offsets(input_ids).to(torch.int64)
    lengths = offsets.diff()
    flags = _value_flags(input_ids, loss_mask, offsets)
    read = torch.cat([lengths, flags, offsets[[0, -1]]]).tolist()  # the one sync
    *lengths_list, mask_differs, mask_not_01, negative_ids, first, last = read
    if (first, last) != (0, jagged_values(input_ids).shape[0]):  # values before or after the rows: no row's
        expected = f"offsets from 0 to its {jagged_values(input_ids).shape[0]} values (each value in a row)"
        raise input_error("input_ids", None, expected, f"offsets {first}..{last}")
    if mask_differs:
        raise input_error("loss_mask", None, "the same offsets (sequence lengths) as input_ids", "different ones")
    if mask_not_01 and loss_mask is not None:
        raise _first_bad_row("loss_mask", loss_mask, offsets, "only 0 and 1 (a mask is not a weight)")
    if negative_ids:
        raise _first_bad_row("input_ids", input_ids, offsets, "token ids >= 0")
    lengths_host = np.asarray(lengths_list, dtype=np.int64)
    align = cp_alignment(tp_size, cp_size, cp_layout)
    padded = round_up(lengths_host, align)
    too_long = np.flatnonzero((padded > pack_length) | (lengths_host < 1))
    if too_long.size:
        i = int(too_long[0])
        raise input_error(
            "input_ids",
            i,
            f"1 to {pack_length} tokens after padding to a multiple of {align}",
            f"{int(lengths_host[i])} (padded {int(padded[i])}); online packing never splits a sequence",
        )
    bins = pack_lengths(padded, pack_length, algorithm=algorithm, min_bins=min_bins, bins_multiple_of=dp_size)
    seq_bin, seq_rank, seq_start, fills = bin_layout(bins, padded)
    n_rows, width, device = len(bins), int(fills.max()), input_ids.device
    as_t = lambda a: torch.as_tensor(a, dtype=torch.int64, device=device)  # noqa: E731
    seq_bin_t, seq_start_t, padded_t = as_t(seq_bin), as_t(seq_start), as_t(padded)

    values = jagged_values(input_ids)
    plan = IndexPlan.from_nested(input_ids)
    row, pos = plan.row_ids, plan.position_ids
    dest = seq_bin_t[row] * width + seq_start_t[row] + pos
    mask_values = torch.ones_like(values) if loss_mask is None else jagged_values(loss_mask).to(torch.int64)

    def scatter(src: Tensor, fill: int) -> Tensor:
        out = torch.full((n_rows * width,), fill, dtype=torch.int64, device=device)
        return out.index_copy_(0, dest, src.to(torch.int64)).view(n_rows, width)

    data = {
        "input_ids": scatter(values, pad_token_id),
        "target_ids": scatter(plan.next_token_labels(values, pad_token_id), pad_token_id),
        "token_mask": scatter(plan.next_token_labels(mask_values, 0), 0),
    }
    # position within the padded segment (padding keeps counting), 0 past a row's fill: layout's one
    # derivation over the segments' boundaries in the flat (n_rows * width) buffer (host arithmetic on B)
    starts = np.concatenate([seq_bin * width + seq_start, np.arange(n_rows) * width + fills, [n_rows * width]])
    positions = position_ids_of(as_t(np.unique(starts)), n_rows * width).view(n_rows, width)
    slot = torch.arange(width, device=device)
    data["position_ids"] = torch.where(slot < as_t(fills).unsqueeze(1), positions, 0)

    counts = np.array([len(b) for b in bins], dtype=np.int64)
    cu = torch.full((n_rows, int(counts.max()) + 1), -1, dtype=torch.int64, device=device)
    cu[:, 0] = 0
    cu[seq_bin_t, as_t(seq_rank) + 1] = seq_start_t + padded_t
    data["packed_cu_seqlens"] = cu
    data["packed_cu_seqlens_lengths"] = as_t(counts + 1)
    data["packed_max_seqlen"] = torch.zeros(n_rows, dtype=torch.int64, device=device).scatter_reduce(
        0, seq_bin_t, padded_t, reduce="amax"
    )
    return TensorDict(data, batch_size=[n_rows], device=device), bins
