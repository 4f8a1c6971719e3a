"""Reading a field from a micro batch, whatever holds it (TensorDict or dict, tensor or metadata)."""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict
from torch import Tensor


def get_field(batch: Any, key: str, default: Any = None) -> Any:
    """``batch[key]`` with NonTensorData unwrapped to its value; ``default`` when the key is absent."""
    if isinstance(batch, TensorDict):
        if key not in batch.keys():
            return default
        value = batch.get(key)
        if isinstance(value, Tensor):  # ``.data`` of a nested tensor would build a new one (tens of us)
            return value
        value = batch.get_non_tensor(key)
        return getattr(value, "data", value)
    return batch.get(key, default)
