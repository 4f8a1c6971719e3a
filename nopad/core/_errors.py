"""The one way nopad reports bad input: a ``ValueError`` that names the field, the row, what was
expected and what came.

Every check in nopad raises through :func:`input_error`, so messages read alike everywhere::

    input_ids row 3: expected a value > 0, got -1
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor


def input_error(field: str, row: int | None, expected: str, actual: str) -> ValueError:
    """``ValueError("<field>[ row <row>]: expected <expected>, got <actual>")``; the caller raises it."""
    where = field if row is None else f"{field} row {row}"
    return ValueError(f"{where}: expected {expected}, got {actual}")


def in_file(path: object, error: ValueError | str) -> ValueError:
    """``error`` (an :func:`input_error` or a reason) prefixed with the file it was found in."""
    return ValueError(f"{path}: {error}")


def check_int(value: Any, field: str, *, low: int | None = None, high: int | None = None) -> int:
    """An integer (int or numpy integer; not a bool, float or str) within [low, high]: THE int check.
    Never rounded or parsed; returned as a Python int. No sync."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise input_error(field, None, f"an int{bounds(low, high, False, False)}", f"{value!r}")
    number = int(value)
    if (low is not None and number < low) or (high is not None and number > high):
        raise input_error(field, None, f"an int{bounds(low, high, False, False)}", f"{value!r}")
    return number


def check_optional_int(value: Any, field: str, *, low: int | None = None, high: int | None = None) -> int | None:
    """None, or :func:`check_int`'s int."""
    return None if value is None else check_int(value, field, low=low, high=high)


def check_flag(value: Any, field: str) -> bool:
    """THE flag check: a real boolean (``bool`` or numpy's ``bool_``), never a string or a number:
    ``"false"`` is truthy in Python, so a flag read from text would silently turn the feature on."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise input_error(field, None, "True or False (a bool)", f"{value!r} ({type(value).__name__})")


def bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    """The words of a range for a message: " >= 1", " in (0, 1]", ... ("" when unbounded)."""
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{_number(low)}, {_number(high)}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {_number(low)}"
    if high is not None:
        return f" {'<' if high_open else '<='} {_number(high)}"
    return ""


def _number(value: float) -> str:
    """An int as its digits (2147483647, not 2.14748e+09); a float as :g shows it."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def check_integer_tensor(x: object, field: str) -> None:
    """``x`` is a tensor of integers (ids, positions, indices): floats would be cut or fail later, bools
    counted as 0 and 1. A dtype check, no sync."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
        raise input_error(field, None, "an integer tensor", f"dtype {dtype}" if dtype is not None else type(x).__name__)


# ---- reading values for a check -----------------------------------------------------------------
# Checks that read a tensor's values run where that costs no device sync: tensors in host memory.
# A test that measures a device's sync contract on a CPU turns this off, so the CPU takes the
# device's path (every such check then behaves as it does on a GPU: not read, or folded).
HOST_VALUES_CHECKED = True


def free_to_read(*tensors: Tensor) -> bool:
    """Whether a check may read these tensors' values: all live in host memory (the CPU), where a
    read costs no device sync. On a device the check is skipped or folded into a read made anyway,
    and the docstring of the public function says which."""
    return HOST_VALUES_CHECKED and all(t.device.type == "cpu" for t in tensors)


# ---- THE mask rules ------------------------------------------------------------------------------
# A mask that SELECTS tokens (an attention mask, an embeds mask): bool, or integers where any nonzero
# entry is a token (as the gathers and verl read them), or floats that are only 0 and 1 (a 0.5 is
# neither a token nor padding). A mask that WEIGHS tokens (a loss mask): only 0 and 1 in any dtype
# (a 2 would count its token twice in a masked mean, as verl's loss would).
MASK_WORDS = "a 0/1 mask (bool, or numbers that are only 0 and 1: a weight is not a mask)"
SELECTION_WORDS = "a selection mask (bool, integers with nonzero = token, or floats that are only 0 and 1)"


def check_selection_mask(mask: Any, field: str) -> Tensor | None:
    """THE check of a mask that selects tokens (see above). A bool or integer mask needs no read; a
    float mask is read where that is free (host memory: a ValueError naming the row and value), else
    its 0-d device flag "every entry is 0 or 1" is returned for the caller to fold into a read it
    makes anyway (None: nothing left to check)."""
    if not isinstance(mask, Tensor) or getattr(mask, "is_nested", False):
        got = "a nested tensor" if isinstance(mask, Tensor) else type(mask).__name__
        raise input_error(field, None, f"a dense tensor: {SELECTION_WORDS}", got)
    if mask.dtype.is_complex:
        raise input_error(field, None, SELECTION_WORDS, f"dtype {mask.dtype}")
    if not mask.dtype.is_floating_point:
        return None
    return check_mask(mask, field)


def check_mask(mask: Any, field: str) -> Tensor | None:
    """THE 0/1 mask check: ``mask`` is a dense tensor of bools, or of integers or floats that are
    only 0 and 1. A 2, 0.5, -1 or NaN is refused, never read as a 1 (nor as a weight).

    The values are read only where that is free. A bool mask needs no read. A mask on the CPU is
    read at once (host memory: no device sync) and a bad entry is a ValueError naming its row and
    value. A mask on a device is not read (that would be a host sync): the 0-d device bool "every
    entry is 0 or 1" is returned, for the caller to fold into a read it makes anyway, or into its
    result; ``None`` means nothing is left to check. Callers that can do neither say so.
    """
    only_01 = mask_flag(mask, field)
    if only_01 is None or not free_to_read(mask):
        return only_01
    if not bool(only_01):
        raise mask_error(mask, field)
    return None


def mask_flag(mask: Any, field: str) -> Tensor | None:
    """:func:`check_mask` without any read, for a caller that makes a host read anyway: the dtype is
    checked, and the 0-d bool "every entry is 0 or 1" returned where the values need checking (None
    for a bool or empty mask). A False flag is turned into the error by :func:`mask_error`."""
    if not isinstance(mask, Tensor) or getattr(mask, "is_nested", False):
        got = "a nested tensor" if isinstance(mask, Tensor) else type(mask).__name__
        raise input_error(field, None, f"a dense tensor: {MASK_WORDS}", got)
    if mask.dtype == torch.bool or mask.numel() == 0:
        return None
    if mask.dtype.is_complex:
        raise input_error(field, None, MASK_WORDS, f"dtype {mask.dtype}")
    return not_01(mask).any().logical_not_()


def not_01(mask: Tensor) -> Tensor:
    """Elementwise "neither 0 nor 1" (NaN included). Three ops, no sync."""
    return (mask != 0).logical_and_(mask != 1)


def mask_error(mask: Tensor, field: str) -> ValueError:
    """The :func:`check_mask` error for a mask known to hold something other than 0 and 1: names the
    first bad entry's row (for a 2-D or wider mask) and value. An error path: it reads the mask."""
    bad = not_01(mask).flatten().nonzero()
    if bad.numel() == 0:
        return input_error(field, None, MASK_WORDS, "a mask whose values changed while it was read")
    k = int(bad[0, 0])
    row = k // (mask.numel() // mask.shape[0]) if mask.dim() > 1 else None
    return input_error(field, row, MASK_WORDS, f"{mask.flatten()[k].item()!r}")
