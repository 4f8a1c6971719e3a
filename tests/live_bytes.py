"""Peak live tensor memory of any code on any device, the CPU included (tracemalloc does not see torch's
allocator, and ``torch.cuda.max_memory_allocated`` needs CUDA).

:class:`LiveBytes` is a ``TorchDispatchMode``: every tensor an op returns is looked at, and the first
time its storage is seen its bytes count as live until the storage dies (a ``weakref.finalize`` on the
storage, whose Python object torch keeps for the storage's whole life). A view shares its base's
storage and counts once; an in-place op's result is its input's storage. Storages that existed
before the block (the inputs) never count, so ``peak`` is the memory a computation needs above its
inputs, gradients included. CPU autograd runs the backward on the calling thread, inside the mode.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._before: set[int] = set()

    def ignore(self, *tensors: torch.Tensor) -> LiveBytes:
        """Storages that are inputs, made before the block: never counted."""
        self._before.update(t.untyped_storage()._cdata for t in tensors)
        return self

    def _freed(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._seen or key in self._before:
                continue
            size = storage.nbytes()
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, size)
        return out
