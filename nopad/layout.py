"""The index plan: where each real token of a batch lives in the padded, nested and packed layouts.

A plan is built once per batch (from a mask, from lengths, or from offsets) and then moves every
per-token field with the same gather or scatter, so no caller re-derives boundaries its own way.

Shapes: B rows, padded width S, ``total`` real tokens. ``offsets`` is cu_seqlens (B+1,).
Host syncs are named in each docstring; everything else stays on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from nopad.errors import input_error
from nopad.ops import index_put_first_axis

try:  # holds torch's constructor of jagged tensors, the one its own unpickler and view op call
    from torch.nested._internal import nested_tensor as _njt
except ImportError:  # pragma: no cover - a torch that moved it: wrap_jagged takes the public path
    _njt = None  # type: ignore[assignment]


def to_host(*scalars: Tensor) -> list[int]:
    """Fetch several 0-d device tensors in ONE device->host copy (one host sync)."""
    if not scalars:
        return []
    as_int64 = [s if s.dim() == 0 and s.dtype == torch.int64 else s.reshape(()).to(torch.int64) for s in scalars]
    return torch.stack(as_int64).tolist()  # one device->host copy: tolist moves the stack in one go


def is_nested(x: object) -> bool:
    """True for a torch.nested tensor (jagged or strided)."""
    return bool(getattr(x, "is_nested", False))


def nested_offsets(nested: Tensor) -> Tensor:
    """(B+1,) offsets of a jagged nested tensor (typed accessor; torch's stubs lack it)."""
    return nested.offsets()  # type: ignore[attr-defined]


def ragged_dim(nested: Tensor) -> int:
    """Which dim of a jagged nested tensor is ragged: 1 for (B, j, *), 2 for (B, C, j)."""
    return int(nested._ragged_idx)  # type: ignore[attr-defined]


def check_nested(x: object, field: str, *, ragged_dim: int | None = 1, value_dims: int | None = None) -> Tensor:
    """THE nested-input check: ``x`` is a jagged nested tensor ragged at ``ragged_dim`` (None: any)
    whose values have ``value_dims`` dims (None: any); else ValueError naming ``field``. No sync."""
    if not is_nested(x):
        got = f"a dense tensor of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        if x is None:
            got = "nothing"
        raise input_error(field, None, "a jagged nested tensor (B, j, ...)", got)
    nested: Tensor = x  # type: ignore[assignment]
    if nested.layout != torch.jagged:
        raise input_error(field, None, "layout=torch.jagged", f"{nested.layout}")
    ragged = int(nested._ragged_idx)  # type: ignore[attr-defined]
    if ragged_dim is not None and ragged != ragged_dim:
        raise input_error(field, None, f"the ragged dim at {ragged_dim}", f"it at {ragged}")
    if value_dims is not None and nested.values().dim() != value_dims:
        raise input_error(field, None, f"values with {value_dims} dims", f"shape {tuple(nested.values().shape)}")
    return nested


def prepare_offsets(lengths: Tensor) -> Tensor:
    """(B,) lengths -> (B+1,) int64 offsets (cu_seqlens) starting at 0. No sync."""
    return torch.nn.functional.pad(lengths.to(torch.int64).cumsum(0), (1, 0))


def round_up(n: Any, multiple: Any) -> Any:
    """Smallest multiple of ``multiple`` that is >= ``n``: an int, or elementwise on a numpy array or a
    tensor. THE round-up of nopad (alignment, SP padding, bin counts). No sync."""
    return -(-n // multiple) * multiple


def spread_over_tokens(per_row: Tensor, offsets: Tensor, total: int, *, plus_position: bool = False) -> Tensor:
    """(B,) per-row values -> (total,): token t of row b gets ``per_row[b]`` (``+ t`` with ``plus_position``).

    ``repeat_interleave`` without its gather: each row's change of value is added at the row's
    first token and one cumsum carries it on. An empty row's change lands where the next row's
    does, so the two add up and empty rows need no care. No sync (``total`` is given).
    """
    step = int(plus_position)
    change = torch.diff(per_row, prepend=per_row.new_full((1,), step))
    tokens = per_row.new_full((total + 1,), step)  # the extra slot takes trailing empty rows
    return tokens.index_add_(0, offsets[:-1].to(per_row.device), change).cumsum_(0)[:total]


def prepare_row_ids(lengths: Tensor, total: int) -> Tensor:
    """(total,) index of the row each packed token belongs to. No sync (``total`` is given)."""
    rows = torch.arange(lengths.shape[0], device=lengths.device)
    return spread_over_tokens(rows, prepare_offsets(lengths), total)


def prepare_position_ids(offsets: Tensor, total: int) -> Tensor:
    """(total,) position of each packed token inside its own sequence, restarting at 0. No sync."""
    return spread_over_tokens(-offsets[:-1], offsets, total, plus_position=True)


def wrap_jagged(
    values: Tensor,
    offsets: Tensor,
    ragged_dim: int = 1,
    *,
    min_seqlen: int | None = None,
    max_seqlen: int | None = None,
) -> Tensor:
    """(total, *) values (or (C, total) with ragged_dim=2) + (B+1,) offsets -> jagged nested tensor.

    Equal to ``torch.nested.nested_tensor_from_jagged``. That one routes through the nested
    tensor's Python dispatch (about 30 us) to record that the result is a view of ``values``,
    which only autograd needs; values that do not require grad skip it and go to the constructor.
    """
    if _njt is None or values.requires_grad or ragged_dim < 1 or torch.compiler.is_compiling():
        return torch.nested.nested_tensor_from_jagged(
            values, offsets, jagged_dim=ragged_dim, min_seqlen=min_seqlen, max_seqlen=max_seqlen
        )
    cache = {}
    if min_seqlen is not None:
        cache["min_seqlen"] = _njt._store_val_in_tensor(min_seqlen)
    if max_seqlen is not None:
        cache["max_seqlen"] = _njt._store_val_in_tensor(max_seqlen)
    return _njt.NestedTensor(values, offsets, _ragged_idx=ragged_dim, _metadata_cache=cache)


def gather_rows(values: Tensor, src_start: Tensor, lo: Tensor | None, hi: Tensor, width: int) -> Tensor:
    """out[b, k] = values[src_start[b] + k] where lo[b] <= k < hi[b], else 0: (N, *) -> (B, width, *).

    ``lo=None`` means 0. A dense gather over B * width slots: no sync, no Python loop, autograd
    flows to ``values``.
    """
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

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_mask(cls, mask: Tensor) -> IndexPlan:
        """Any (B, S) 0/1 mask, holes allowed. One sync (``nonzero``)."""
        if mask.dim() != 2:
            raise input_error("mask", None, "a (batch, seqlen) tensor", f"shape {tuple(mask.shape)}")
        indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
        lengths = mask.bool().sum(-1)
        return cls(lengths, prepare_offsets(lengths), total=indices.shape[0], width=mask.shape[1], indices=indices)

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

        One sync fetching total, max and min length together, unless ``total`` is given.
        ``width`` defaults to the max length.
        """
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
        if lengths.dim() != 1 or lengths.shape[0] == 0:
            raise input_error("lengths", None, "a non-empty 1-D tensor", f"shape {tuple(lengths.shape)}")
        if total is None:
            total, max_seqlen, min_seqlen = to_host(lengths.sum(), lengths.max(), lengths.min())
            if min_seqlen < 0:
                raise input_error("lengths", None, "lengths >= 0", f"min length {min_seqlen}")
        if width is None:
            width = max_seqlen if max_seqlen is not None else to_host(lengths.max())[0]
        if starts is None:
            starts = torch.zeros_like(lengths)
        return cls(
            lengths,
            prepare_offsets(lengths),
            total=total,
            width=width,
            starts=starts,
            max_seqlen=max_seqlen,
            min_seqlen=min_seqlen,
        )

    @classmethod
    def from_offsets(cls, offsets: Tensor, *, width: int | None = None) -> IndexPlan:
        """(B+1,) cu_seqlens -> plan of right-padded rows. One sync (total, max, min)."""
        offsets = torch.as_tensor(offsets, dtype=torch.int64)
        if offsets.dim() != 1 or offsets.shape[0] < 2:
            raise input_error(
                "offsets", None, "a 1-D tensor of batch+1 >= 2 boundaries", f"shape {tuple(offsets.shape)}"
            )
        first, total, max_len, min_len = to_host(offsets[0], offsets[-1], offsets.diff().max(), offsets.diff().min())
        if first != 0 or min_len < 0:
            raise input_error("offsets", None, "boundaries starting at 0 that never go down", f"{offsets.tolist()}")
        return cls.from_lengths(offsets.diff(), width=width, total=total, max_seqlen=max_len, min_seqlen=min_len)

    @classmethod
    def from_nested(cls, nested: Tensor, *, width: int | None = None) -> IndexPlan:
        """Plan of a jagged nested tensor's rows (right padding). No sync if width is given."""
        if not is_nested(nested):
            raise input_error(
                "tensor", None, "a jagged nested tensor", f"a dense tensor of shape {tuple(nested.shape)}"
            )
        offsets = nested_offsets(nested).to(torch.int64)
        total = nested.values().shape[ragged_dim(nested) - 1]
        lengths = offsets.diff()
        return cls(
            lengths,
            offsets,
            total=total,
            width=width,
            starts=torch.zeros_like(lengths),
            max_seqlen=_cached_seqlen(nested, "_maybe_max_seqlen"),
            min_seqlen=_cached_seqlen(nested, "_maybe_min_seqlen"),
        )

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
        return prepare_position_ids(self.offsets, self.total)

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
        shift = row_start.to(self.offsets.device) - self.offsets[:-1]
        return spread_over_tokens(shift, self.offsets, self.total, plus_position=True)

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
        if values.shape[0] != self.total:
            raise input_error("values", None, f"{self.total} tokens on dim 0", f"shape {tuple(values.shape)}")
        width = self._width(width)
        if self.starts is None:
            if width != self.width:
                raise input_error("width", None, f"the mask's width {self.width}", f"{width}")
            flat = index_put_first_axis(values, self.indices, self.batch_size * width)
            return flat.view(self.batch_size, width, *values.shape[1:])
        return gather_rows(values, self.offsets[:-1] - self.starts, self.starts, self.starts + self.lengths, width)

    def to_nested(self, values: Tensor, ragged_dim: int = 1) -> Tensor:
        """Wrap (total, *) values (or (C, total) for ragged_dim=2) in a jagged nested tensor."""
        return wrap_jagged(values, self.offsets, ragged_dim, min_seqlen=self._min_seqlen, max_seqlen=self._max_seqlen)

    def nest(self, x: Tensor, seq_dim: int = 1) -> Tensor:
        """Padded (B, S, *) -> nested (B, j, *); (B, C, S) with seq_dim=2 -> nested (B, C, j).

        The ragged dim is set explicitly, so all-equal lengths or B=1 never confuse torch.
        """
        values = self.pack(x, seq_dim)
        values = values if seq_dim == 1 else values.movedim(0, seq_dim - 1)
        return self.to_nested(values, ragged_dim=seq_dim)

    def unnest(self, nested: Tensor, width: int | None = None) -> Tensor:
        """Nested (B, j, *) or (B, C, j) -> padded (B, width, *) or (B, C, width)."""
        ragged = ragged_dim(nested)
        values = nested.values().movedim(ragged - 1, 0)
        return self.unpack(values, width).movedim(1, ragged)

    def split(self, values: Tensor) -> list[Tensor]:
        """(total, *) -> one tensor per row. One sync; for inspection, not for a hot path."""
        return list(values.split(self.lengths.tolist()))

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

    # ---- internals ----------------------------------------------------------------------
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


def _cached_seqlen(nested: Tensor, attr: str) -> int | None:
    value = getattr(nested, attr, None)
    return None if value is None else int(value)
