"""Rows of a batch: select, chunk, split, concatenate, pad, cut into token-budget micro-batches and
put the outputs back in order, each a fixed number of tensor ops whatever the batch size.

A batch is a TensorDict with a batch dim whose entries are padded (B, *) tensors, jagged nested
(B, j, *) or (B, C, j) tensors (mrope position ids), sub-TensorDicts, ``NonTensorData`` (one value
for the batch) or ``NonTensorStack`` (one value per row). Every operation below is one reordering
of rows (:mod:`nopad.batches._reorder`): one gather per field with offsets from the permuted lengths, and a
split into consecutive parts is views of that one reordered buffer. Nested fields keep their
ragged dim, dtype and min / max length records; equal lengths stay nested.

Host syncs: at most one per call, the lengths of nested rows; none when nopad laid those offsets
out itself (a conversion, or an earlier call here), since it keeps their host copy.

    micro, restore = micro_batches(batch, max_token_len=16_384)   # balanced token-budget parts
    outputs = [model_step(m) for m in micro]                      # nested or padded outputs
    log_probs = restore(outputs)                                  # in the batch's own row order
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tensordict import TensorDict
from torch import Tensor

from nopad.batches._balance import Workload, micro_batch_partitions
from nopad.batches._reorder import (
    NESTED,
    RowPlan,
    batch_lengths,
    batch_size_of,
    cat_plan,
    chunk_plan,
    kind_of,
    pad_plan,
    select_plan,
    split_plan,
    take,
    take_nested,
    unpad_plan,
)
from nopad.core._errors import input_error
from nopad.core._layout import (
    device_to_host,
    jagged_values,
    known_host_lengths,
    nested_offsets,
    ragged_dim,
    remember_host_lengths,
)
from nopad.core._memo import recall, remember
from nopad.core._torch_internals import is_jagged, put_checked


def select_rows(data: TensorDict, index: Any) -> TensorDict:
    """``data[index]`` for a slice, row indices (repeats allowed) or a (B,) bool mask: the rows in
    ``index``'s order, every kind of field (see the module). An empty index gives a batch of 0 rows.
    One gather per field; at most one host sync (nested lengths nopad does not know yet), plus one if
    ``index`` is a tensor on a device."""
    return take([data], select_plan(data, index))[0]


def split_rows(data: TensorDict, sizes: Sequence[int]) -> list[TensorDict]:
    """Consecutive parts of ``sizes`` rows each (every size >= 1, summing to B): views of ``data``."""
    return take([data], split_plan(data, sizes))


def chunk_rows(data: TensorDict, chunks: int) -> list[TensorDict]:
    """``chunks`` consecutive parts of B / chunks rows (B must divide evenly): views of ``data``."""
    return take([data], chunk_plan(data, chunks))


def cat_rows(batches: Sequence[TensorDict]) -> TensorDict:
    """The rows of ``batches`` one after another. The batches must have the same entries, each of the
    same kind, dtype, device and per-row shape; ``NonTensorData`` equal in all stays one value, and
    values that differ become a per-row ``NonTensorStack`` (as ``torch.cat`` of TensorDicts does).
    One cat per field."""
    plan = cat_plan(batches)  # checks what ``batches`` is before it is listed
    return take(list(batches), plan)[0]


def pad_rows(data: TensorDict, divisor: int) -> tuple[TensorDict, int]:
    """``data`` with rows repeated from its start until B is a multiple of ``divisor``, and how many
    rows were added (verl's ``pad_to_divisor``; :func:`unpad_rows` takes them off). One gather per
    field when rows are added; ``data`` itself when none are."""
    plan, pad = pad_plan(data, divisor)
    return (data, 0) if plan is None else (take([data], plan)[0], pad)


def unpad_rows(data: TensorDict, pad: int) -> TensorDict:
    """``data`` without its last ``pad`` rows (views); the inverse of :func:`pad_rows`."""
    plan = unpad_plan(data, pad)
    return data if plan is None else take([data], plan)[0]


class RowRestore:
    """The way back from :func:`micro_batches`: outputs of the micro-batches, in their order, back
    in the batch's own row order, in one gather per field.

    ``partitions`` are the batch rows of each micro-batch (verl's ``batch_idx_list``).

    Outputs given one per micro-batch are checked to be theirs, for free: each must hold its
    micro-batch's number of rows, and a nested output that follows the rows (the offsets) of
    another of :func:`micro_batches`' micro-batches is refused, so outputs out of order are never
    put back into the wrong rows. (Two micro-batches of as many rows, given as outputs that carry
    nothing of their micro-batch, cannot be told apart.)
    """

    def __init__(self, partitions: list[list[int]]) -> None:
        if not isinstance(partitions, Sequence) or isinstance(partitions, (str, bytes)):
            expected = "a list of row-index lists, one per micro-batch (verl's batch_idx_list)"
            raise input_error("partitions", None, expected, type(partitions).__name__)
        self.partitions = partitions
        self._lengths: list[np.ndarray | None] = [None] * len(partitions)  # each micro-batch's row lengths
        # the memo key of "micro-batch i of this restore" on its outputs' offsets: a token of its own,
        # never another restore's (an id would be, once this restore is freed and its address reused)
        self._mark = ("micro-batch of", object())
        self.order = np.array([row for p in partitions for row in p], dtype=np.int64)
        _check_permutation(self.order)
        self.inverse = np.empty_like(self.order)
        self.inverse[self.order] = np.arange(len(self.order))

    @property
    def batch_size(self) -> int:
        return len(self.order)

    def __call__(self, outputs: Any) -> Any:
        """Outputs in the batch's row order, of the kind they came in.

        ``outputs``: a list with one output per micro-batch, each a nested or padded tensor, a
        TensorDict, a dict of those, or a list of per-row Python values; or one tensor, TensorDict
        or dict already joined in micro-batch order (as ``cat_rows`` or verl's join leaves it)."""
        parts: list[Any]
        if isinstance(outputs, (Tensor, Mapping)):
            parts = [outputs]
        elif isinstance(outputs, (list, tuple)) and len(outputs) == len(self.partitions):
            parts = list(outputs)
        else:
            got = f"a list of {len(outputs)}" if isinstance(outputs, (list, tuple)) else type(outputs).__name__
            expected = f"a list of {len(self.partitions)} outputs (one per micro-batch) or one joined output"
            raise input_error("outputs", None, expected, got)
        first = parts[0]
        if isinstance(first, TensorDict):
            return self._take(parts)
        if isinstance(first, Tensor):
            if len(parts) == len(self.partitions) > 1 and all(is_jagged(p) for p in parts):
                return self._take_nested(parts)
            return self._take([_wrap(p, "outputs") for p in parts])["x"]
        if isinstance(first, Mapping):
            keys = list(first.keys())
            joined = self._take([_wrap_all(p, keys) for p in parts])
            return {key: joined.get(key) for key in keys}
        if not all(isinstance(p, (list, tuple)) for p in parts):
            kinds = sorted({type(p).__name__ for p in parts})
            raise input_error("outputs", None, "tensors, TensorDicts, dicts or per-row lists", f"{kinds}")
        self._check_parts([len(p) for p in parts])
        items = [item for p in parts for item in p]
        return [items[i] for i in self.inverse.tolist()]

    def _take(self, parts: list[TensorDict]) -> TensorDict:
        sizes = [batch_size_of(p, "outputs") for p in parts]
        if len(parts) != len(self.partitions) or len(parts) == 1:  # one joined output
            if sum(sizes) != self.batch_size:
                raise input_error("outputs", None, f"{self.batch_size} rows in all (the batch's)", f"{sum(sizes)}")
        else:
            self._check_parts(sizes)
            for i, part in enumerate(parts):
                nested = (nested_offsets(v) for v in part.values() if isinstance(v, Tensor) and kind_of(v) == NESTED)
                self._check_owner(i, next(nested, None))
        rows = sum(sizes)
        return take(parts, RowPlan.of(self.inverse, [rows], rows))[0]

    def _take_nested(self, parts: list[Tensor]) -> Tensor:
        """One jagged output per micro-batch, joined in the batch's order without a TensorDict each."""
        offsets = [nested_offsets(p) for p in parts]
        self._check_parts([len(o) - 1 for o in offsets])
        for i, o in enumerate(offsets):
            self._check_owner(i, o)
        rows = self.batch_size
        return take_nested(parts, RowPlan.of(self.inverse, [rows], rows), "outputs")[0]

    def _check_parts(self, sizes: list[int]) -> None:
        """Each output holds its micro-batch's number of rows."""
        for i, (size, rows) in enumerate(zip(sizes, self.partitions)):
            if size != len(rows):
                raise input_error(f"outputs[{i}]", None, f"{len(rows)} rows, as micro-batch {i} holds", f"{size}")

    def _check_owner(self, i: int, offsets: Tensor | None) -> None:
        """The offsets of micro-batch ``i``'s first nested output are not another one's (one field
        tells: a part's outputs come from one micro-batch; each further field costs)."""
        owner = None if offsets is None else recall(offsets, self._mark)
        if owner is not None and owner != i:
            got = f"the rows of micro-batch {owner} (outputs out of order?)"
            raise input_error(f"outputs[{i}]", None, f"the rows of micro-batch {i}", got)
        expected = self._lengths[i]
        if offsets is None or expected is None or owner is not None:
            return
        # offsets of its own (a model's output, a clone): its rows' lengths, where they are free to read
        lengths = known_host_lengths(offsets)
        if lengths is None and offsets.device.type == "cpu":
            lengths = np.diff(offsets.numpy())
        if lengths is not None and not np.array_equal(lengths, expected):
            shown = lambda a: str(a.tolist()) if len(a) <= 8 else f"{str(a[:8].tolist())[:-1]}, ...]"  # noqa: E731
            got = f"rows of lengths {shown(lengths)} (another micro-batch's or another batch's output?)"
            raise input_error(f"outputs[{i}]", None, f"the rows of micro-batch {i}, of lengths {shown(expected)}", got)

    def _remember_offsets(self, micro: list[TensorDict]) -> None:
        for i, part in enumerate(micro):
            for value in part.values():
                if isinstance(value, Tensor) and kind_of(value) == NESTED:
                    offsets = nested_offsets(value)
                    remember(offsets, self._mark, i)
                    if self._lengths[i] is None:
                        self._lengths[i] = known_host_lengths(offsets)

    def __repr__(self) -> str:
        return f"RowRestore(rows={self.batch_size}, micro_batches={len(self.partitions)})"


def _check_permutation(order: np.ndarray) -> None:
    """The partitions hold every row 0..n-1 exactly once: a repeated row would leave another row of the
    restored output unwritten (uninitialised memory), a missing one would be read from nowhere."""
    n = len(order)
    if n == 0:
        return
    if order.min() < 0 or order.max() >= n:
        bad = int(order.min()) if order.min() < 0 else int(order.max())
        raise input_error("partitions", None, f"rows 0..{n - 1} (one per row of the batch)", f"row {bad}")
    seen = np.bincount(order, minlength=n)
    if (seen != 1).any():
        row = int(np.flatnonzero(seen != 1)[0])
        expected = f"each of the rows 0..{n - 1} in exactly one partition"
        raise input_error("partitions", None, expected, f"row {row} in {int(seen[row])}")


def _wrap(x: Any, field: str) -> TensorDict:
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise input_error(field, None, "a tensor with a batch dim", type(x).__name__)
    td = TensorDict({}, batch_size=[x.size(0)], device=None)
    put_checked(td, "x", x)
    return td


def _wrap_all(mapping: Mapping[str, Any], keys: list[str]) -> TensorDict:
    if sorted(mapping.keys()) != sorted(keys):
        raise input_error("outputs", None, f"every output with the keys {sorted(keys)}", f"{sorted(mapping.keys())}")
    sizes = {key: v.size(0) for key, v in mapping.items() if isinstance(v, Tensor)}
    batch = next(iter(sizes.values())) if sizes else len(next(iter(mapping.values())))
    td = TensorDict({}, batch_size=[batch], device=None)
    for key in keys:
        value = mapping[key]
        if isinstance(value, Tensor):
            if value.size(0) != batch:
                raise input_error(f"outputs[{key!r}]", None, f"{batch} rows like the other outputs", f"{value.size(0)}")
            put_checked(td, key, value)
        else:
            td.set(key, value)
    return td


def micro_batches(
    data: TensorDict,
    max_token_len: int,
    *,
    dp_group: Any = None,
    num_batches_divided_by: int | None = None,
    min_num_micro_batch: int | None = None,
    balance: bool = True,
    force_group_size: int = 1,
    workload: Workload | None = None,
    lengths: Any = None,
) -> tuple[list[TensorDict], RowRestore]:
    """Cut ``data`` into balanced micro-batches of at most ``max_token_len`` tokens each, and the
    :class:`RowRestore` that puts their outputs back: verl's ``rearrange_micro_batches`` (see
    :func:`nopad.batches.micro_batch_partitions` for the options), with the micro-batches views of
    one reordered batch (one gather per field). ``lengths``: the rows' lengths on the host, if the
    caller has them (else read from nested ``input_ids`` or a padded ``attention_mask``)."""
    batch = batch_size_of(data)
    row_lengths = batch_lengths(data) if lengths is None else _given_lengths(lengths, data)
    partitions = micro_batch_partitions(
        row_lengths,
        max_token_len,
        dp_group=dp_group,
        num_batches_divided_by=num_batches_divided_by,
        min_num_micro_batch=min_num_micro_batch,
        balance=balance,
        force_group_size=force_group_size,
        workload=workload,
    )
    restore = RowRestore(partitions)
    micro = take([data], RowPlan.of(restore.order, [len(p) for p in partitions], batch))
    restore._remember_offsets(micro)
    return micro, restore


def _given_lengths(lengths: Any, data: TensorDict) -> np.ndarray:
    """The caller's host lengths of the rows, checked where it is free: one per row, integers >= 0,
    summing to nested ``input_ids``' token count, equal to its offsets when those are on the CPU.
    Then recorded for those offsets, so the micro-batches need no sync (trusted on a device)."""
    batch = int(data.batch_size[0])
    array = device_to_host(lengths) if isinstance(lengths, Tensor) else np.asarray(lengths)
    if array.shape != (batch,) or not np.issubdtype(array.dtype, np.integer) or (array < 0).any():
        got = f"{array.dtype} of shape {array.shape}"
        raise input_error("lengths", None, f"{batch} integers >= 0, one per row", got)
    array = array.astype(np.int64)
    ids = data.get("input_ids", None) if "input_ids" in data.keys() else None
    if ids is not None and kind_of(ids) == NESTED and known_host_lengths(nested_offsets(ids)) is None:
        offsets = nested_offsets(ids)
        total = jagged_values(ids).shape[ragged_dim(ids) - 1]
        if int(array.sum()) != total:
            raise input_error("lengths", None, f"lengths summing to input_ids' {total} tokens", f"{int(array.sum())}")
        actual = np.diff(offsets.numpy()) if offsets.device.type == "cpu" else array
        if not np.array_equal(actual, array):
            row = int(np.flatnonzero(actual != array)[0])
            raise input_error("lengths", row, f"input_ids' length {int(actual[row])}", f"{array[row]}")
        remember_host_lengths(offsets, array)
    return array
