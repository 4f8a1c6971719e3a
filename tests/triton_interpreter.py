"""What Triton's interpreter (``TRITON_INTERPRET=1``, triton 3.9) needs to run the real kernel
packages on CPU tensors: test-side shims only, the runtime ones undone when their test ends. The
library keeps its rule that these kernels run only on CUDA; nothing here touches nopad.

- Autotuners take their first config (after the package's own pruning): the interpreter has no
  benchmarker (``driver.active`` has no driver off a GPU).
- A float argument of a kernel is an fp32 scalar, as a compiled kernel takes it (the interpreter
  hands the Python float itself, and Liger's kernel calls ``softcap.to(tl.float32)``).
- A kernel's loops over Python ``range(...)`` yield interpreter integers, as a compiled kernel's
  loop variables are (fla calls ``.to()`` on one). Swapped in the kernel's module only while that
  kernel runs: its host code, in the same module, keeps the builtin.
- ``triton.language.extra.libdevice`` functions are stubs returning None in the interpreter
  (triton-lang/triton#8825); the few these kernels call (tanh, log1p) get numpy forms while a
  kernel runs.
- The interpreter keeps bfloat16 blocks as their raw uint16 bits, and its arithmetic on them
  (``tl.dot``, ``*``, ``+``, comparisons, math functions, fma) computes on those bits: results 1e10
  off. bf16 operands are widened to float32 first and a float32 result rounded back to bf16, as
  the GPU computes them (``tl.dot`` of bf16 blocks accumulates in float32, where their products
  are exact).
- ``a & b`` of an int1 block and an int1 scalar comes back with int32 storage, which the
  interpreter's masked load and store refuse ("mask has unsupported dtype"): masks are made boolean.
- ``torch.cuda.device`` a null context, ``torch.cuda.get_device_properties`` answering a
  ``multi_processor_count`` (mamba-ssm's host code), ``torch.cuda.nvtx.range`` a null context
  (verl's host code), and ``Tensor.is_cuda`` True only while verl's host functions run (they
  assert it before every launch: :func:`host_functions_read_cuda`).

And two import shims: mamba-ssm's package ``__init__`` imports its CUDA extension
``selective_scan_cuda`` (absent from a ``MAMBA_SKIP_CUDA_BUILD`` install): a stub module stands in
while it imports. verl's Triton head lives in ``verl.utils.kernel`` of verl's wheel, installed
without its dependencies: its kernel modules are loaded under stub ``verl`` / ``verl.utils``
packages (their ``__init__`` pulls ray, omegaconf, ...) and a stub ``verl.utils.device``; they stay
in ``sys.modules`` for the process (this module's tests only run in CI's kernels leg, without verl).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

REQUIRE = os.environ.get("NOPAD_REQUIRE_KERNELS") == "1"
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def unavailable(why: str) -> None:
    """Skip the calling test module, or fail it under ``NOPAD_REQUIRE_KERNELS=1`` (CI's kernels leg)."""
    if REQUIRE:
        pytest.fail(f"NOPAD_REQUIRE_KERNELS=1 but {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every runtime shim above, through ``monkeypatch`` (undone with it)."""
    import numpy as np
    import triton.language as tl
    import triton.language.extra.libdevice as libdevice
    import triton.runtime.autotuner as autotuner
    from triton.runtime import interpreter

    prune = autotuner.Autotuner.prune_configs
    monkeypatch.setattr(autotuner.Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1])

    def tensor_range(*args: Any) -> Iterator[Any]:
        for i in builtins.range(*args):
            yield interpreter._implicit_cvt(i)

    def unary(fn: Callable) -> Callable:
        return lambda x: tl.tensor(interpreter.interpreter_builder.unary_op(x.handle, fn), x.type)

    numpy_forms = {"tanh": np.tanh, "log1p": np.log1p}
    stubs = {name: getattr(libdevice, name) for name in numpy_forms}
    launch = interpreter.GridExecutor.__call__
    missing = object()

    def launch_with_shims(self: Any, *args: Any, **kwargs: Any) -> Any:
        scope = self.fn.__globals__
        swaps = [(scope, "range", tensor_range)]
        swaps += [(scope, n, unary(numpy_forms[n])) for n, v in list(scope.items()) if n in stubs and v is stubs[n]]
        swaps += [(vars(libdevice), n, unary(fn)) for n, fn in numpy_forms.items()]
        saved = [(where, name, where.get(name, missing)) for where, name, _ in swaps]
        for where, name, value in swaps:
            where[name] = value
        try:
            return launch(self, *args, **kwargs)
        finally:
            for where, name, value in reversed(saved):
                if value is missing:
                    del where[name]
                else:
                    where[name] = value

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch_with_shims)

    convert = interpreter._implicit_cvt

    def float_args_as_fp32(arg: Any) -> Any:
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    monkeypatch.setattr(interpreter, "_implicit_cvt", float_args_as_fp32)

    builder = interpreter.InterpreterBuilder

    def boolean(mask: Any) -> Any:
        return mask if mask.data.dtype == np.bool_ else interpreter.TensorHandle(mask.data.astype(bool), mask.dtype)

    store, load, dot = builder.create_masked_store, builder.create_masked_load, builder.create_dot
    monkeypatch.setattr(
        builder, "create_masked_store", lambda b, ptrs, v, mask, *a: store(b, ptrs, v, boolean(mask), *a)
    )
    monkeypatch.setattr(builder, "create_masked_load", lambda b, ptrs, mask, *a: load(b, ptrs, boolean(mask), *a))

    def bf16(h: Any) -> bool:
        return h.dtype.scalar == tl.bfloat16

    def widened(b: Any, h: Any) -> Any:
        return b.cast_impl(h, tl.float32) if bf16(h) else h

    def rounded(b: Any, out: Any, like: Any) -> Any:
        """A float32 result back to bf16 storage (round to nearest even); any other (a comparison's
        booleans) labelled as the interpreter labels it, with its first operand's type."""
        if out.data.dtype == np.float32:
            return b.cast_impl(out, tl.bfloat16)
        return interpreter.TensorHandle(out.data, like.dtype.scalar)

    monkeypatch.setattr(builder, "create_dot", lambda b, x, y, acc, *a: dot(b, widened(b, x), widened(b, y), acc, *a))
    binary, unary_op, ternary, fma = builder.binary_op, builder.unary_op, builder.ternary_op, builder.create_fma

    def binary_bf16(b: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        if not (bf16(lhs) or bf16(rhs)):
            return binary(b, lhs, rhs, op)
        return rounded(b, binary(b, widened(b, lhs), widened(b, rhs), op), lhs)

    def unary_bf16(b: Any, arg: Any, op: Any) -> Any:
        return rounded(b, unary_op(b, widened(b, arg), op), arg) if bf16(arg) else unary_op(b, arg, op)

    def ternary_bf16(b: Any, x: Any, y: Any, z: Any, op: Any) -> Any:
        if op is np.where or not (bf16(y) or bf16(z)):  # a selection moves the bits as they are
            return ternary(b, x, y, z, op)
        return rounded(b, ternary(b, widened(b, x), widened(b, y), widened(b, z), op), z)

    def fma_bf16(b: Any, x: Any, y: Any, z: Any) -> Any:
        return rounded(b, fma(b, widened(b, x), widened(b, y), widened(b, z)), z) if bf16(z) else fma(b, x, y, z)

    monkeypatch.setattr(builder, "binary_op", binary_bf16)
    monkeypatch.setattr(builder, "unary_op", unary_bf16)
    monkeypatch.setattr(builder, "ternary_op", ternary_bf16)
    monkeypatch.setattr(builder, "create_fma", fma_bf16)

    monkeypatch.setattr(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())
    properties = types.SimpleNamespace(multi_processor_count=4, name="Triton interpreter")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: properties)
    monkeypatch.setattr(torch.cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext())


def import_mamba_ssm() -> Any:
    """``mamba_ssm.ops.triton.ssd_combined``, its package's CUDA extension stubbed while it imports."""
    stubbed = "selective_scan_cuda" not in sys.modules
    if stubbed:
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    try:
        return importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    finally:
        if stubbed:
            sys.modules.pop("selective_scan_cuda", None)


def import_verl_kernel() -> Any:
    """``verl.utils.kernel.linear_cross_entropy`` from verl's installed wheel, without verl's
    package ``__init__`` files (stub packages with the real paths) and with a CPU ``verl.utils.device``.
    Only when verl itself is not importable: where it is (CI's verl leg), its own modules load."""
    with contextlib.suppress(Exception):
        return importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed")
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        del sys.modules[name]  # what the failed import left half-made
    root = list(spec.submodule_search_locations)[0]
    verl = types.ModuleType("verl")
    verl.__path__ = [root]
    utils = types.ModuleType("verl.utils")
    utils.__path__ = [os.path.join(root, "utils")]
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = False  # type: ignore[attr-defined]
    device.get_device_capability = lambda *a: (0, 0)  # type: ignore[attr-defined]
    device.get_device_name = lambda: "cpu"  # type: ignore[attr-defined]
    device.get_torch_device = lambda: torch.cuda  # type: ignore[attr-defined]
    verl.utils = utils  # type: ignore[attr-defined]
    utils.device = device  # type: ignore[attr-defined]
    sys.modules.update({"verl": verl, "verl.utils": utils, "verl.utils.device": device})
    return importlib.import_module("verl.utils.kernel.linear_cross_entropy")


@contextlib.contextmanager
def tensors_read_as_cuda() -> Iterator[None]:
    """``Tensor.is_cuda`` answers True: verl's host functions assert it before every launch."""
    own = torch.Tensor.__dict__.get("is_cuda")  # None: inherited from torch._C.TensorBase
    torch.Tensor.is_cuda = property(lambda self: True)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        if own is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = own  # type: ignore[method-assign]


def host_functions_read_cuda(monkeypatch: pytest.MonkeyPatch, module: Any, *names: str) -> None:
    """Wrap ``module``'s host functions ``names`` so that only while one runs, tensors read as CUDA."""
    for name in names:
        real = getattr(module, name)

        def wrapped(*args: Any, _real: Callable = real, **kwargs: Any) -> Any:
            with tensors_read_as_cuda():
                return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)
