"""The one way nopad reports bad input: a ``ValueError`` that names the field, the row, what was
expected and what came.

Every check in nopad raises through :func:`input_error`, so messages read alike everywhere::

    input_ids row 3: expected a value > 0, got -1
"""

from __future__ import annotations


def input_error(field: str, row: int | None, expected: str, actual: str) -> ValueError:
    """``ValueError("<field>[ row <row>]: expected <expected>, got <actual>")``; the caller raises it."""
    where = field if row is None else f"{field} row {row}"
    return ValueError(f"{where}: expected {expected}, got {actual}")


def in_file(path: object, error: ValueError | str) -> ValueError:
    """``error`` (an :func:`input_error` or a reason) prefixed with the file it was found in."""
    return ValueError(f"{path}: {error}")


def check_int(value: object, field: str, *, minimum: int | None = None) -> int:
    """``value`` as an int (a Python or numpy integer, or a 0-d integer tensor on the host), at least
    ``minimum``; a bool, a float or a string is refused, never rounded or parsed. No sync."""
    import operator

    try:
        number = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None:
        raise input_error(field, None, "an int" + (f" >= {minimum}" if minimum is not None else ""), repr(value))
    if minimum is not None and number < minimum:
        raise input_error(field, None, f"an int >= {minimum}", repr(value))
    return number


def check_integer_tensor(x: object, field: str) -> None:
    """``x`` is a tensor of integers (ids, positions, indices): floats would be cut or fail later, bools
    counted as 0 and 1. A dtype check, no sync."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
        raise input_error(field, None, "an integer tensor", f"dtype {dtype}" if dtype is not None else type(x).__name__)
