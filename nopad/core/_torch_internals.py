"""Every private torch and tensordict API nopad uses, in one place, each beside its public fallback.

Why any: on a CPU, torch's public jagged-tensor API costs tens of microseconds per call in Python
dispatch (``values()`` about 100 us, ``nested_tensor_from_jagged`` about 30 us, tensordict's checked
``set`` about 40 us a nested field), more than the gathers a conversion makes. The fast paths
below skip that dispatch and nothing else. ``USE_INTERNALS = False`` takes the public API
everywhere (tests check both against the public constructors); a torch or tensordict that moves
an internal falls back by itself.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

try:  # torch's constructor of jagged tensors, the one its own unpickler and view op call
    from torch.nested._internal import nested_tensor as _njt
except ImportError:  # pragma: no cover - a torch that moved it: everything takes the public path
    _njt = None  # type: ignore[assignment]

USE_INTERNALS = _njt is not None  # tests set it False to take the public path everywhere


def is_nested(x: object) -> bool:
    """True for a torch.nested tensor (jagged or strided). A jagged tensor is recognised by its
    class: reading ``is_nested`` costs a trip through its ``__torch_function__`` (about 20 us)."""
    if USE_INTERNALS and isinstance(x, _njt.NestedTensor):
        return True
    return bool(getattr(x, "is_nested", False))


def is_jagged(x: object) -> bool:
    """True for a nested tensor of layout ``torch.jagged`` (``.layout`` costs a Python dispatch)."""
    if USE_INTERNALS and isinstance(x, _njt.NestedTensor):
        return True
    return is_nested(x) and x.layout == torch.jagged  # type: ignore[attr-defined]


def jagged_values(nested: Tensor) -> Tensor:
    """``nested.values()``: the values tensor itself, with the same autograd history (a jagged tensor
    built from values is a view of them). Only a jagged leaf that requires grad while its values do
    not needs the dispatched view, and gets it."""
    values = getattr(nested, "_values", None) if USE_INTERNALS else None
    if values is None:
        return nested.values()  # type: ignore[attr-defined]
    with torch._C.DisableTorchFunctionSubclass():
        needs_view = nested.requires_grad and not values.requires_grad
    return nested.values() if needs_view else values  # type: ignore[attr-defined]


def ragged_dim(nested: Tensor) -> int:
    """Which dim of a jagged nested tensor is ragged: 1 for (B, j, *), 2 for (B, C, j). The public
    reading: the one dim whose size is not an int (a nested int)."""
    if USE_INTERNALS and hasattr(nested, "_ragged_idx"):
        return int(nested._ragged_idx)
    return next(i for i, size in enumerate(nested.shape) if not isinstance(size, int))


def cached_seqlens(nested: Tensor) -> tuple[int | None, int | None]:
    """The (min, max) row lengths a jagged tensor records, if it records them (no sync); else None."""
    if not USE_INTERNALS:
        return None, None
    low, high = getattr(nested, "_maybe_min_seqlen", None), getattr(nested, "_maybe_max_seqlen", None)
    return (None if low is None else int(low)), (None if high is None else int(high))


def wrap_jagged(
    values: Tensor,
    offsets: Tensor,
    ragged_dim: int = 1,
    *,
    min_seqlen: int | None = None,
    max_seqlen: int | None = None,
    records: dict[str, Tensor] | None = None,
    ragged_size: Any = None,
) -> Tensor:
    """(total, *) values (or (C, total) with ragged_dim=2) + (B+1,) offsets -> jagged nested tensor.

    Equal to ``torch.nested.nested_tensor_from_jagged``, which routes through the nested tensor's
    Python dispatch (about 30 us) to record that the result is a view of ``values``: only autograd
    needs that, so values that do not require grad go to the constructor. ``records``: the
    :func:`seqlen_records` of these min / max lengths, shared between fields; ``ragged_size``: the
    :func:`ragged_size_of` these offsets, shared likewise.
    """
    if not USE_INTERNALS or values.requires_grad or ragged_dim < 1 or torch.compiler.is_compiling():
        return torch.nested.nested_tensor_from_jagged(
            values, offsets, jagged_dim=ragged_dim, min_seqlen=min_seqlen, max_seqlen=max_seqlen
        )
    if records is None:
        records = {}
        if min_seqlen is not None:
            records["min_seqlen"] = _njt._store_val_in_tensor(min_seqlen)
        if max_seqlen is not None:
            records["max_seqlen"] = _njt._store_val_in_tensor(max_seqlen)
        return _njt.NestedTensor(values, offsets, _ragged_idx=ragged_dim, _metadata_cache=records)
    # shared records were marked dynamic when made: handing them over afterwards skips marking them
    # again in the constructor (about 15 us each on a CPU, per field)
    if _constructor_agrees():
        return _new_jagged(values, offsets, ragged_dim, dict(records), ragged_size)
    nested = _njt.NestedTensor(values, offsets, _ragged_idx=ragged_dim)
    nested._metadata_cache.update(records)
    return nested


if _njt is not None:
    _JAGGED_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.NestedTensor).add(
        torch._C.DispatchKey.AutogradNestedTensor
    )


def ragged_size_of(offsets: Tensor) -> Any:
    """The nested int torch gives rows laid out by ``offsets`` (a jagged tensor's ragged size), or
    None on the public path. Looking it up costs about 5 us on a CPU: once per offsets, not per field."""
    return _njt.get_tensor_symint(offsets, coeff=1) if USE_INTERNALS else None


def _new_jagged(
    values: Tensor, offsets: Tensor, ragged_idx: int, metadata: dict[str, Tensor], ragged_size: Any = None
) -> Tensor:
    """``NestedTensor(values, offsets, _ragged_idx=ragged_idx)`` with ``metadata`` as its records, for
    values that do not require grad: torch's ``__new__`` and ``__init__`` less their argument checks
    (the caller's values and offsets are its own), and less the nested-int product ``j * 1`` for a
    unit stride, which is ``j`` again (about 5 us of the 20 a construction costs on a CPU; a
    micro-batch split makes one per field and part)."""
    if ragged_size is None:
        ragged_size = _njt.get_tensor_symint(offsets, coeff=1)
    r = ragged_idx - 1
    stride = values.stride()
    size = (offsets.shape[0] - 1, *values.shape[:r], ragged_size, *values.shape[r + 1 :])
    strides = (ragged_size if stride[r] == 1 else ragged_size * stride[r], *stride)
    nested = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
        _njt.NestedTensor,
        size,
        strides,
        0,
        torch.contiguous_format,
        values.dtype,
        torch.jagged,
        values.device,
        False,
        False,
        "sizes",
        False,
        True,
        _JAGGED_KEYS,
        storage_size=values.untyped_storage().size(),
    )
    nested._ragged_idx = ragged_idx
    nested._size = size
    nested._strides = strides
    nested._values = values
    nested._offsets = offsets
    nested._lengths = None
    nested._metadata_cache = metadata
    nested._dynamo_propagated_dynamic_indices = {ragged_idx}
    values._dynamo_propagated_dynamic_indices = {ragged_idx - 1}  # type: ignore[attr-defined]
    return nested


@functools.cache
def _constructor_agrees() -> bool:
    """Whether :func:`_new_jagged` makes what torch's constructor makes in this torch: the same class,
    sizes, strides, attributes and records on a (B, j) and a (B, C, j) tensor. Asked once; a torch
    whose constructor does more takes torch's constructor."""
    try:
        for values, ragged_idx in ((torch.arange(6), 1), (torch.arange(12).reshape(2, 6), 2), (torch.ones(6, 3), 1)):
            offsets = torch.tensor([0, 2, 6])
            records = seqlen_records(2, 4) or {}
            ours = _new_jagged(values, offsets, ragged_idx, dict(records))
            theirs = _njt.NestedTensor(values, offsets, _ragged_idx=ragged_idx)
            theirs._metadata_cache.update(records)
            if (
                type(ours) is not type(theirs)
                or ours.shape != theirs.shape
                or ours.stride() != theirs.stride()
                or set(vars(ours)) != set(vars(theirs))
                or any(
                    vars(ours)[k] is not vars(theirs)[k] and vars(ours)[k] != vars(theirs)[k]
                    for k in ("_ragged_idx", "_size", "_strides", "_lengths", "_metadata_cache")
                )
                or not torch.equal((ours + 1).values(), (theirs + 1).values())
            ):
                return False
        return True
    except Exception:  # pragma: no cover - a torch whose internals moved
        return False


def seqlen_records(min_seqlen: int, max_seqlen: int) -> dict[str, Tensor] | None:
    """The min / max length records a jagged tensor keeps, shared by every nested field with the same
    offsets (None on the public path, where the constructor makes its own). No tensor op once a
    length has been seen."""
    if not USE_INTERNALS:
        return None
    return {"min_seqlen": _seqlen_record(min_seqlen), "max_seqlen": _seqlen_record(max_seqlen)}


_SEQLEN_RECORDS: dict[int, Tensor] = {}
_TRACING_MODES = tuple(
    getattr(torch._C._TorchDispatchModeKey, name)
    for name in ("FAKE", "PROXY", "FUNCTIONAL")
    if hasattr(torch._C._TorchDispatchModeKey, name)
)


def _tracing() -> bool:
    """Whether a tracing mode (fake tensors, make_fx, functionalisation) or torch.compile is active:
    tensors made there belong to it, and real tensors kept from outside must not enter it."""
    if torch.compiler.is_compiling():
        return True
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES)


def _seqlen_record(n: int) -> Tensor:
    """torch's record of a length ``n``: an (n, 0) tensor that torch.compile treats as dynamic.

    It holds no storage and nothing ever writes to it, so one per value serves every batch: making
    and marking it costs more (about 10 us a pair on a CPU) than the gather it describes. Always a
    CPU tensor, as torch makes it. Under a tracing mode each call makes its own, as torch does.
    """
    tracing = _tracing()
    record = None if tracing else _SEQLEN_RECORDS.get(n)
    if record is None:
        record = torch.zeros(n, 0, device="cpu")
        torch._dynamo.mark_dynamic(record, 0)
        if not tracing:
            if len(_SEQLEN_RECORDS) >= 8192:  # bounded: a run that sees every length keeps the last ones
                _SEQLEN_RECORDS.clear()
            _SEQLEN_RECORDS[n] = record
    return record


def put_checked(out: Any, key: str, value: Any) -> None:
    """``out[key] = value`` for a value whose batch size and device the caller has checked already.

    tensordict would check them again, which on a nested value costs more than the gather that
    made it (about 40 us a field on a CPU). A TensorDict of any other batch rank takes the checked way.
    """
    if USE_INTERNALS and out.batch_dims == 1 and hasattr(out, "_set_str"):
        out._set_str(key, value, inplace=False, validated=True)
    else:
        out.set(key, value)
