"""flash-attn compatible padding primitives (``flash_attn.bert_padding``), without flash-attn.

Shapes follow flash-attn: ``hidden`` is (batch, seqlen, ...), the unpadded form is
(total_nnz, ...), ``indices`` are positions in the flattened (batch * seqlen) first axis.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nopad.errors import check_int, check_integer_tensor, input_error


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


def index_first_axis(x: Tensor, indices: Tensor) -> Tensor:
    """Rows ``indices`` of an already flat first axis: (N, ...) -> (len(indices), ...). Autograd-aware."""
    _check_indices(indices, None)
    return _IndexFirstAxis.apply(x, indices)


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """Inverse of :func:`index_first_axis`: (nnz, ...) -> (first_axis_dim, ...), zeros elsewhere."""
    _check_indices(indices, values.shape[0])
    first_axis_dim = check_int(first_axis_dim, "first_axis_dim", low=0)
    return _IndexPutFirstAxis.apply(values, indices, first_axis_dim)


def unpad_input(
    hidden: Tensor, attention_mask: Tensor, unused_mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:
    """(batch, seqlen, ...) + mask (batch, seqlen) -> the 5-tuple of flash-attn >= 2.7.

    Returns ``(hidden[total_nnz, ...], indices (total_nnz,), cu_seqlens (batch+1,) int32,
    max_seqlen int, seqused (batch,) int32)``. ``unused_mask`` marks tokens that are kept in the
    unpadded tensor but not counted in ``seqused``. Costs two host syncs (``nonzero`` and the max),
    as flash-attn's does; :class:`nopad.IndexPlan` has cheaper constructors.
    """
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
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return index_first_axis(hidden.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Inverse of :func:`unpad_input`: (total_nnz, ...) -> (batch, seqlen, ...), zeros at padding."""
    batch, seqlen = check_int(batch, "batch", low=0), check_int(seqlen, "seqlen", low=0)
    return index_put_first_axis(hidden, indices, batch * seqlen).view(batch, seqlen, *hidden.shape[1:])
