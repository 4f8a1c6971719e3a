"""flash-attn compatible padding primitives (``flash_attn.bert_padding``), without flash-attn.

Shapes follow flash-attn: ``hidden`` is (batch, seqlen, ...), the unpadded form is
(total_nnz, ...), ``indices`` are positions in the flattened (batch * seqlen) first axis.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nopad.core._errors import check_int, check_integer_tensor, free_to_read, input_error, mask_error, mask_flag


def _check_first_axis(x: Any, field: str) -> None:
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise input_error(field, None, "a tensor with a first axis", f"{getattr(x, 'shape', type(x).__name__)}")


def _check_indices(indices: Tensor, rows: int | None, field: str = "indices") -> None:
    check_integer_tensor(indices, field)
    if indices.dim() != 1 or (rows is not None and indices.shape[0] != rows):
        expected = f"shape ({rows},)" if rows is not None else "a 1-D tensor"
        raise input_error(field, None, expected, f"shape {tuple(indices.shape)}")


class _IndexFirstAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, indices: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = x.shape[0]
        return x.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        grad_x = grad.new_zeros((ctx.first_axis_dim, *grad.shape[1:]))
        return grad_x.index_add_(0, indices, grad), None


class _IndexPutFirstAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(indices)
        out = values.new_zeros((first_axis_dim, *values.shape[1:]))
        return out.index_copy_(0, indices, values)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        return grad.index_select(0, indices), None, None


def put_rows(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """:func:`index_put_first_axis` of indices its caller derived itself (an index plan's): nothing is
    checked again."""
    return _IndexPutFirstAxis.apply(values, indices, first_axis_dim)


def _check_in_range(indices: Tensor, size: int, field: str = "indices") -> None:
    """Every index in [0, size), checked where free: CPU indices are read (host memory, no device
    sync); device indices are not (a host sync), and the kernel's own bounds check stands."""
    if indices.numel() == 0 or not free_to_read(indices):
        return
    low, high = indices.aminmax()
    if int(low) < 0 or int(high) >= size:
        bad = int(low) if int(low) < 0 else int(high)
        raise input_error(field, None, f"indices in [0, {size}) (rows of the first axis)", f"{bad}")


def index_first_axis(x: Tensor, indices: Tensor) -> Tensor:
    """Rows ``indices`` of an already flat first axis: (N, ...) -> (len(indices), ...). Autograd-aware.

    Indices on the CPU are checked to lie in [0, N); on a device they are not read (a host sync)."""
    _check_first_axis(x, "x")
    _check_indices(indices, None)
    _check_in_range(indices, x.shape[0])
    return _IndexFirstAxis.apply(x, indices)


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """Inverse of :func:`index_first_axis`: (nnz, ...) -> (first_axis_dim, ...), zeros elsewhere.

    Indices on the CPU are checked to lie in [0, first_axis_dim) and to be distinct (two values put
    in one row would keep one of them, silently); on a device they are not read."""
    _check_first_axis(values, "values")
    _check_indices(indices, values.shape[0])
    first_axis_dim = check_int(first_axis_dim, "first_axis_dim", low=0)
    _check_in_range(indices, first_axis_dim)
    if indices.numel() > 1 and free_to_read(indices):
        ordered = indices.sort().values
        repeated = (ordered[1:] == ordered[:-1]).nonzero()
        if repeated.numel():
            raise input_error(
                "indices", None, "distinct rows (one value per row)", f"row {int(ordered[repeated[0, 0]])} twice"
            )
    return _IndexPutFirstAxis.apply(values, indices, first_axis_dim)


def unpad_input(
    hidden: Tensor, attention_mask: Tensor, unused_mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:
    """(batch, seqlen, ...) + mask (batch, seqlen) -> the 5-tuple of flash-attn >= 2.7.

    Returns ``(hidden[total_nnz, ...], indices (total_nnz,), cu_seqlens (batch+1,) int32,
    max_seqlen int, seqused (batch,) int32)``. ``unused_mask`` marks tokens that are kept in the
    unpadded tensor but not counted in ``seqused``. Costs two host syncs (``nonzero`` and the max),
    as flash-attn's does; :class:`nopad.IndexPlan` has cheaper constructors.

    Both masks are 0/1 masks (:func:`nopad.core._errors.check_mask`): a 2 or 0.5 would be counted by the
    lengths but not by the indices. Checked on every device in the read of the max (no extra sync).
    """
    if not isinstance(hidden, Tensor) or not isinstance(attention_mask, Tensor):
        raise input_error(
            "hidden/attention_mask", None, "two tensors", f"{type(hidden).__name__}/{type(attention_mask).__name__}"
        )
    flags = [(attention_mask, "attention_mask", mask_flag(attention_mask, "attention_mask"))]
    if unused_mask is not None:
        flags.append((unused_mask, "unused_mask", mask_flag(unused_mask, "unused_mask")))
    if hidden.dim() < 2 or tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
        raise input_error(
            "attention_mask",
            None,
            f"shape {tuple(hidden.shape[:2])} like hidden's first two dims",
            f"{tuple(attention_mask.shape)}",
        )
    if unused_mask is not None and unused_mask.shape != attention_mask.shape:
        raise input_error("unused_mask", None, f"shape {tuple(attention_mask.shape)}", f"{tuple(unused_mask.shape)}")
    all_masks = attention_mask if unused_mask is None else attention_mask.bool() | unused_mask.bool()
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    checks = [(mask, field, flag) for mask, field, flag in flags if flag is not None]
    facts = [seqlens.max() if seqlens.numel() else seqlens.new_zeros(()), *(flag for _, _, flag in checks)]
    max_seqlen, *only_01 = torch.stack([f.to(torch.int64) for f in facts]).tolist()  # the max and the checks: one read
    bad = [(mask, field) for (mask, field, _), ok in zip(checks, only_01) if not ok]
    if bad:
        raise mask_error(*bad[0])
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return _IndexFirstAxis.apply(hidden.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Inverse of :func:`unpad_input`: (total_nnz, ...) -> (batch, seqlen, ...), zeros at padding."""
    batch, seqlen = check_int(batch, "batch", low=0), check_int(seqlen, "seqlen", low=0)
    _check_first_axis(hidden, "hidden")
    return index_put_first_axis(hidden, indices, batch * seqlen).view(batch, seqlen, *hidden.shape[1:])
