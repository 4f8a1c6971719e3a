"""Rows of a TensorDict that holds jagged nested fields, under every tensordict nopad supports.

``td[1:3]`` on a TensorDict with nested fields works in tensordict 0.15 but raises in 0.8 to 0.10
(verl's pins): they index each field with ``tensor[index]``, and torch's jagged nested tensors
cannot be sliced on the batch dim. :func:`select_rows` gives the same result everywhere: dense
fields are indexed by tensordict, nested ones are cut from their values with one gather.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from nopad.errors import input_error
from nopad.layout import IndexPlan, is_nested, nested_offsets, ragged_dim


def select_rows(data: TensorDict, index: Any) -> TensorDict:
    """``data[index]`` for a slice, a sequence or tensor of row indices, or a (B,) bool mask.

    Nested (B, j, *) and (B, C, j) fields keep their ragged dim; the rows come out in ``index``'s
    order. Non-tensor metadata is carried as tensordict carries it. One host sync per nested
    field (its new token count). An int index (which drops the batch dim) is refused: use
    ``select_rows(data, [i])`` or ``data[i]`` on the dense fields.
    """
    if not isinstance(data, TensorDict) or data.batch_dims < 1:
        raise input_error("data", None, "a TensorDict with a batch dim", f"{type(data).__name__}")
    if isinstance(index, int):
        raise input_error("index", None, "a slice, row indices or a bool mask (an int drops the batch dim)", f"{index}")
    batch = data.batch_size[0]
    rows = torch.arange(batch)[index if not isinstance(index, Tensor) else index.cpu()]
    if rows.dim() != 1:
        raise input_error("index", None, "an index selecting rows of dim 0", f"one of shape {tuple(rows.shape)}")
    nested = [key for key in data.keys() if is_nested(data.get(key))]
    subs = [key for key in data.keys() if isinstance(data.get(key), TensorDict) and key not in nested]
    out = data.exclude(*nested, *subs)[rows]
    for key in subs:
        out.set(key, select_rows(data.get(key), rows))
    for key in nested:
        out.set(key, take_nested_rows(data.get(key), rows))
    return out


def take_nested_rows(nested: Tensor, rows: Tensor) -> Tensor:
    """Rows ``rows`` (1-D int64) of a jagged nested (B, j, *) or (B, C, j) tensor, as a new nested tensor."""
    offsets = nested_offsets(nested).to(torch.int64)
    rows = rows.to(offsets.device)
    plan = IndexPlan.from_lengths(offsets.diff()[rows])
    src = plan.token_index(offsets[:-1][rows])
    ragged = ragged_dim(nested)
    values = nested.values().index_select(ragged - 1, src.to(nested.values().device))
    return plan.to_nested(values, ragged_dim=ragged)
