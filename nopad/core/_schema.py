"""The batches the public entries take, described once and checked once, at the edge.

A :class:`Field` says what one key of a batch holds: what its values are (token ids, a selection
mask, anything per token), and its shape as symbols (``"B"``, ``"S"``, ...) that the first field to
have them binds. :func:`check_field` runs one field's checks on host facts only (type, dtype, shape:
no tensor value is read, so no sync) and returns the sizes bound so far, so the function behind it
starts from checked arguments and never checks again. Its messages name the field, what was
expected (the shape with the sizes bound so far) and what came.

The values themselves (a mask's 0s and 1s, the rows' runs) are checked where they are read anyway,
by the function's own first read (see :func:`nopad.batches._padding.plan_left_right`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nopad.core._errors import SELECTION_WORDS, check_integer_tensor, input_error
from nopad.core._layout import is_nested

IDS, MASK, ANY = "token ids", "a mask", "anything"
Dim = str | int


@dataclass(frozen=True, eq=False)
class Field:
    """One key of a batch. ``shapes``: the shapes it may take, each a tuple of symbols or ints
    (``"..."`` last: any trailing dims); a symbol seen first here is bound to this field's size.
    ``choices``: the sizes a symbol may take (mrope's C in {3, 4}). ``like``: the field whose shape
    this one repeats, for the message."""

    key: str
    values: str
    shapes: tuple[tuple[Dim, ...], ...]
    like: str | None = None
    choices: tuple[tuple[str, tuple[int, ...]], ...] = ()
    words: str | None = None  # what the field is, for the message ("a per-token tensor")

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes_of", dict(self.choices))  # read on every check: made once


def _describe(shape: tuple[Dim, ...], sizes: dict[str, int], choices: dict[str, tuple[int, ...]]) -> str:
    def one(d: Dim) -> str:
        if isinstance(d, int):
            return str(d)
        if d == "...":
            return "..."
        if d in sizes:
            return str(sizes[d])
        if d in choices:
            return "|".join(str(c) for c in choices[d])
        return d

    return "(" + ", ".join(one(d) for d in shape) + ")"


def _match(shape: tuple[int, ...], pattern: tuple[Dim, ...], sizes: dict, choices: dict) -> dict | None:
    """The sizes ``shape`` binds under ``pattern`` (with those bound already), or None if it fails."""
    trailing = pattern[-1] == "..." if pattern else False
    n = len(pattern) - trailing
    if len(shape) < n or (not trailing and len(shape) != n):
        return None
    bound = sizes
    for i in range(n):
        size, d = shape[i], pattern[i]
        known = d if type(d) is int else bound.get(d)
        if known is not None:
            if size != known:
                return None
        elif d in choices and size not in choices[d]:
            return None
        else:
            bound = {**bound, d: size} if bound is sizes else bound
            bound[d] = size
    return bound


def check_field(value: Any, field: Field, sizes: dict[str, int]) -> dict[str, int]:
    """``value`` against ``field``: a dense tensor, of its kind of values, of one of its shapes under
    the ``sizes`` bound so far. Returns the sizes with those it binds. Host facts only."""
    key = field.key
    choices: dict[str, tuple[int, ...]] = field.sizes_of  # type: ignore[attr-defined]
    if type(value) is not Tensor and (not isinstance(value, Tensor) or is_nested(value)):
        got = "a nested tensor" if isinstance(value, Tensor) else type(value).__name__
        what = f"a dense {SELECTION_WORDS}" if field.values == MASK else f"a padded tensor of {field.values}"
        raise input_error(key, None, field.words or what, got)
    if field.values == IDS:
        dtype = value.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype is torch.bool:
            check_integer_tensor(value, key)
    elif field.values == MASK and value.dtype.is_complex:
        raise input_error(key, None, SELECTION_WORDS, f"dtype {value.dtype}")
    shape = tuple(value.shape)
    for pattern in field.shapes:
        bound = _match(shape, pattern, sizes, choices)
        if bound is not None:
            return bound
    shown = " or ".join(_describe(p, sizes, choices) for p in field.shapes)
    like = f" like {field.like}" if field.like else ""
    expected = f"{field.words} of shape {shown}" if field.words else f"shape {shown}{like}"
    raise input_error(key, None, expected, f"{shape}")
