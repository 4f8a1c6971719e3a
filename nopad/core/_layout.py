"""The index plan: where each real token of a batch lives in the padded, nested and packed layouts.

A plan is built once per batch (from a mask, from lengths, or from offsets) and then moves every
per-token field with the same gather or scatter, so no caller re-derives boundaries its own way.

Shapes: B rows, padded width S, ``total`` real tokens. ``offsets`` is cu_seqlens (B+1,).
Host syncs are named in each docstring; everything else stays on the device.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from nopad.core import _torch_internals as _internals
from nopad.core._errors import (
    check_flag,
    check_int,
    check_optional_int,
    check_selection_mask,
    free_to_read,
    input_error,
)
from nopad.core._memo import recall, remember
from nopad.core._ops import put_rows
from nopad.core._torch_internals import (
    cached_seqlens,
    is_jagged,
    is_nested,
    jagged_values,
    ragged_dim,
    seqlen_records,
    wrap_jagged,
)


def to_host(*scalars: Tensor) -> list[int]:
    """Fetch several 0-d device tensors in ONE device->host copy (one host sync)."""
    if not scalars:
        return []
    if not all(isinstance(s, Tensor) and s.numel() == 1 for s in scalars):
        got = [tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__ for s in scalars]
        raise input_error("scalars", None, "0-d (one-element) tensors", f"{got}")
    as_int64 = [s if s.dim() == 0 and s.dtype == torch.int64 else s.reshape(()).to(torch.int64) for s in scalars]
    return device_to_host(torch.stack(as_int64)).tolist()


def nested_offsets(nested: Tensor) -> Tensor:
    """(B+1,) offsets of a jagged nested tensor (typed accessor; torch's stubs lack it)."""
    return nested.offsets()  # type: ignore[attr-defined]


# a padded width beyond this is a mistake, not a batch: its (B, width) buffer would not fit anywhere
MAX_WIDTH = 2**31 - 1


def check_nested(x: object, field: str, *, ragged_dim: int | None = 1, value_dims: int | None = None) -> Tensor:
    """THE nested-input check: ``x`` is a jagged nested tensor ragged at ``ragged_dim`` (None: any)
    whose values have ``value_dims`` dims (None: any); else ValueError naming ``field``. No sync."""
    if not is_nested(x):
        got = f"a dense tensor of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        if x is None:
            got = "nothing"
        raise input_error(field, None, "a jagged nested tensor (B, j, ...)", got)
    nested: Tensor = x  # type: ignore[assignment]
    if not is_jagged(nested):
        raise input_error(field, None, "layout=torch.jagged", f"{nested.layout}")
    ragged = _internals.ragged_dim(nested)  # (the argument of this name shadows the function)
    if ragged_dim is not None and ragged != ragged_dim:
        raise input_error(field, None, f"the ragged dim at {ragged_dim}", f"it at {ragged}")
    values = jagged_values(nested) if value_dims is not None else None
    if values is not None and values.dim() != value_dims:
        raise input_error(field, None, f"values with {value_dims} dims", f"shape {tuple(values.shape)}")
    return nested


def prepare_offsets(lengths: Tensor) -> Tensor:
    """(B,) integer lengths -> (B+1,) int64 offsets (cu_seqlens) starting at 0. No sync.

    A float or bool tensor is refused (it would be cut to integers); the values are not read."""
    if not isinstance(lengths, Tensor) or not _is_integer(lengths.dtype):
        got = f"dtype {lengths.dtype}" if isinstance(lengths, Tensor) else type(lengths).__name__
        raise input_error("lengths", None, "an integer tensor", got)
    if lengths.dim() != 1:
        raise input_error("lengths", None, "a 1-D tensor", f"shape {tuple(lengths.shape)}")
    return torch.nn.functional.pad(lengths.to(torch.int64).cumsum(0), (1, 0))


def host_offsets(lengths: Any) -> np.ndarray:
    """(B,) host lengths -> (B+1,) int64 offsets from 0: THE host twin of :func:`prepare_offsets`."""
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def host_starts(lengths: Any) -> np.ndarray:
    """(B,) host lengths -> (B,) int64 start of each back-to-back run (its offset). Host math."""
    return host_offsets(lengths)[:-1]


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


INTEGERS_WORDS = "a 1-D tensor or sequence of integers"


def integer_values(values: Any, field: str, *, non_empty: bool = True) -> Tensor | np.ndarray:
    """THE reading of a (B,) integer argument (lengths, offsets, starts, workloads), its rules in one
    place: a 1-D tensor of an integer dtype comes back as it is (its values not read); anything else
    (a sequence, a numpy array) comes back as a host int64 numpy array, no tensor made.

    Nothing is rounded or converted: floats (3.7), bools and strings are refused, and so are unsigned
    values past int64. No sync. :func:`as_lengths` and :func:`host_lengths` are its two paths."""
    if isinstance(values, Tensor):
        if is_nested(values) or not _is_integer(values.dtype):
            got = "a nested tensor" if is_nested(values) else f"dtype {values.dtype}"
            raise input_error(field, None, INTEGERS_WORDS, got)
        _check_rank(values.dim(), values.shape, field, non_empty, "tensor")
        return values
    try:
        array = np.asarray(values)
    except (TypeError, ValueError):
        array = np.asarray(None)
    if array.dtype.kind not in "iu" and not (array.dtype.kind == "f" and array.size == 0):
        got = f"{type(values).__name__} of dtype {array.dtype}" if array.ndim else type(values).__name__
        raise input_error(field, None, f"{INTEGERS_WORDS} (nothing is rounded)", got)
    if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
        raise input_error(field, None, "integers below 2**63", f"{int(array.max())}")
    _check_rank(array.ndim, array.shape, field, non_empty, "sequence")
    return array.astype(np.int64, copy=False)


def _check_rank(ndim: int, shape: Any, field: str, non_empty: bool, kind: str) -> None:
    if ndim != 1 or (non_empty and shape[0] == 0):
        expected = f"a non-empty 1-D {kind}" if non_empty else f"a 1-D {kind}"
        raise input_error(field, None, expected, f"shape {tuple(shape)}")


def as_lengths(lengths: Any, field: str, *, non_empty: bool = True) -> Tensor:
    """:func:`integer_values`' tensor path: an int64 tensor (on the tensor's device). No sync."""
    values = integer_values(lengths, field, non_empty=non_empty)
    return values.to(torch.int64) if isinstance(values, Tensor) else torch.from_numpy(np.ascontiguousarray(values))


def host_lengths(lengths: Any, field: str, *, non_empty: bool = False, low: int | None = None) -> np.ndarray:
    """:func:`integer_values`' host path: an int64 numpy array. A sequence or numpy array makes no
    tensor and no sync; a tensor is read (:func:`device_to_host`: one host sync). With ``low``, a
    value below it is refused naming its row (host memory: free)."""
    values = integer_values(lengths, field, non_empty=non_empty)
    array = device_to_host(values).astype(np.int64, copy=False) if isinstance(values, Tensor) else values
    if low is not None and array.size and array.min() < low:
        row = int(np.flatnonzero(array < low)[0])
        raise input_error(field, row, f"a value >= {low}", f"{array[row]}")
    return array


def round_up(n: Any, multiple: Any) -> Any:
    """Smallest multiple of ``multiple`` that is >= ``n``: an int, or elementwise on a numpy array or a
    tensor. THE round-up of nopad (alignment, SP padding, bin counts). No sync."""
    return ceil_div(n, multiple) * multiple


# a bucket's step is at least 1/32 of the row's power-of-2 octave: the padding stays under 1/32 of
# the row (3.1%) and a row of any length falls in one of at most 32 buckets per octave
BUCKET_STEPS_PER_OCTAVE = 32


def bucket_length(total: int, bucket: int) -> int:
    """The length-bucketed row: ``total`` tokens rounded up to the next multiple of the step
    ``max(bucket, 2**(floor(log2 total) - 5))``.

    On rows under 64 buckets the step is ``bucket`` (the padding is under ``bucket`` tokens); then it
    grows with the row, 32 steps per power of 2 (the padding stays under 1/32 of the row), so the
    lengths a trainer's rows take are few however long they get. Host ints, no sync."""
    step = max(bucket, (1 << max(0, total.bit_length() - 1)) // BUCKET_STEPS_PER_OCTAVE)
    return round_up(total, step)


def ceil_div(n: Any, d: Any) -> Any:
    """``ceil(n / d)`` in integers, as :func:`round_up` takes them (THE ceil split: pieces, chunks, bins)."""
    return -(-n // d)


def spread_over_tokens(per_row: Tensor, offsets: Tensor, total: int, *, plus_position: bool = False) -> Tensor:
    """(B,) per-row values -> (total,): token t of row b gets ``per_row[b]`` (``+ t`` with ``plus_position``).

    ``repeat_interleave`` without its gather: each row's change of value is added at the row's
    first token and one cumsum carries it on. An empty row's change lands where the next row's
    does, so the two add up and empty rows need no care. No sync (``total`` is given).
    """
    step = int(check_flag(plus_position, "plus_position"))
    change = torch.diff(per_row, prepend=per_row.new_full((1,), step))
    tokens = per_row.new_full((total + 1,), step)  # the extra slot takes trailing empty rows
    return tokens.index_add_(0, offsets[:-1].to(per_row.device), change).cumsum_(0)[:total]


def prepare_row_ids(lengths: Tensor, total: int) -> Tensor:
    """(total,) index of the row each packed token belongs to. No sync (``total`` is given).

    ``total`` must be the lengths' sum (tokens past it would be given the last row, or cut):
    checked where that is free (lengths in host memory); on a device the caller vouches for it."""
    offsets = prepare_offsets(lengths)
    _check_ends_at(offsets, total, "the sum of the lengths")
    return row_ids_of(offsets, total)


def prepare_position_ids(offsets: Tensor, total: int) -> Tensor:
    """(total,) position of each packed token inside its own sequence, restarting at 0. No sync.

    ``offsets`` must run from 0 to ``total``: checked where free (host memory), as in
    :func:`prepare_row_ids`."""
    if not isinstance(offsets, Tensor):  # THE reading (host input becomes a tensor; a tensor is kept)
        offsets = as_lengths(offsets, "offsets")
    integer_values(offsets, "offsets")
    _check_ends_at(offsets, total, "the last offset")
    return position_ids_of(offsets, total)


def row_ids_of(offsets: Tensor, total: int) -> Tensor:
    """:func:`prepare_row_ids` of (B+1,) offsets the caller vouches for: nothing checked or read."""
    return spread_over_tokens(torch.arange(offsets.shape[0] - 1, device=offsets.device), offsets, total)


def position_ids_of(offsets: Tensor, total: int) -> Tensor:
    """:func:`prepare_position_ids` of offsets the caller vouches for: nothing checked or read."""
    return spread_over_tokens(-offsets[:-1], offsets, total, plus_position=True)


def _check_ends_at(offsets: Tensor, total: Any, words: str) -> None:
    """``offsets`` run from 0 to ``total``, read where free (host memory, one read); else a ValueError.
    Offsets on a device are not read (a sync): the caller vouches for them."""
    total = check_int(total, "total", low=0)
    if free_to_read(offsets) and offsets.numel():
        first, last = offsets[[0, -1]].tolist()
        if first != 0:
            raise input_error("offsets", None, f"boundaries from 0 to total {total}", f"{first}..{last}")
        if last != total:
            raise input_error("total", None, f"{words}, {last}", f"{total}")


def range_steps(firsts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Host half of :func:`expand_ranges`: where each non-empty range [first, first + length) begins in
    their concatenation, and the step the running sum takes there. Numpy, no device."""
    keep = lengths > 0
    firsts, lengths = firsts[keep], lengths[keep]
    positions = host_starts(lengths)
    steps = firsts.copy()
    steps[1:] -= firsts[:-1] + lengths[:-1] - 1  # from the previous range's last value
    return positions, steps


def host_ranges(firsts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``np.concatenate([np.arange(f, f + n) for f, n in zip(firsts, lengths)])`` on the host: the numpy
    twin of :func:`expand_ranges`, from the same :func:`range_steps`. Int64; no device."""
    positions, steps = range_steps(np.asarray(firsts, dtype=np.int64), np.asarray(lengths, dtype=np.int64))
    out = np.ones(int(np.sum(lengths)), dtype=np.int64)
    out[positions] = steps
    return np.cumsum(out, out=out)


def expand_ranges(positions: Tensor, steps: Tensor, n: int, dtype: torch.dtype = torch.int64) -> Tensor:
    """(n,) concatenated ranges from :func:`range_steps`: ones, each range's step at its start, summed.

    ``torch.cat([torch.arange(f, f + l) for f, l in ...])`` in three ops whatever the number of
    ranges (four for a ``dtype`` other than the steps'). No sync (``n`` is the total length, known
    on the host).
    """
    ones = torch.ones(n, dtype=dtype, device=positions.device)
    return ones.index_copy_(0, positions, steps.to(dtype)).cumsum_(0)


def ranges_of(firsts: Tensor, lengths: Tensor, n: int) -> Tensor:
    """(R,) firsts and (R,) lengths -> (n,) their ranges ``first, first + 1, ...`` concatenated: the
    device twin of :func:`host_ranges` when the ranges are on the device (one spread whatever R,
    ``torch.cat([torch.arange(f, f + l) ...])`` without the loop). No sync (``n`` is their total)."""
    starts = prepare_offsets(lengths)
    return spread_over_tokens(firsts - starts[:-1], starts, n, plus_position=True)


def gather_index_dtype(n: int) -> torch.dtype:
    """The narrowest index dtype ``index_select`` takes for values below ``n``: int32 halves the memory
    an index of every token writes and reads (on a CPU, where fresh memory is page-faulted, that is
    most of the cost of making one), int64 past 2**31."""
    return torch.int32 if n < 2**31 else torch.int64


def host_to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """Host int64 array -> the same on ``device`` in ONE non-blocking copy from pinned memory: THE way
    host arrays reach a device. No sync.

    Four ops on every device (a CPU gets a copy it does not need), so op counts measured on a
    CPU are the counts on a GPU.
    """
    staged = torch.empty(array.shape, dtype=torch.int64, pin_memory=device.type == "cuda")
    staged.copy_(torch.from_numpy(array))
    return torch.empty(array.shape, dtype=torch.int64, device=device).copy_(staged, non_blocking=True)


def device_to_host(x: Tensor) -> np.ndarray:
    """Device tensor -> a fresh numpy array in ONE copy: THE way nopad reads a device (the host sync of
    a call). Two ops on every device, so a CPU counts what a GPU would wait for."""
    staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=x.device.type == "cuda")
    return staged.copy_(x).numpy()


def block_causal_mask(
    cu_seqlens: Tensor,
    total: int,
    *,
    causal: bool = True,
    window: int | None = None,
    additive_dtype: torch.dtype | None = None,
) -> Tensor:
    """(1, 1, T, T) mask letting token i see token j iff both lie in the same segment, j <= i when
    ``causal``, and |i - j| < ``window`` when given (HF's sliding window: the token and window - 1 before it).

    Boolean (True = attend) for sdpa; with ``additive_dtype``, 0 / dtype-min for eager attention.
    ``cu_seqlens`` must end at ``total`` (fold any tail padding into a last segment). No sync.
    """
    segment = row_ids_of(cu_seqlens.to(torch.int64), total)
    positions = torch.arange(total, device=cu_seqlens.device)
    distance = positions.unsqueeze(1) - positions.unsqueeze(0)  # query minus key
    allowed = segment.unsqueeze(1) == segment.unsqueeze(0)
    if causal:
        allowed &= distance >= 0
    if window is not None:
        allowed &= distance.abs() < window
    allowed = allowed.view(1, 1, total, total)
    if additive_dtype is None:
        return allowed
    zero = torch.zeros((), dtype=additive_dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(additive_dtype).min)


def gather_rows(values: Tensor, src_start: Tensor, lo: Tensor | None, hi: Tensor, width: int) -> Tensor:
    """out[b, k] = values[src_start[b] + k] where lo[b] <= k < hi[b], else 0: (N, *) -> (B, width, *).

    ``lo=None`` means 0. A dense gather over B * width slots: no sync, no Python loop, autograd
    flows to ``values``.
    """
    width = check_int(width, "width", low=0)
    n, rows = values.shape[0], src_start.shape[0]
    if n == 0:  # nothing to gather from (every row empty)
        return values.new_zeros((rows, width, *values.shape[1:]))
    # int32 index math halves the memory traffic of the (B, width) index tensors when it fits
    itype = torch.int32 if n + width < 2**31 else torch.int64
    k = torch.arange(width, device=values.device, dtype=itype)
    valid = k < hi.to(itype).unsqueeze(1)
    if lo is not None:
        valid &= k >= lo.to(itype).unsqueeze(1)
    # invalid slots read an appended zero row, so no clamp and no masking pass over the output
    src = torch.where(valid, src_start.to(itype).unsqueeze(1) + k, n)
    padded = torch.cat([values, values.new_zeros((1, *values.shape[1:]))])
    return padded.index_select(0, src.flatten()).unflatten(0, (rows, width))


class IndexPlan:
    """Lengths, offsets and gather indices of one batch, shared by every per-token field.

    Attributes:
        lengths: (B,) int64 real tokens per row.
        offsets: (B+1,) int64 cu_seqlens; ``cu_seqlens`` gives the int32 copy kernels want.
        total: int, the number of real tokens (known on the host).
        width: int | None, the padded row width S.
        starts: (B,) int64 where each row's run of real tokens begins in the padded row
            (0 for right padding); None when the plan comes from an arbitrary mask.
    """

    def __init__(
        self,
        lengths: Tensor,
        offsets: Tensor,
        *,
        total: int,
        width: int | None = None,
        starts: Tensor | None = None,
        indices: Tensor | None = None,
        max_seqlen: int | None = None,
        min_seqlen: int | None = None,
    ):
        self.lengths = lengths
        self.offsets = offsets
        self.total = total
        self.width = width
        self.starts = starts
        self._indices = indices
        self._max_seqlen = max_seqlen
        self._min_seqlen = min_seqlen
        self._row_ids: Tensor | None = None
        self._cu_seqlens: Tensor | None = None
        self._host: tuple[np.ndarray, np.ndarray, int | None] | None = None  # from_runs' own input
        self._seqlen_cache: dict[str, Tensor] | None = None
        self.responses: ResponseGather | None = None
        # where the longest run of real tokens ends (max of starts + lengths), when known on the host;
        # right-padded plans know it as their max length
        self._end: int | None = max_seqlen if starts is None or max_seqlen is None else None
        self._nested_offsets: Tensor | None = None  # the offsets of the nested tensor this plan was read from
        self._source_mask: Any = None  # (weakref to the mask, its version) of from_runs' mask: see made_from

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_mask(cls, mask: Tensor) -> IndexPlan:
        """Any (B, S) selection mask (:func:`nopad.core._errors.check_selection_mask`: bool, integers with
        nonzero = token, floats only 0 and 1), holes allowed. One sync (``nonzero``).

        A float mask's values are checked where that is free (a CPU mask is read: host memory); on a
        device it is not read for the check (it would be a second sync): there any nonzero entry
        counts as a token."""
        check_selection_mask(mask, "mask")
        if mask.dim() != 2:
            raise input_error("mask", None, "a (batch, seqlen) tensor", f"shape {tuple(mask.shape)}")
        indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
        lengths = mask.bool().sum(-1)
        return cls(lengths, prepare_offsets(lengths), total=indices.shape[0], width=mask.shape[1], indices=indices)

    @classmethod
    def from_runs(
        cls,
        lengths: np.ndarray,
        starts: np.ndarray,
        *,
        width: int,
        device: torch.device | str,
        response_width: int | None = None,
        mask: Tensor | None = None,
    ) -> IndexPlan:
        """Rows whose real tokens are one run at ``starts`` (host int64 arrays, already validated).

        Everything on the device comes from one non-blocking copy of a few (B,) arrays, and the
        gather indices from one pass (:func:`expand_ranges`). No sync. With ``response_width`` R,
        the last R columns are each row's response, and the plan also carries its way back
        (:class:`ResponseGather`: where each response log-prob is read, token t's from position
        t - 1, and where it is written in the (B, R) output). ``mask``: the attention mask the runs were
        read from; the plan (and its copies by :meth:`to`) is then known as its own (:meth:`made_from`).
        """
        device = torch.device(device)
        rows = np.arange(len(lengths), dtype=np.int64)
        offsets = host_offsets(lengths)
        total = int(offsets[-1])
        firsts, spans = [rows * width + starts], [lengths]
        response_total, response_lens = 0, np.zeros(0, dtype=np.int64)
        if response_width is not None:
            response_lens = np.maximum(starts + lengths - (width - response_width), 0)
            prompt_lens = lengths - response_lens
            firsts += [offsets[:-1] + prompt_lens - 1, rows * response_width]
            spans += [response_lens, response_lens]
            response_total = int(response_lens.sum())
        positions, steps = range_steps(np.concatenate(firsts), np.concatenate(spans))
        parts = (lengths, offsets, starts, positions, steps)
        blob = host_to_device(np.concatenate(parts), device)
        lengths_d, offsets_d, starts_d, positions_d, steps_d = blob.split_with_sizes([len(p) for p in parts])
        index = expand_ranges(positions_d, steps_d, total + 2 * response_total)
        indices, source, slot = index, None, None
        if response_width is not None:
            indices, source, slot = index.split_with_sizes([total, response_total, response_total])
        plan = cls(
            lengths_d,
            offsets_d,
            total=total,
            width=width,
            starts=starts_d,
            indices=indices,
            max_seqlen=int(lengths.max()),
            min_seqlen=int(lengths.min()),
        )
        plan._host = (lengths, starts, response_width)
        if mask is not None:
            plan._source_mask = (weakref.ref(mask), mask._version)
        if response_width is not None and source is not None and slot is not None:
            plan.responses = ResponseGather(len(lengths), response_width, total, source, slot, response_lens)
        remember(offsets_d, "lengths", lengths)
        if plan.responses is not None:
            remember(offsets_d, "responses", plan.responses)
        return plan

    @classmethod
    def from_lengths(
        cls,
        lengths: Tensor | Sequence[int],
        *,
        width: int | None = None,
        starts: Tensor | None = None,
        total: int | None = None,
        max_seqlen: int | None = None,
        min_seqlen: int | None = None,
    ) -> IndexPlan:
        """Rows whose real tokens are one run starting at ``starts`` (default 0: right padding).

        ``lengths`` and ``starts`` are integers (a tensor of an integer dtype or a sequence of ints:
        3.7 is refused, not cut to 3). One sync fetching total, max and min length together, unless
        ``total`` is given. ``width`` defaults to the max length; every run must end within it
        (checked on the host: free when the lengths are fetched or live on the CPU; given ``total``
        and device lengths, the caller vouches for them and for ``total``).
        """
        lengths = as_lengths(lengths, "lengths")
        width = check_optional_int(width, "width", low=0, high=MAX_WIDTH)
        total = check_optional_int(total, "total", low=0)
        max_seqlen = check_optional_int(max_seqlen, "max_seqlen", low=0)
        min_seqlen = check_optional_int(min_seqlen, "min_seqlen", low=0)
        if starts is not None:
            starts = as_lengths(starts, "starts").to(lengths.device)
            if starts.shape != lengths.shape:
                raise input_error(
                    "starts", None, f"shape {tuple(lengths.shape)} like lengths", f"{tuple(starts.shape)}"
                )
        end: int | None = None  # where the longest run of real tokens ends, when known on the host
        ends = lengths if starts is None else lengths + starts
        if total is None or free_to_read(lengths):  # host facts: fetched (one sync), or read for free
            first = (lengths if starts is None else torch.minimum(lengths, starts)).min()
            count, longest, shortest, end, lowest = to_host(
                lengths.sum(), lengths.max(), lengths.min(), ends.max(), first
            )
            if lowest < 0:
                _refuse_negative(lengths, starts)
            if total is not None and total != count:
                raise input_error("total", None, f"the sum of the lengths, {count}", f"{total}")
            total, max_seqlen, min_seqlen = count, longest, shortest
        elif starts is None:
            end = max_seqlen
        if width is None:
            width = end if end is not None else to_host(ends.max())[0]
        elif end is not None and end > width:
            raise input_error("width", None, f">= {end}, where the longest run of real tokens ends", f"{width}")
        plan = cls(
            lengths,
            prepare_offsets(lengths),
            total=total,
            width=width,
            starts=torch.zeros_like(lengths) if starts is None else starts,
            max_seqlen=max_seqlen,
            min_seqlen=min_seqlen,
        )
        plan._end = end
        return plan

    @classmethod
    def from_offsets(cls, offsets: Tensor, *, width: int | None = None) -> IndexPlan:
        """(B+1,) integer cu_seqlens -> plan of right-padded rows. One sync (total, max, min).

        ``width``, when given, must hold the longest row (checked in the same sync)."""
        offsets = as_lengths(offsets, "offsets")
        if offsets.dim() != 1 or offsets.shape[0] < 2:
            raise input_error(
                "offsets", None, "a 1-D tensor of batch+1 >= 2 boundaries", f"shape {tuple(offsets.shape)}"
            )
        first, total, max_len, min_len = to_host(offsets[0], offsets[-1], offsets.diff().max(), offsets.diff().min())
        if first != 0 or min_len < 0:
            raise input_error("offsets", None, "boundaries starting at 0 that never go down", f"{offsets.tolist()}")
        width = check_optional_int(width, "width", low=0, high=MAX_WIDTH)
        if width is not None and max_len > width:
            raise input_error("width", None, f">= {max_len}, the longest row", f"{width}")
        lengths = offsets.diff()
        width = max_len if width is None else width
        return cls(
            lengths,
            offsets,
            total=total,
            width=width,
            starts=torch.zeros_like(lengths),
            max_seqlen=max_len,
            min_seqlen=min_len,
        )

    @classmethod
    def from_position_ids(cls, position_ids: Tensor) -> IndexPlan:
        """Packed rows of position ids, (S,) or (B, S) -> one sequence per run that counts up by one.

        A token starts a sequence where its position is not one more than its predecessor's, and
        at the start of every row: how transformers itself reads packed rows, and what
        ``DataCollatorWithFlattening`` and TRL's padding-free collators produce. Offsets index the
        B * S tokens of the flattened rows. One host sync: the start flags come over in one copy.
        """
        if not isinstance(position_ids, Tensor) or is_nested(position_ids):
            got = "a nested tensor" if isinstance(position_ids, Tensor) else type(position_ids).__name__
            raise input_error("position_ids", None, "a dense (seqlen,) or (batch, seqlen) tensor", got)
        if position_ids.dim() not in (1, 2) or position_ids.numel() == 0:
            raise input_error(
                "position_ids",
                None,
                "a non-empty (seqlen,) or (batch, seqlen) tensor",
                f"shape {tuple(position_ids.shape)}",
            )
        if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
            raise input_error("position_ids", None, "an integer tensor", f"dtype {position_ids.dtype}")
        rows = position_ids.reshape(-1, position_ids.shape[-1])
        restarts = torch.nn.functional.pad(rows.diff(dim=-1) != 1, (1, 0), value=True)
        starts = np.flatnonzero(device_to_host(restarts.flatten()))  # the one sync; the rest is host math
        offsets = np.append(starts, restarts.numel()).astype(np.int64)
        lengths = np.diff(offsets)
        device = position_ids.device
        lengths_d, offsets_d = host_to_device(np.concatenate([lengths, offsets]), device).split_with_sizes(
            [len(lengths), len(offsets)]
        )
        remember_host_lengths(offsets_d, lengths)
        return cls(
            lengths_d,
            offsets_d,
            total=restarts.numel(),
            starts=torch.zeros(len(starts), dtype=torch.int64, device=device),
            max_seqlen=int(lengths.max()),
            min_seqlen=int(lengths.min()),
        )

    @classmethod
    def from_nested(cls, nested: Tensor, *, width: int | None = None) -> IndexPlan:
        """Plan of a jagged nested tensor's rows (right padding). No sync if width is given.

        ``width`` must hold the longest row: checked on the host from the longest length the nested
        tensor records (nopad's all do), or from CPU offsets; device offsets without a record are not
        read for it (a sync): the caller vouches for the width then."""
        _refuse_dense(nested, "tensor")
        width = check_optional_int(width, "width", low=0, high=MAX_WIDTH)
        source = nested_offsets(nested)
        offsets = source.to(torch.int64)
        total = jagged_values(nested).shape[ragged_dim(nested) - 1]
        lengths = offsets.diff()
        plan = cls(
            lengths,
            offsets,
            total=total,
            width=width,
            starts=torch.zeros_like(lengths),
            max_seqlen=cached_seqlens(nested)[1],
            min_seqlen=cached_seqlens(nested)[0],
        )
        plan._end = plan._max_seqlen
        plan._nested_offsets = source
        if width is not None:
            plan._check_fits(width, "width")
        return plan

    # ---- derived quantities -------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def cu_seqlens(self) -> Tensor:
        """(B+1,) int32 offsets, as flash-attn and Megatron take them."""
        if self._cu_seqlens is None:
            self._cu_seqlens = self.offsets.to(torch.int32)
        return self._cu_seqlens

    @property
    def max_seqlen(self) -> int:
        """Longest row. One sync the first time if the constructor did not learn it."""
        if self._max_seqlen is None:
            self._max_seqlen, self._min_seqlen = to_host(self.lengths.max(), self.lengths.min())
        return self._max_seqlen

    @property
    def min_seqlen(self) -> int:
        """Shortest row. One sync the first time if the constructor did not learn it."""
        if self._min_seqlen is None:
            self._max_seqlen, self._min_seqlen = to_host(self.lengths.max(), self.lengths.min())
        return self._min_seqlen

    @property
    def row_ids(self) -> Tensor:
        """(total,) row of each packed token. No sync."""
        if self._row_ids is None:
            rows = torch.arange(self.batch_size, device=self.offsets.device)
            self._row_ids = spread_over_tokens(rows, self.offsets, self.total)
        return self._row_ids

    @property
    def position_ids(self) -> Tensor:
        """(total,) position of each packed token in its own sequence, from 0. No sync."""
        return position_ids_of(self.offsets, self.total)

    @property
    def last_token_mask(self) -> Tensor:
        """(total,) True at the last token of each sequence: its next-token label belongs to no one. No sync."""
        mask = torch.zeros(self.total, dtype=torch.bool, device=self.offsets.device)
        if self.total == 0:
            return mask
        # an empty row's "end - 1" is the previous row's last token (or, wrapped, the final token): already True
        return mask.index_fill_(0, (self.offsets[1:] - 1) % self.total, True)

    def next_token_labels(self, values: Tensor, pad_value: float | int = 0) -> Tensor:
        """(total, *) -> (total, *) next-token labels: token t's label is token t+1 OF ITS OWN SEQUENCE.

        The label slot of each sequence's last token (which no loss trains on: its next token
        belongs to no one) holds ``pad_value``, the same value as padding slots. This is nopad's ONE
        convention for that slot; the FSDP, Megatron (``need_roll``) and packing paths all produce it.
        No sync.
        """
        if values.shape[0] != self.total:
            raise input_error("values", None, f"{self.total} tokens on dim 0", f"shape {tuple(values.shape)}")
        last = self.last_token_mask.to(values.device).view(-1, *([1] * (values.dim() - 1)))
        pad = torch.as_tensor(pad_value, dtype=values.dtype, device=values.device)
        return torch.where(last, pad, values.roll(-1, 0))

    @property
    def indices(self) -> Tensor:
        """(total,) positions of the real tokens in the flattened (B * width) padded buffer."""
        if self._indices is None:
            if self.width is None or self.starts is None:
                raise input_error("width", None, "a plan with a padded width (build it with width=)", "none")
            rows = torch.arange(self.batch_size, device=self.offsets.device)
            self._indices = self.token_index(rows * self.width + self.starts)
        return self._indices

    def token_index(self, row_start: Tensor) -> Tensor:
        """(total,) ``row_start[b] + k`` for the k-th token of row b: where each token sits in a
        flat buffer whose row b begins at ``row_start[b]``. No sync."""
        if row_start.shape != (self.batch_size,):
            raise input_error("row_start", None, f"shape ({self.batch_size},)", f"{tuple(row_start.shape)}")
        shift = row_start.to(self.offsets.device) - self.offsets[:-1]
        return spread_over_tokens(shift, self.offsets, self.total, plus_position=True)

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    def made_from(self, mask: Tensor) -> bool:
        """Whether this plan was made from this very ``mask`` (:meth:`from_runs`' ``mask``), not edited since."""
        source = self._source_mask
        return source is not None and source[0]() is mask and source[1] == mask._version

    def to(self, device: torch.device | str, *, non_blocking: bool = True) -> IndexPlan:
        """The same plan on ``device``: lengths, offsets, starts and gather indices in ONE copy.

        A plan made on the host from host facts (a CPU attention mask, or lengths) drives the
        conversion of a batch that lives on a GPU without any device sync: the four index tensors
        travel together from pinned memory with one non-blocking copy, and total, width and the
        min / max lengths are already host ints. On the host side this materialises the indices.
        """
        device = torch.device(device)
        non_blocking = check_flag(non_blocking, "non_blocking")
        if self.device == device:
            return self
        if self._host is not None:  # rebuilt from its host arrays: a few (B,) values cross, not the indices
            host_lengths, host_starts, response_width = self._host
            assert self.width is not None  # from_runs always records it
            moved = IndexPlan.from_runs(
                host_lengths, host_starts, width=self.width, device=device, response_width=response_width
            )
            moved._source_mask = self._source_mask
            return moved
        parts = [self.lengths, self.offsets]
        if self.starts is not None:
            parts.append(self.starts)
        if self.width is not None:
            parts.append(self.indices)
        flat = torch.cat([p.to(torch.int64) for p in parts])
        if self.device.type == "cpu" and non_blocking:
            flat = host_to_device(device_to_host(flat), device)
        elif device.type == "cpu":
            flat = torch.from_numpy(device_to_host(flat))
        else:
            flat = flat.to(device, non_blocking=non_blocking)
        moved = flat.split([p.shape[0] for p in parts])
        lengths, offsets, *rest = moved
        starts = rest.pop(0) if self.starts is not None else None
        return IndexPlan(
            lengths,
            offsets,
            total=self.total,
            width=self.width,
            starts=starts,
            indices=rest[0] if rest else None,
            max_seqlen=self._max_seqlen,
            min_seqlen=self._min_seqlen,
        )

    # ---- moving tensors -----------------------------------------------------------------
    def pack(self, x: Tensor, seq_dim: int = 1) -> Tensor:
        """Padded (B, ..., S, ...) with the sequence at ``seq_dim`` -> (total, ...) real tokens."""
        self._check_padded(x, seq_dim)
        x = x if seq_dim == 1 else x.movedim(seq_dim, 1)
        return x.flatten(0, 1).index_select(0, self.indices)

    def unpack(self, values: Tensor, width: int | None = None) -> Tensor:
        """(total, *) -> padded (B, width, *) with zeros at padding; inverse of :meth:`pack`.

        No sync when the width is known. ``width`` may differ from the plan's only for
        right-padded plans (``starts`` all 0), e.g. to pad nested rows to a chosen width.
        """
        if not isinstance(values, Tensor) or values.dim() < 1 or values.shape[0] != self.total:
            got = f"shape {tuple(values.shape)}" if isinstance(values, Tensor) else type(values).__name__
            raise input_error("values", None, f"{self.total} tokens on dim 0", got)
        if width is not None:
            width = check_int(width, "width", low=0)
            if width != self.width and self.starts is not None:
                self._check_fits(width, "width")
        width = self._width(width)
        if self.starts is None:
            if width != self.width:
                raise input_error("width", None, f"the mask's width {self.width}", f"{width}")
            flat = put_rows(values, self.indices, self.batch_size * width)
            return flat.view(self.batch_size, width, *values.shape[1:])
        return gather_rows(values, self.offsets[:-1] - self.starts, self.starts, self.starts + self.lengths, width)

    def to_nested(self, values: Tensor, ragged_dim: int = 1) -> Tensor:
        """Wrap (total, *) values (or (C, total) for ragged_dim=2) in a jagged nested tensor.

        Every field of the plan shares one offsets tensor and one pair of min / max length records.
        """
        if not isinstance(values, Tensor) or values.dim() < ragged_dim or values.shape[ragged_dim - 1] != self.total:
            got = f"shape {tuple(values.shape)}" if isinstance(values, Tensor) else type(values).__name__
            raise input_error("values", None, f"{self.total} tokens on dim {ragged_dim - 1}", got)
        return self._wrap(values, ragged_dim)

    def _wrap(self, values: Tensor, ragged_dim: int) -> Tensor:
        """:meth:`to_nested` of values known to hold this plan's tokens (its own gathers')."""
        if self._seqlen_cache is None and self._max_seqlen is not None and self._min_seqlen is not None:
            self._seqlen_cache = seqlen_records(self._min_seqlen, self._max_seqlen)
        return wrap_jagged(
            values,
            self.offsets,
            ragged_dim,
            min_seqlen=self._min_seqlen,
            max_seqlen=self._max_seqlen,
            records=self._seqlen_cache,
        )

    def nest(self, x: Tensor, seq_dim: int = 1) -> Tensor:
        """Padded (B, S, *) -> nested (B, j, *); (B, C, S) with seq_dim=2 -> nested (B, C, j).

        The ragged dim is set explicitly, so all-equal lengths or B=1 never confuse torch.
        """
        values = self.pack(x, seq_dim)
        values = values if seq_dim == 1 else values.movedim(0, seq_dim - 1)
        return self._wrap(values, seq_dim)

    def unnest(self, nested: Tensor, width: int | None = None) -> Tensor:
        """Nested (B, j, *) or (B, C, j) -> padded (B, width, *) or (B, C, width).

        ``nested`` must have this plan's rows: checked by identity of its offsets (free), or on the
        CPU by value; device offsets that are another tensor are not read (the caller's contract)."""
        self.check_rows(nested, "nested")
        ragged = ragged_dim(nested)
        values = jagged_values(nested).movedim(ragged - 1, 0)
        return self.unpack(values, width).movedim(1, ragged)

    # ---- checks -------------------------------------------------------------------------
    def validate(self) -> IndexPlan:
        """Check the plan is self-consistent (one sync); raise ValueError naming the bad row."""
        lengths, offsets = self.lengths, self.offsets
        if offsets.shape != (self.batch_size + 1,) or lengths.dtype.is_floating_point:
            raise input_error(
                "offsets", None, f"an integer tensor of shape ({self.batch_size + 1},)", f"{tuple(offsets.shape)}"
            )
        starts = self.starts if self.starts is not None else torch.zeros_like(lengths)
        width = self.width if self.width is not None else torch.iinfo(torch.int64).max
        checks = {
            "length >= 0": lengths < 0,
            "offsets[b+1] - offsets[b] == lengths[b]": offsets.diff() != lengths,
            f"the run of real tokens to end within width {width}": starts + lengths > width,
        }
        first, last, *flags = to_host(offsets[0], offsets[-1], *(bad.any() for bad in checks.values()))
        if (first, last) != (0, self.total):
            raise input_error("offsets", None, f"boundaries from 0 to total {self.total}", f"{first}..{last}")
        for (expected, bad), flag in zip(checks.items(), flags):
            if flag:
                row = int(bad.nonzero()[0])
                raise input_error("lengths", row, expected, f"length {int(lengths[row])}, start {int(starts[row])}")
        return self

    def check_rows(self, nested: Tensor, field: str) -> None:
        """Refuse a nested tensor whose rows are not this plan's, where that is free: its offsets are
        the plan's own (or the ones it was read from) by identity, or live on the CPU and are compared
        by value (host memory, no device sync). Other offsets on a device are not read: a host sync
        would be the price, so the caller vouches for them."""
        _refuse_dense(nested, field)
        offsets = nested_offsets(nested)
        if offsets is self.offsets or offsets is self._nested_offsets:
            return
        expected = f"the plan's {self.batch_size} rows of {self.total} tokens"
        total = jagged_values(nested).shape[ragged_dim(nested) - 1]
        if offsets.shape[0] != self.batch_size + 1 or total != self.total:
            raise input_error(field, None, expected, f"{offsets.shape[0] - 1} rows of {total} tokens")
        if free_to_read(offsets, self.offsets):
            if not torch.equal(offsets.to(torch.int64), self.offsets):
                raise input_error(field, None, f"{expected} and their boundaries", "other boundaries (another batch?)")

    # ---- internals ----------------------------------------------------------------------
    def _check_fits(self, width: int, field: str) -> None:
        """Refuse a padded width that would cut a row (its gather would read past the row's end):
        from the host-known end of the longest run, or the CPU lengths (a read of host memory);
        device lengths with no host record are not read for it."""
        end = self._end
        if end is None and self._host is not None:  # from_runs: the host arrays it was laid out from
            host_lengths, host_starts, _ = self._host
            end = self._end = int((host_starts + host_lengths).max()) if len(host_lengths) else 0
        if end is None and self.batch_size and free_to_read(self.lengths):
            ends = self.lengths if self.starts is None else self.lengths + self.starts.to(self.lengths.device)
            end = self._end = int(ends.max())
        if end is not None and end > width:
            raise input_error(field, None, f">= {end}, where the longest run of real tokens ends", f"{width}")

    def _width(self, width: int | None) -> int:
        if width is not None:
            return width
        if self.width is not None:
            return self.width
        return self.max_seqlen

    def _check_padded(self, x: Tensor, seq_dim: int) -> None:
        if is_nested(x):
            raise input_error("tensor", None, "a padded (dense) tensor", "a nested tensor")
        if (
            x.dim() <= seq_dim
            or x.shape[0] != self.batch_size
            or (self.width is not None and x.shape[seq_dim] != self.width)
        ):
            raise input_error(
                "tensor",
                None,
                f"batch {self.batch_size} on dim 0 and width {self.width} on dim {seq_dim}",
                f"shape {tuple(x.shape)}",
            )

    def __repr__(self) -> str:
        return f"IndexPlan(batch={self.batch_size}, total={self.total}, width={self.width})"


class ResponseGather:
    """Where each response log-prob of a left/right padded batch is read and written: the way back.

    ``source`` (n,) positions in the (total,) outputs of the whole sequences (token t's log-prob is
    produced at position t - 1); ``slot`` (n,) positions in the flattened (B, R) padded output.
    Built once by :meth:`IndexPlan.from_runs`, so the way back is four ops.
    """

    def __init__(
        self, batch: int, width: int, total: int, source: Tensor, slot: Tensor, lengths: np.ndarray | None = None
    ) -> None:
        self.batch, self.width, self.total = batch, width, total
        self.source, self.slot = source, slot
        self._lengths = lengths  # each row's response length, on the host

    @property
    def longest(self) -> int:
        """The longest response (host arithmetic on the plan's own lengths; the width when unknown)."""
        if self._lengths is None:
            return self.width
        return int(self._lengths.max()) if len(self._lengths) else 0

    def unpad(self, values: Tensor) -> Tensor:
        """(total, *) -> (B, R, *), zero where a row has no response token. Four ops, no sync; autograd
        flows to ``values``."""
        if values.shape[0] != self.total:
            raise input_error("values", None, f"{self.total} tokens on dim 0", f"shape {tuple(values.shape)}")
        rest = values.shape[1:]
        padded = values.new_zeros((self.batch * self.width, *rest))
        padded = padded.index_copy(0, self.slot, values.index_select(0, self.source))
        return padded.view(self.batch, self.width, *rest)


# What nopad knows of offsets it laid out (THE identity memo, nopad.core._memo): their rows' lengths on the
# host, so later reorderings of those rows need no device sync, and for a left/right conversion the
# way back. Offsets are never matched by value: new rows always come with new offsets.


def response_gather(offsets: Tensor) -> ResponseGather | None:
    """The :class:`ResponseGather` planned with these very offsets (identity, not value), or None."""
    return recall(offsets, "responses")


def remember_host_lengths(offsets: Tensor, lengths: np.ndarray) -> None:
    """Record ``lengths`` (host int64, (B,)) as the row lengths of ``offsets`` (B+1,). The caller
    guarantees they are: every later :func:`known_host_lengths` trusts them (until the offsets are
    edited in place)."""
    remember(offsets, "lengths", lengths)


def known_host_lengths(offsets: Tensor) -> np.ndarray | None:
    """The host row lengths recorded for these very offsets (identity, not value), or None."""
    return recall(offsets, "lengths")


def _refuse_dense(x: object, field: str) -> None:
    """The plan's refusal of what is not a nested tensor (a dense one named with its shape)."""
    if not is_nested(x):
        got = f"a dense tensor of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise input_error(field, None, "a jagged nested tensor", got)


def _refuse_negative(lengths: Tensor, starts: Tensor | None) -> None:
    """The error for a negative length or start, naming the first such row (an error path: it reads)."""
    for field, values in (("lengths", lengths), ("starts", starts)):
        if values is not None and bool((values < 0).any()):
            row = int((values < 0).nonzero()[0])
            raise input_error(field, row, "a value >= 0", f"{int(values[row])}")
