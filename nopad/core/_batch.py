"""Reading what a call takes, checked: fields of a micro batch (TensorDict or dict, tensor or metadata),
and the flags, numbers and options of a public entry point; and putting checked fields back.

Every check here runs on the host, on Python values and tensor shapes and dtypes: none reads a
tensor's values, so none adds a host sync. THE int, flag and mask checks (``check_int``,
``check_flag``, ``check_mask``) live in :mod:`nopad.core._errors`, below every module.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Collection, Mapping
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from nopad.core._errors import bounds, input_error
from nopad.core._layout import is_nested, jagged_values

_SCALARS = (type(None), bool, str, bytes, numbers.Number)


def parameters_of(fn: Any) -> Mapping[str, inspect.Parameter]:
    """``fn``'s parameters by name; empty where its signature cannot be read. THE reading of a signature."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def takes_keyword(fn: Any, name: str, *, any_keyword: bool = True) -> bool:
    """Whether ``fn`` (a forward, a kernel, an ``__init__``) takes the keyword ``name``; a ``**kwargs`` counts
    unless ``any_keyword=False``. False where its signature cannot be read."""
    params = parameters_of(fn)
    return name in params or (any_keyword and any(p.kind is p.VAR_KEYWORD for p in params.values()))


def get_field(batch: Any, key: str, default: Any = None) -> Any:
    """``batch[key]`` with metadata unwrapped to its one value; ``default`` when absent or None.

    Metadata may come as ``NonTensorData``, a ``NonTensorStack`` or (tensordict >= 0.10 reading a
    figure stored per row, ``NonTensorData(None)`` included) a ``LinkedList`` of one value per row.
    Every form reads the same: all rows equal -> that value; all None -> missing (``default``);
    rows that differ -> ValueError naming the key (a figure of the whole micro batch has one value).
    Tensors are returned as they are. No sync.
    """
    if isinstance(batch, TensorDict):
        if key not in batch.keys():
            return default
        value = batch.get(key)
        if isinstance(value, Tensor):  # ``.data`` of a nested tensor would build a new one (tens of us)
            return value
        value = batch.get_non_tensor(key)
    elif isinstance(batch, Mapping) or hasattr(batch, "get"):
        value = batch.get(key, None)
    else:
        raise input_error("data", None, "a micro batch: a TensorDict or a dict of fields", type(batch).__name__)
    value = one_value(value, f"data[{key!r}]")
    return default if value is None else value


def one_value(value: Any, field: str) -> Any:
    """The single value behind ``value``: NonTensorData unwrapped, a per-row stack or list of equal
    values collapsed to one (None when every row is None); differing rows are a ValueError."""
    value = _unwrap(value)
    if not _is_stack(value):
        return value
    items = [_unwrap(item) for item in value]
    if not items:
        return None
    first = items[0]
    if all(_same(item, first) for item in items[1:]):
        return first
    shown = ", ".join(repr(item) for item in items[:4]) + (", ..." if len(items) > 4 else "")
    raise input_error(
        field,
        None,
        "one value for the whole micro batch (store per-row values as a (batch,) tensor)",
        f"{len(items)} rows that differ: [{shown}]",
    )


def _unwrap(value: Any) -> Any:
    if type(value).__name__ in ("NonTensorData", "NonTensorStack"):  # tensordict's wrappers, any version
        return value.tolist() if type(value).__name__ == "NonTensorStack" else value.data
    return value


def _is_stack(value: Any) -> bool:
    """A per-row sequence of values: tensordict's LinkedList, a list or a tuple (not a str, dict or tensor)."""
    return type(value).__name__ == "LinkedList" or isinstance(value, (list, tuple))


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if not (isinstance(a, _SCALARS) and isinstance(b, _SCALARS)):
        return False  # tensors and containers: the same object only (comparing values would read them)
    if isinstance(a, bool) != isinstance(b, bool) or isinstance(a, (str, bytes)) != isinstance(b, (str, bytes)):
        return False  # True is not 1, "1" is not 1
    return bool(a == b) or (a != a and b != b)  # NaN rows are equal rows


# ---- checks of the arguments of a public entry point --------------------------------------------
# (THE int, flag and mask checks live in nopad.core._errors, below every module: check_int, check_flag, check_mask)
def check_transformers_model(model: Any, field: str = "model") -> Any:
    """THE check of a model argument: a transformers model, a torch module whose config names its
    attention implementation (where nopad sets it). Returns it."""
    if not isinstance(model, torch.nn.Module) or not hasattr(getattr(model, "config", None), "_attn_implementation"):
        got = type(model).__name__ + ("" if isinstance(model, torch.nn.Module) else " (not a torch module)")
        raise input_error(field, None, "a transformers model (a module with a config naming its attention)", got)
    return model


def check_choice(value: Any, field: str, choices: Collection[str]) -> str:
    """One of ``choices`` (strings); anything else names them."""
    if not isinstance(value, str) or value not in choices:
        raise input_error(field, None, f"one of {list(choices)}", repr(value))
    return value


def check_real(
    value: Any,
    field: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite real number (int, float or numpy scalar; not a bool, str or tensor) within [low, high]
    (an open end with ``low_open`` / ``high_open``). Returns it as a float."""
    number = _as_real(value)
    if number is None or not math.isfinite(number):
        raise input_error(field, None, f"a finite number{bounds(low, high, low_open, high_open)}", repr(value))
    too_low = low is not None and (number < low or (low_open and number == low))
    too_high = high is not None and (number > high or (high_open and number == high))
    if too_low or too_high:
        raise input_error(field, None, f"a number{bounds(low, high, low_open, high_open)}", repr(value))
    return number


def check_real_dtype(x: Tensor, field: str, *, floating: bool = False) -> Tensor:
    """A tensor of real numbers: floating point, or (unless ``floating``) integer; never bool or complex."""
    if not isinstance(x, Tensor):
        raise input_error(field, None, "a tensor", type(x).__name__)
    dtype = jagged_values(x).dtype if is_nested(x) else x.dtype  # a jagged tensor's .dtype costs a dispatch
    if not (dtype.is_floating_point or (not floating and dtype != torch.bool and not dtype.is_complex)):
        kind = "a floating-point tensor" if floating else "a tensor of real numbers (float or int)"
        raise input_error(field, None, kind, f"dtype {dtype}")
    return x


def _as_real(value: Any) -> float | None:
    if type(value) is float or type(value) is int:  # the common case, without an ABC check
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)
