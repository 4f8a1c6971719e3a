"""Reading a field from a micro batch, whatever holds it (TensorDict or dict, tensor or metadata)."""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict
from torch import Tensor

_SCALARS = (type(None), bool, int, float, str)


def get_field(batch: Any, key: str, default: Any = None) -> Any:
    """``batch[key]`` with NonTensorData unwrapped to its value; ``default`` when the key is absent.

    A figure stored without ``NonTensorData`` (verl assigns some as plain values) reads back under
    tensordict 0.15 as a stack, a ``LinkedList`` of one value per row; when every row holds the same
    scalar (``None`` included), that scalar is the value.
    """
    if isinstance(batch, TensorDict):
        if key not in batch.keys():
            return default
        value = batch.get(key)
        if isinstance(value, Tensor):  # ``.data`` of a nested tensor would build a new one (tens of us)
            return value
        value = batch.get_non_tensor(key)
        return _one_value(getattr(value, "data", value))
    return batch.get(key, default)


def _one_value(value: Any) -> Any:
    if isinstance(value, (Tensor, *_SCALARS, dict)) or not hasattr(value, "__iter__") or not hasattr(value, "__len__"):
        return value
    items = list(value)
    if items and all(isinstance(x, _SCALARS) for x in items) and all(x == items[0] for x in items):
        return items[0]
    return value
