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
