"""Rows of TensorDict batches taken in a new order and cut into consecutive parts: THE reordering
behind select, chunk, split, concatenate, pad, micro-batches and their restore.

One host plan per call: which source row each output row reads (``rows``, into the concatenation
of the source parts) and how many output rows each part gets (``sizes``). The lengths of nested
rows come to the host once (one copy for every field, none when nopad laid the offsets out
itself), all index arrays go to the device in one copy, and then each field costs a fixed number
of ops whatever the batch size and the number of parts:

    nested (B, j, *)      cat (several sources) + one gather of its tokens + one split into parts
    nested (B, C, j)      the same, plus one copy per part (a part's values must be contiguous)
    dense (B, *)          cat + one gather of its rows + one split
    NonTensorData         shared (equal across sources), NonTensorStack: its items reordered

Parts of a reordering are views of one reordered buffer; with rows in their own order (chunk, split)
they are views of the source itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from nopad.core._errors import check_int, check_selection_mask, input_error, mask_error
from nopad.core._layout import (
    device_to_host,
    expand_ranges,
    gather_index_dtype,
    host_offsets,
    host_ranges,
    host_starts,
    host_to_device,
    is_jagged,
    is_nested,
    jagged_values,
    known_host_lengths,
    nested_offsets,
    ragged_dim,
    range_steps,
    remember_host_lengths,
    seqlen_records,
    spread_over_tokens,
    wrap_jagged,
)
from nopad.core._torch_internals import put_checked, ragged_size_of

NESTED, DENSE, SUB, DATA, STACK = "nested", "dense", "tensordict", "NonTensorData", "NonTensorStack"


def kind_of(value: Any) -> str:
    """Which of the five kinds of batch entry ``value`` is (see the module docstring)."""
    name = type(value).__name__
    if name in (DATA, STACK):
        return name
    if isinstance(value, TensorDict):
        return SUB
    if isinstance(value, Tensor):
        if is_jagged(value):
            return NESTED
        if is_nested(value):  # a strided nested tensor has no offsets to move
            raise input_error("batch entry", None, "a jagged nested tensor (layout=torch.jagged)", "a strided one")
        return DENSE
    return DATA  # a value tensordict stores as metadata in some other wrapper


@dataclass(frozen=True)
class RowPlan:
    """Output row i reads source row ``rows[i]`` (of the sources concatenated); output part p holds
    the next ``sizes[p]`` rows. Host int64 arrays; ``rows`` None keeps every source row in order."""

    rows: np.ndarray | None
    sizes: np.ndarray
    source_rows: int

    @classmethod
    def of(cls, rows: np.ndarray | None, sizes: Sequence[int] | np.ndarray, source_rows: int) -> RowPlan:
        sizes = np.asarray(sizes, dtype=np.int64)
        if rows is not None and len(rows) == source_rows and np.array_equal(rows, np.arange(source_rows)):
            rows = None  # every row in its own order: no gather at all
        return cls(rows, sizes, source_rows)

    @property
    def count(self) -> int:
        return int(self.sizes.sum())

    @property
    def starts(self) -> np.ndarray:
        """(parts,) first output row of each part."""
        return host_starts(self.sizes)

    def pick(self, per_row: np.ndarray) -> np.ndarray:
        """A host per-source-row array in output order."""
        return per_row if self.rows is None else per_row[self.rows]


# ---- plans of the row operations, their arguments checked ---------------------------------------
def batch_size_of(data: Any, field: str = "data") -> int:
    """B of a TensorDict with a batch dim; anything else is refused naming ``field``."""
    if not isinstance(data, TensorDict) or data.batch_dims < 1:
        got = type(data).__name__
        if isinstance(data, TensorDict):
            got += f" with batch size {list(data.batch_size)}"
        raise input_error(field, None, "a TensorDict with a batch dim", got)
    return int(data.batch_size[0])


def row_index(index: Any, batch: int) -> np.ndarray:
    """Rows named by a slice, ints, an int tensor or array, or a (B,) bool mask -> host int64 (n,).
    A tensor on a device is read (one host sync)."""
    if isinstance(index, slice):
        return np.arange(batch, dtype=np.int64)[index]
    if np.ndim(index) == 0:
        raise input_error(
            "index", None, "a slice, row indices or a bool mask (an int would drop the batch dim)", repr(index)
        )
    if isinstance(index, Tensor) and index.dtype == torch.uint8:  # torch indexes with one as a mask, numpy as rows
        raise input_error(
            "index", None, "integer row indices or a bool mask", "a uint8 tensor (ambiguous: use .bool())"
        )
    array = device_to_host(index) if isinstance(index, Tensor) else np.asarray(index)
    if array.ndim != 1:
        raise input_error("index", None, "a 1-D index of rows", f"shape {array.shape}")
    if array.dtype == np.bool_:
        if len(array) != batch:
            raise input_error("index", None, f"a bool mask of {batch} rows", f"{len(array)} entries")
        return np.flatnonzero(array).astype(np.int64)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise input_error("index", None, "integer row indices or a bool mask", f"values of dtype {array.dtype}")
    bad = (array < -batch) | (array >= batch)
    if bad.any():
        where = int(np.flatnonzero(bad)[0])
        raise input_error("index", where, f"a row in [-{batch}, {batch})", f"{array[where]}")
    return np.where(array < 0, array + batch, array).astype(np.int64)


def select_plan(data: TensorDict, index: Any) -> RowPlan:
    batch = batch_size_of(data)
    rows = row_index(index, batch)
    return RowPlan.of(rows, [len(rows)], batch)


def split_plan(data: TensorDict, sizes: Sequence[int]) -> RowPlan:
    batch = batch_size_of(data)
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise input_error("sizes", None, f"a list of part sizes summing to the batch's {batch} rows", repr(sizes))
    counts = [check_int(s, f"sizes[{i}]", low=1) for i, s in enumerate(sizes)]
    if not counts or sum(counts) != batch:
        raise input_error("sizes", None, f"part sizes >= 1 that sum to the batch's {batch} rows", f"{list(sizes)}")
    return RowPlan.of(None, counts, batch)


def chunk_plan(data: TensorDict, chunks: int) -> RowPlan:
    batch = batch_size_of(data)
    n = check_int(chunks, "chunks", low=1)
    if batch % n or batch == 0:
        raise input_error("chunks", None, f"a divisor of the batch's {batch} rows", f"{n}")
    return RowPlan.of(None, [batch // n] * n, batch)


def cat_plan(batches: Sequence[TensorDict]) -> RowPlan:
    if isinstance(batches, TensorDict) or not isinstance(batches, Sequence) or not batches:
        raise input_error("batches", None, "a non-empty list of TensorDicts", type(batches).__name__)
    rows = sum(batch_size_of(b, f"batches[{i}]") for i, b in enumerate(batches))
    return RowPlan.of(None, [rows], rows)


def pad_plan(data: TensorDict, divisor: int) -> tuple[RowPlan | None, int]:
    """Rows repeated from the start up to a multiple of ``divisor`` (None: none needed), and how many."""
    batch = batch_size_of(data)
    d = check_int(divisor, "divisor", low=1)
    if batch == 0:
        raise input_error("data", None, "at least one row to repeat", "an empty batch")
    pad = -batch % d
    if pad == 0:
        return None, 0
    rows = np.concatenate([np.arange(batch), np.arange(pad) % batch]).astype(np.int64)
    return RowPlan.of(rows, [len(rows)], batch), pad


def unpad_plan(data: TensorDict, pad: int) -> RowPlan | None:
    """All rows but the last ``pad`` (None: pad is 0)."""
    batch = batch_size_of(data)
    n = check_int(pad, "pad", low=0, high=batch)
    return None if n == 0 else RowPlan.of(np.arange(batch - n, dtype=np.int64), [batch - n], batch)


def take(sources: Sequence[TensorDict], plan: RowPlan, *, reindex: bool = True) -> list[TensorDict]:
    """The parts of ``plan`` over ``sources``: TensorDicts with a batch dim and the same entries.

    Args:
        sources: the batches whose rows, concatenated, ``plan`` reads.
        plan: which source row each output row reads, and how many rows each part gets.
        reindex: metadata that positions tokens in a padded layout (registered with
            :func:`register_relayout`: the conversion's ``indices``) is laid out again for the parts'
            rows, as converting the parts' padded rows would make it; False shares it like any other
            metadata (verl's way).

    Returns:
        One TensorDict per part, ``plan.sizes[p]`` rows each, with every entry of the sources.

    At most one host sync (the lengths of nested rows nopad did not lay out itself) and one
    host->device copy; then a fixed number of ops per field.
    """
    first = sources[0]
    kinds = {str(key): kind_of(first.get(key)) for key in first.keys()}
    _check_alike(sources, list(kinds), kinds)
    widths = _relayout_widths(sources, kinds) if reindex else {}
    gathers = _Gathers.of(sources, kinds, plan, widths)
    parts = [
        TensorDict({}, batch_size=[size, *first.batch_size[1:]], device=first.device) for size in plan.sizes.tolist()
    ]
    for key, kind in kinds.items():
        pieces = gathers.parts_of(key, kind, [src.get(key) for src in sources])
        put = _set_meta if key in widths or kind in (DATA, STACK) else put_checked
        for part, piece in zip(parts, pieces):
            put(part, key, piece)
    return parts


@dataclass(frozen=True)
class Relayout:
    """Metadata that places the tokens of nested field ``rows_of`` in a padded layout of some width:
    ``width(sources, kinds)`` tells whether the sources carry it (the width, or None), and
    :func:`take` lays it out again for the parts' rows (each token's column, plus its row's start)."""

    rows_of: str
    width: Any


# metadata key -> its relayout; the modules that make such metadata register it (the row code knows no
# field names)
RELAYOUTS: dict[str, Relayout] = {}


def register_relayout(key: str, relayout: Relayout) -> None:
    RELAYOUTS[key] = relayout


def _relayout_widths(sources: Sequence[TensorDict], kinds: dict[str, str]) -> dict[str, int]:
    """Each registered relayout metadata the sources carry -> the width of its padded layout."""
    widths = {}
    for key, relayout in RELAYOUTS.items():
        width = relayout.width(sources, kinds) if key in kinds else None
        if width is not None:
            widths[key] = width
    return widths


def _check_alike(sources: Sequence[TensorDict], keys: list[str], kinds: dict[str, str]) -> None:
    for i, src in enumerate(sources):
        if not isinstance(src, TensorDict) or src.batch_dims < 1:
            got = f"{type(src).__name__} with batch size {list(getattr(src, 'batch_size', []))}"
            raise input_error(f"batch {i}", None, "a TensorDict with a batch dim", got)
        if i and sorted(src.keys()) != sorted(keys):
            raise input_error(f"batch {i}", None, f"the keys of batch 0 {sorted(keys)}", f"{sorted(src.keys())}")
        for key in keys if i else ():
            value, value0 = src.get(key), sources[0].get(key)
            if _family(kind_of(value)) != _family(kinds[key]):
                raise input_error(f"batch {i}[{key!r}]", None, f"{kinds[key]} as in batch 0", kind_of(value))
            if kinds[key] in (NESTED, DENSE):
                _check_same_rows(value, value0, f"batch {i}[{key!r}]", kinds[key] == NESTED)


def _family(kind: str) -> str:
    """Metadata joins metadata: one value per batch (NonTensorData) and one per row (a stack) mix."""
    return "metadata" if kind in (DATA, STACK) else kind


def _check_same_rows(value: Tensor, value0: Tensor, field: str, nested: bool, like: str = "batch 0") -> None:
    """The same dtype, device and per-row shape as ``like``'s field: rows of both go in one tensor."""
    if nested:
        ragged = ragged_dim(value)
        v, v0 = jagged_values(value), jagged_values(value0)
        shape, shape0 = v.shape[: ragged - 1] + v.shape[ragged:], v0.shape[: ragged - 1] + v0.shape[ragged:]
        if ragged != ragged_dim(value0):
            raise input_error(field, None, f"the ragged dim at {ragged_dim(value0)} as in {like}", f"{ragged}")
    else:
        v, v0, shape, shape0 = value, value0, value.shape[1:], value0.shape[1:]
    if v.dtype != v0.dtype or v.device != v0.device or shape != shape0:
        expected = f"rows of shape {tuple(shape0)}, {v0.dtype} on {v0.device} as in {like}"
        raise input_error(field, None, expected, f"rows of shape {tuple(shape)}, {v.dtype} on {v.device}")


def _host_lengths(all_offsets: list[Tensor]) -> list[np.ndarray]:
    """Host row lengths of each offsets tensor, in order: recorded ones free, the rest in ONE
    device->host copy (the sync of a call), then recorded. A tensor listed twice is read once (found
    by ``id()``, which lives only in this call: ``all_offsets`` holds every tensor alive)."""
    found: dict[int, np.ndarray] = {}
    unknown: dict[int, Tensor] = {}
    for offsets in all_offsets:
        if id(offsets) in found or id(offsets) in unknown:
            continue
        host = known_host_lengths(offsets)
        if host is None:
            unknown[id(offsets)] = offsets
        else:
            found[id(offsets)] = host
    if unknown:
        tensors = list(unknown.values())
        flat = torch.cat([o.to(torch.int64).diff() for o in tensors]) if len(tensors) > 1 else tensors[0].diff()
        host = device_to_host(flat.to(torch.int64))
        for offsets, lengths in zip(tensors, np.split(host, np.cumsum([len(o) - 1 for o in tensors])[:-1])):
            found[id(offsets)] = lengths
            remember_host_lengths(offsets, lengths)
    return [found[id(offsets)] for offsets in all_offsets]


class _TokenGroup:
    """The nested fields that share their sources' offsets: their token gather and the parts' offsets."""

    def __init__(self, lengths: np.ndarray, plan: RowPlan, width: int | None = None) -> None:
        source_offsets = host_offsets(lengths)
        self.sources_total = int(source_offsets[-1])  # the gathers read tokens below it
        self.lengths = plan.pick(lengths)  # output row lengths
        self.plan = plan
        offsets = host_offsets(self.lengths)
        self.total = int(offsets[-1])
        bounds = offsets[host_offsets(plan.sizes)]
        self.tokens_per_part = np.diff(bounds)
        # every part's offsets, rebased to 0, back to back: (rows + parts,)
        at = host_ranges(plan.starts, plan.sizes + 1)
        self.part_offsets = offsets[at] - np.repeat(bounds[:-1], plan.sizes + 1)
        self.steps = None
        if plan.rows is not None:
            self.steps = range_steps(source_offsets[plan.rows], self.lengths)
        self.row_starts: np.ndarray | None = None  # each output row's first padded slot in its part
        if width is not None:
            local_row = np.arange(plan.count) - np.repeat(plan.starts, plan.sizes)
            self.row_starts = np.concatenate([offsets, local_row * width])
        self.token_index: Tensor | None = None
        self.offsets: list[Tensor] = []
        self.row_starts_d: Tensor | None = None
        self._part_seqlens: list[dict[str, Any]] | None = None

    def host_arrays(self) -> list[np.ndarray]:
        extra = [] if self.row_starts is None else [self.row_starts]
        return [self.part_offsets, *extra, *(self.steps or ())]

    def take_device(self, arrays: list[Tensor]) -> None:
        part_offsets, *rest = arrays
        if self.row_starts is not None:
            self.row_starts_d = rest.pop(0)
        self.offsets = list(part_offsets.split_with_sizes((self.plan.sizes + 1).tolist()))
        if rest:
            self.token_index = expand_ranges(rest[0], rest[1], self.total, gather_index_dtype(self.sources_total))
        for offsets, lengths in zip(self.offsets, np.split(self.lengths, np.cumsum(self.plan.sizes)[:-1])):
            remember_host_lengths(offsets, lengths)

    def cut(self, values: list[Tensor]) -> list[Tensor]:
        """The field's parts: its sources' tokens, gathered in output order, split into parts."""
        ragged = ragged_dim(values[0])
        dim = ragged - 1
        flat = [jagged_values(v) for v in values]
        tokens = flat[0] if len(flat) == 1 else torch.cat(flat, dim)
        if self.token_index is not None:
            tokens = tokens.index_select(dim, self.token_index.to(tokens.device))
        sizes = self.tokens_per_part.tolist()
        pieces = [tokens] if len(sizes) == 1 else list(tokens.split_with_sizes(sizes, dim))
        if dim > 0 and len(sizes) > 1:  # a (C, t) slice of (C, total) is strided: parts must be contiguous
            pieces = [p.contiguous() for p in pieces]
        return [
            wrap_jagged(piece, offsets, ragged, **seqlens)
            for piece, offsets, seqlens in zip(pieces, self.offsets, self.part_seqlens())
        ]

    def part_seqlens(self) -> list[dict[str, Any]]:
        """Each part's min / max row length and ragged size, as wrap_jagged takes them: two reductions
        for all parts (made once for the group; every nested field of it shares them)."""
        if self._part_seqlens is None:
            sizes = self.plan.sizes
            starts = self.plan.starts[sizes > 0]
            low = np.minimum.reduceat(self.lengths, starts).tolist() if len(starts) else []
            high = np.maximum.reduceat(self.lengths, starts).tolist() if len(starts) else []
            found = iter(zip(low, high))
            self._part_seqlens = []
            for size in sizes.tolist():
                if size == 0:
                    self._part_seqlens.append({})
                    continue
                a, b = next(found)
                records = seqlen_records(a, b)
                self._part_seqlens.append({"min_seqlen": a, "max_seqlen": b, "records": records})
            for seqlens, offsets in zip(self._part_seqlens, self.offsets):
                seqlens["ragged_size"] = ragged_size_of(offsets)
        return self._part_seqlens

    def padded_positions(self, indices: list[Tensor], width: int) -> list[Tensor]:
        """Each part's ``indices``: the column of every token in its padded row (``indices % width``,
        which moving a row does not change), gathered like the tokens, plus its row's start in the
        part's flattened (rows, width) layout. A fixed number of ops for all parts."""
        assert self.row_starts_d is not None
        positions = indices[0] if len(indices) == 1 else torch.cat(indices)
        columns = positions.remainder(width)
        if self.token_index is not None:
            columns = columns.index_select(0, self.token_index.to(columns.device))
        offsets, row_start = self.row_starts_d.to(columns.device).split_with_sizes(
            [self.plan.count + 1, self.plan.count]
        )
        columns = columns + spread_over_tokens(row_start, offsets, self.total).to(columns.dtype)
        sizes = self.tokens_per_part.tolist()
        return [columns] if len(sizes) == 1 else list(columns.split_with_sizes(sizes))


def _offset_groups(sources: Sequence[TensorDict], nested: list[str]) -> list[list[str]]:
    """The nested fields grouped by the offsets they share in every source: one token gather serves a
    group. Shared means the same tensors (``id()``, only within this call, the sources holding them):
    comparing values would read them."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for key in nested:
        groups.setdefault(tuple(id(nested_offsets(src.get(key))) for src in sources), []).append(key)
    return list(groups.values())


@dataclass(frozen=True)
class _Gathers:
    """One :func:`take`'s index arrays, on the device: the token group of each nested field (the
    fields of one offset group share it), the dense fields' rows (None: kept in order), and the
    widths of the relayout metadata the sources carry."""

    plan: RowPlan
    groups: dict[str, _TokenGroup]
    rows: Tensor | None
    widths: dict[str, int]

    @classmethod
    def of(
        cls, sources: Sequence[TensorDict], kinds: dict[str, str], plan: RowPlan, widths: dict[str, int]
    ) -> _Gathers:
        """Planned on the host, then every array in ONE host->device copy (:func:`_move`). At most one
        host sync: the lengths of nested rows nopad did not lay out itself."""
        nested = [key for key, kind in kinds.items() if kind == NESTED]
        shared = _offset_groups(sources, nested)
        lengths = _host_lengths([nested_offsets(src.get(keys[0])) for keys in shared for src in sources])
        n = len(sources)  # lengths: n arrays per offset group, one per source
        groups: dict[str, _TokenGroup] = {}
        made: list[_TokenGroup] = []
        for i, keys in enumerate(shared):
            # a relayout positions the tokens of its ``rows_of`` field: that field's group also lays out
            # each output row's start in its part's padded (rows, width) layout
            width = next((w for key, w in widths.items() if RELAYOUTS[key].rows_of in keys), None)
            group = _TokenGroup(np.concatenate(lengths[i * n : (i + 1) * n]), plan, width)
            groups.update(dict.fromkeys(keys, group))
            made.append(group)
        has_dense = any(kind == DENSE for kind in kinds.values())
        extra = [plan.rows] if has_dense and plan.rows is not None else []
        moved = _move(extra, made, _device_of(sources[0], nested)) if extra or made else []
        return cls(plan, groups, moved[0] if extra else None, widths)

    def parts_of(self, key: str, kind: str, values: list[Any]) -> Sequence[Any]:
        """One field's value in each part, from its ``values`` in the sources."""
        if key in self.widths:  # each token's padded position, laid out again for the parts' rows
            group = self.groups[RELAYOUTS[key].rows_of]
            return group.padded_positions([v.data for v in values], self.widths[key])
        if kind == NESTED:
            return self.groups[key].cut(values)
        if kind == DENSE:
            return _dense_parts(values, self.rows, self.plan)
        if kind == SUB:
            return take(values, self.plan)
        return _non_tensor_parts(values, self.plan)


def _move(extra: list[np.ndarray], groups: list[_TokenGroup], device: torch.device) -> list[Tensor]:
    """``extra`` and every group's host arrays on ``device`` in ONE host->device copy; the groups take
    theirs, ``extra`` comes back."""
    arrays = [*extra, *(a for group in groups for a in group.host_arrays())]
    moved = list(host_to_device(np.concatenate(arrays), device).split_with_sizes([len(a) for a in arrays]))
    at = len(extra)
    for group in groups:
        count = len(group.host_arrays())
        group.take_device(moved[at : at + count])
        at += count
    return moved[: len(extra)]


def take_nested(values: Sequence[Tensor], plan: RowPlan, field: str) -> list[Tensor]:
    """The parts of ``plan`` over the jagged tensors ``values`` (one field's sources, in order): what
    :func:`take` makes of batches holding only that field, without a TensorDict per source (a
    restore joins a hundred micro-batches' outputs; a TensorDict each costs more than their gather).
    At most one host sync, as :func:`take`."""
    for i, value in enumerate(values[1:], 1):
        _check_same_rows(value, values[0], f"{field}[{i}]", True, f"{field}[0]")
    offsets = [nested_offsets(v) for v in values]
    group = _TokenGroup(np.concatenate(_host_lengths(offsets)), plan)
    _move([], [group], offsets[0].device)
    return group.cut(list(values))


def _device_of(batch: TensorDict, nested: list[str]) -> torch.device:
    if nested:
        return nested_offsets(batch.get(nested[0])).device
    for value in batch.values():
        if isinstance(value, Tensor):
            return value.device
    return torch.device("cpu")


def _dense_parts(values: list[Tensor], rows: Tensor | None, plan: RowPlan) -> list[Tensor]:
    tensor = values[0] if len(values) == 1 else torch.cat(values)
    if rows is not None:
        tensor = tensor.index_select(0, rows.to(tensor.device))
    sizes = plan.sizes.tolist()
    return [tensor] if len(sizes) == 1 else list(tensor.split_with_sizes(sizes))


def _non_tensor_parts(values: list[Any], plan: RowPlan) -> list[Any]:
    """Metadata of each part: one shared value (NonTensorData equal in every source), or the
    per-row items of a NonTensorStack (or of sources whose NonTensorData differ) reordered."""
    kinds = {kind_of(v) for v in values}
    if kinds == {DATA}:
        data = [v.data if kind_of(v) == DATA and hasattr(v, "data") else v for v in values]
        if all(_same_value(d, data[0]) for d in data[1:]):
            return [data[0]] * len(plan.sizes)
        items = [d for d, src in zip(data, values) for _ in range(_rows_of(src))]
    else:
        items = [item for v in values for item in _stack_items(v)]
    ordered = plan.pick(np.arange(len(items))).tolist()
    starts = plan.starts.tolist()
    return [
        _stack([items[i] for i in ordered[start : start + size]]) for start, size in zip(starts, plan.sizes.tolist())
    ]


def _stack(items: list[Any]) -> Any:
    from tensordict import NonTensorData, NonTensorStack

    return NonTensorStack.from_list([NonTensorData(item) for item in items])  # type: ignore[misc]


def _set_meta(part: TensorDict, key: str, meta: Any) -> None:
    """Put a part's metadata: a per-row stack, or one value for the part. A stack of no rows, which
    tensordict <= 0.10 cannot hold, goes in as the empty list (it joins other batches as no rows)."""
    if kind_of(meta) != STACK:
        part.set_non_tensor(key, meta)
        return
    try:
        part.set(key, meta)
    except IndexError:
        if len(part) != 0:
            raise
        part.set_non_tensor(key, [])


def _rows_of(value: Any) -> int:
    shape = getattr(value, "batch_size", None)
    return int(shape[0]) if shape else 1


def _stack_items(value: Any) -> list[Any]:
    if kind_of(value) == STACK:
        return list(value.tolist())
    return [value.data] * _rows_of(value)


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, (Tensor, np.ndarray)) or isinstance(b, (Tensor, np.ndarray)):
        return False  # compared by identity only: comparing values would read them
    try:
        return bool(a == b)
    except Exception:
        return False


def batch_lengths(data: TensorDict) -> np.ndarray:
    """(B,) host lengths of a batch's rows: its nested ``input_ids`` (free when nopad laid them out,
    else one host sync), or the ones of a padded ``attention_mask`` (one host sync)."""
    ids = data.get("input_ids", None) if "input_ids" in data.keys() else None
    if ids is not None and kind_of(ids) == NESTED:
        offsets = nested_offsets(ids)
        known = known_host_lengths(offsets)
        return known if known is not None else device_to_host(offsets.diff()).astype(np.int64, copy=False)
    mask = data.get("attention_mask", None) if "attention_mask" in data.keys() else None
    if isinstance(mask, Tensor) and mask.dim() == 2:
        only_01 = check_selection_mask(mask, "data['attention_mask']")  # a float mask of 0.5s is no mask
        counts = (mask != 0).sum(-1)
        if only_01 is None:
            return device_to_host(counts).astype(np.int64, copy=False)
        host = device_to_host(torch.cat([counts, only_01.long().reshape(1)]))  # the check in the same read
        if not host[-1]:
            raise mask_error(mask, "data['attention_mask']")
        return host[:-1].astype(np.int64, copy=False)
    raise input_error("data", None, "a nested input_ids or a padded (B, S) attention_mask", f"keys {list(data.keys())}")
