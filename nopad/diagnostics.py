"""Count the aten ops and host syncs a piece of code runs: the "no loops" contract, measured.

A host sync is anything that makes the host wait for the device: reading a value
(``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool(t)``, ``int(t)``, ``float(t)``,
``t.to("cpu")``, using a tensor as an index) or an op whose output size depends on the data
(``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without
``output_size``, ``equal``). Reads are counted at the Python level, so they count on ANY device:
on a CPU tensor ``x.tolist()`` never reaches a device copy, yet on a GPU it would be a sync.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

# Ops whose result size or value must reach the host before the next op can be issued.
_ALWAYS_SYNC = {
    _aten.nonzero.default,
    _aten._local_scalar_dense.default,
    _aten.is_nonzero.default,
    _aten.masked_select.default,
    _aten.equal.default,
    _aten.unique_consecutive.default,
    _aten._unique2.default,
}

# Metadata queries: they read a tensor's shape or layout and launch nothing. Some torch releases
# dispatch them to a mode (2.9 does ``dim`` on a nested tensor's way), newer ones answer them in C++:
# counted, they would make an op count depend on the release rather than on the work.
_METADATA = {
    _aten.dim.default,
    _aten.sym_size.default,
    _aten.sym_size.int,
    _aten.sym_stride.default,
    _aten.sym_stride.int,
    _aten.sym_numel.default,
    _aten.sym_storage_offset.default,
    _aten.is_contiguous.default,
    _aten.is_contiguous.memory_format,
    torch.ops.prim.layout.default,
    torch.ops.prim.device.default,
}

# Tensor methods that hand a value to the host.
_HOST_READS = frozenset(
    {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__", "__complex__"}
)


def _is_sync(func, args, kwargs) -> bool:
    if func in _ALWAYS_SYNC:
        return True
    if func is _aten._to_copy.default:  # device -> host copy (an explicit "cpu" is counted as a read above)
        return str(kwargs.get("device", "")) == "cpu" and args[0].device.type != "cpu"
    if func is _aten.index.Tensor:  # boolean-mask indexing runs nonzero underneath
        return any(i is not None and i.dtype == torch.bool for i in args[1])
    if func is _aten.repeat_interleave.Tensor:  # without output_size it must learn the sum
        return kwargs.get("output_size") is None and (len(args) < 2 or args[-1] is None)
    return False


def _to_host(args: tuple, kwargs: dict) -> bool:
    """``Tensor.to(...)`` that moves to the host: the target written as ``"cpu"``, or a CPU device
    given to a tensor that is not on the CPU. (``x.to(other.device)`` on the CPU is no transfer.)"""
    source = args[0]
    for target in (*args[1:], kwargs.get("device")):
        if isinstance(target, str) and torch.device(target).type == "cpu":
            return True
        if isinstance(target, torch.device) and target.type == "cpu":
            return isinstance(source, torch.Tensor) and source.device.type != "cpu"
    return False


class _HostReads(TorchFunctionMode):
    """Counts host reads at the Python level and tells the dispatch counter not to count them again."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        is_read = name in _HOST_READS or (name == "to" and _to_host(args, kwargs))
        if not is_read or self.counter._reading:
            return func(*args, **kwargs)
        self.counter.syncs += 1
        self.counter.host_reads[name] += 1
        self.counter._reading = True
        try:
            return func(*args, **kwargs)
        finally:
            self.counter._reading = False


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...`` then ``c.ops`` (total _aten ops), ``c.syncs``, ``c.by_op``.

    ``c.host_reads`` counts the reads by method name (``item``, ``tolist``, ``__bool__``, ...).
    Metadata queries (``dim``, ``sym_size``, ...) launch nothing and are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self.syncs = 0
        self._reading = False
        self._function_mode = _HostReads(self)

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    def __enter__(self) -> OpCounter:
        self._function_mode.__enter__()
        try:
            super().__enter__()
        except BaseException:
            self._function_mode.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._function_mode.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            return func(*args, **kwargs)
        self.by_op[str(func)] += 1
        if not self._reading:  # a read already counted once at the Python level
            self.syncs += _is_sync(func, args, kwargs)
        return func(*args, **kwargs)


__all__ = ["OpCounter"]
