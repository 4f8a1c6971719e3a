"""The one way nopad reports bad input: a ``ValueError`` that names the field, the row, what was
expected and what came.

Every check in nopad raises through :func:`input_error`, so messages read alike everywhere::

    input_ids row 3: expected a value > 0, got -1
"""

from __future__ import annotations

import numbers
from typing import Any


def input_error(field: str, row: int | None, expected: str, actual: str) -> ValueError:
    """``ValueError("<field>[ row <row>]: expected <expected>, got <actual>")``; the caller raises it."""
    where = field if row is None else f"{field} row {row}"
    return ValueError(f"{where}: expected {expected}, got {actual}")


def in_file(path: object, error: ValueError | str) -> ValueError:
    """``error`` (an :func:`input_error` or a reason) prefixed with the file it was found in."""
    return ValueError(f"{path}: {error}")


def check_int(value: Any, field: str, *, low: int | None = None, high: int | None = None) -> int:
    """An integer (int or numpy integer; not a bool, float or str) within [low, high]: THE int check.
    Never rounded or parsed. No sync."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise input_error(field, None, f"an int{bounds(low, high, False, False)}", f"{value!r}")
    number = int(value)
    if (low is not None and number < low) or (high is not None and number > high):
        raise input_error(field, None, f"an int{bounds(low, high, False, False)}", f"{value!r}")
    return number


def bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    """The words of a range for a message: " >= 1", " in (0, 1]", ... ("" when unbounded)."""
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high:g}"
    return ""


def check_integer_tensor(x: object, field: str) -> None:
    """``x`` is a tensor of integers (ids, positions, indices): floats would be cut or fail later, bools
    counted as 0 and 1. A dtype check, no sync."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
        raise input_error(field, None, "an integer tensor", f"dtype {dtype}" if dtype is not None else type(x).__name__)
