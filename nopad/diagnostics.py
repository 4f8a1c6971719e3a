"""Count the aten ops and host syncs a piece of code dispatches: the "no loops" contract, measured."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose result size or value must reach the host before the next op can be issued.
_ALWAYS_SYNC = {
    aten.nonzero.default,
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.masked_select.default,
    aten.equal.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
}


def _is_sync(func, args, kwargs) -> bool:
    if func in _ALWAYS_SYNC:
        return True
    if func is aten._to_copy.default:  # device -> host copy
        return str(kwargs.get("device", "")) == "cpu"
    if func is aten.index.Tensor:  # boolean-mask indexing runs nonzero underneath
        return any(i is not None and i.dtype == torch.bool for i in args[1])
    if func is aten.repeat_interleave.Tensor:  # without output_size it must learn the sum
        return kwargs.get("output_size") is None and (len(args) < 2 or args[-1] is None)
    return False


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...`` then ``c.ops`` (total aten ops), ``c.syncs``, ``c.by_op``."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.syncs = 0

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.by_op[str(func)] += 1
        self.syncs += _is_sync(func, args, kwargs)
        return func(*args, **kwargs)
