"""Packed attention for HF models: one varlen kernel call per layer over a packed row, no mask built.

Registered with transformers as ``"nopad_varlen"`` (``AttentionInterface`` for the kernel call,
``AttentionMaskInterface`` so that no dense mask is ever built). Kernels, in the order ``"auto"``
tries them::

    flash_attn    flash-attn's flash_attn_varlen_func          (the optional ``flash`` extra)
    aten_flash    torch.ops.aten._flash_attention_forward        (every CUDA torch, no extra install)
    varlen_attn   torch.nn.attention.varlen.varlen_attn          (CUDA torch >= 2.10)
    sdpa          sdpa over the block-diagonal causal mask       (any device and dtype; exact, slow: T x T)

``aten_flash`` comes before ``varlen_attn``: both run torch's flash kernel, and the op called
directly was faster at every shape measured on an H200 (fwd+bwd 83 against 98 ms at B=32, 31
against 37 ms at B=4), the public function adding a custom op's Python around the same kernel.

The first three take fp16/bf16 on CUDA only; fp32 and the CPU get ``sdpa``. A kernel is chosen once
per kind of call (device, dtype and the features the layer needs), and a feature a kernel cannot
honour (sliding window, soft-capping, dropout, attention sinks) moves ``"auto"`` to the next kernel
or, for a forced kernel, raises: nothing is silently ignored.

Shapes: queries arrive from HF as (B, H, T, D), keys and values as (B, H_kv, T, D); the kernels see
(tokens, heads, dim) views of them: no copy, and no K/V repeat for grouped-query attention where the
kernel takes fewer KV heads (all four do, except ``varlen_attn`` before torch 2.12).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.util
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false

from nopad.core._batch import parameters_of
from nopad.core._errors import check_int, free_to_read, input_error
from nopad.core._layout import (
    IndexPlan,
    block_causal_mask,
    ceil_div,
    device_to_host,
    host_offsets,
    host_to_device,
    known_host_lengths,
    remember_host_lengths,
    to_host,
)
from nopad.core._memo import memo, memo_with, recall, remember
from nopad.modeling._routing import checkpointed, packed_forward_boundaries, route, route_of, routed
from nopad.parallel._ulysses import ULYSSES_PREFIX, enable_ulysses, repeat_heads, set_attn_implementation

IMPLEMENTATION = "nopad_varlen"
KERNELS = ("flash_attn", "aten_flash", "varlen_attn", "sdpa")
_HALF = (torch.float16, torch.bfloat16)
# transformers treats any implementation whose name contains "flash" as flash-attn, so the forced
# kernels' implementation names avoid that word.
_IMPLEMENTATION_OF = {
    "auto": IMPLEMENTATION,
    "flash_attn": IMPLEMENTATION + "_fa",
    "varlen_attn": IMPLEMENTATION + "_torch",
    "aten_flash": IMPLEMENTATION + "_aten",
    "sdpa": IMPLEMENTATION + "_dense",
}
_KERNEL_OF = {name: kernel for kernel, name in _IMPLEMENTATION_OF.items()}


@dataclass(frozen=True)
class Needs:
    """What one layer's call asks of a kernel (hashable: kernel choice is cached on it).

    window: HF's ``sliding_window`` (the token and window - 1 before it), or None.
    """

    gqa: bool = False
    causal: bool = True
    window: int | None = None
    dropout: bool = False
    softcap: bool = False
    sinks: bool = False


# ---- the kernels ------------------------------------------------------------------------------------
# Each loader returns the kernel's callable (tests substitute CPU stand-ins with the same signature).


def _load_flash_attn() -> Callable:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def _load_varlen_attn() -> Callable:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def _load_aten_flash() -> Callable:
    return torch.ops.aten._flash_attention_forward


@dataclass(frozen=True)
class KernelSpec:
    """Where a kernel runs and how to get it. ``present`` is checked without importing the kernel."""

    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None  # None: any
    present: Callable[[], bool]
    load: Callable[[], Callable]


def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _has_varlen_attn() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def _has_aten_flash() -> bool:
    return hasattr(torch.ops.aten, "_flash_attention_forward") and torch.backends.cuda.is_flash_attention_available()


SPECS: dict[str, KernelSpec] = {
    "flash_attn": KernelSpec(("cuda",), _HALF, _has_flash_attn, _load_flash_attn),
    "varlen_attn": KernelSpec(("cuda",), _HALF, _has_varlen_attn, _load_varlen_attn),
    "aten_flash": KernelSpec(("cuda",), _HALF, _has_aten_flash, _load_aten_flash),
    "sdpa": KernelSpec(("cpu", "cuda", "xpu", "mps"), None, lambda: True, lambda: F.scaled_dot_product_attention),
}


def _unavailable(kernel: str, device_type: str, dtype: torch.dtype) -> str | None:
    """Why ``kernel`` cannot run on this device and dtype, or None when it can."""
    spec = SPECS[kernel]
    if device_type not in spec.devices:
        return f"needs a {' or '.join(spec.devices)} device, the model is on {device_type}"
    if spec.dtypes is not None and dtype not in spec.dtypes:
        return f"takes {' or '.join(str(d) for d in spec.dtypes)}, the model runs {dtype}"
    if not spec.present():
        return "is not installed in this environment"
    return None


@functools.lru_cache(maxsize=32)
def _params(fn: Callable) -> frozenset[str]:
    """The keyword names a kernel takes (an aten op's from its schema). Read once per kernel."""
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return frozenset(a.name for a in fn.default._schema.arguments)
    return frozenset(parameters_of(fn))


def _refusal(kernel: str, needs: Needs) -> str | None:
    """Which feature of ``needs`` this kernel cannot honour, or None. A GQA copy is not a refusal."""
    params = _params(SPECS[kernel].load()) if kernel != "sdpa" else set()
    if needs.sinks and kernel != "sdpa":
        return "attention sinks (s_aux)"
    if needs.softcap and kernel in ("varlen_attn", "aten_flash"):
        return "soft-capping (softcap)"
    if needs.dropout and kernel == "varlen_attn":
        return "attention dropout"
    if needs.window is not None and kernel == "varlen_attn" and "window_size" not in params:
        return "a sliding window (this torch's varlen_attn has no window_size)"
    if needs.window is not None and kernel == "aten_flash" and "window_size_left" not in params:
        return "a sliding window (this torch's flash op has no window_size_left)"
    if not needs.causal and kernel == "varlen_attn" and not params & {"window_size", "is_causal"}:
        return "non-causal attention"
    return None


def _copies_kv(kernel: str, needs: Needs) -> bool:
    return needs.gqa and kernel == "varlen_attn" and "enable_gqa" not in _params(SPECS[kernel].load())


def available_kernels(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """The kernels that can run on ``device`` at ``dtype``, in the order ``"auto"`` tries them. A CUDA
    device on a machine without one is a ValueError (no kernel runs there), not an answer."""
    device_type = _present_device_type(device)
    return [k for k in KERNELS if _unavailable(k, device_type, dtype) is None]


def unavailable_kernels(device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """The kernels that cannot run on ``device`` at ``dtype``, each with why (the rest: :func:`available_kernels`)."""
    device_type = _present_device_type(device)
    found = {k: _unavailable(k, device_type, dtype) for k in KERNELS}
    return {k: why for k, why in found.items() if why is not None}


def _present_device_type(device: torch.device | str) -> str:
    """``device``'s type, refused when it is CUDA on a machine that has no CUDA device."""
    try:
        device_type = torch.device(device).type
    except (TypeError, RuntimeError):  # torch's words name neither the argument nor what it takes
        raise input_error(
            "device", None, "a torch.device or a device string ('cpu', 'cuda', ...)", repr(device)
        ) from None
    if device_type == "cuda" and not torch.cuda.is_available():
        raise input_error("device", None, "a device this machine has", f"{device!r}: this machine has no CUDA device")
    return device_type


@functools.lru_cache(maxsize=256)
def select_kernel(requested: str, device_type: str, dtype: torch.dtype, needs: Needs) -> str:
    """The kernel a call runs: ``requested`` if it can (else a ValueError saying why), or for
    ``"auto"`` the first available one that honours every need, preferring one without a K/V copy."""
    if requested != "auto":
        if requested not in KERNELS:
            raise input_error("kernel", None, f"'auto' or one of {list(KERNELS)}", repr(requested))
        why = _unavailable(requested, device_type, dtype)
        if why is None:
            why = _refusal(requested, needs)
            why = None if why is None else f"cannot honour {why}"
        if why is not None:
            runnable = available_kernels(device_type, dtype)
            raise input_error(
                "kernel", None, f"a kernel that runs here (available: {runnable})", f"{requested!r}, which {why}"
            )
        return requested
    candidates = [k for k in KERNELS if _unavailable(k, device_type, dtype) is None and _refusal(k, needs) is None]
    # a flash kernel that needs no K/V copy, else one that copies (far cheaper than the dense
    # fallback's T x T mask), else the fallback, which always qualifies
    flash = [k for k in candidates if k != "sdpa"]
    return next((k for k in flash if not _copies_kv(k, needs)), flash[0] if flash else "sdpa")


@torch.compiler.assume_constant_result
def kernel_for(requested: str, device_type: str, dtype: torch.dtype, *needs: Any) -> str:
    """:func:`select_kernel`, made before tracing: dynamo runs it at trace time and keeps the name it
    returns as a constant of the graph (its arguments are the layer's config and the inputs' device
    and dtype, which the graph's guards already hold), so no probe of an installed kernel is traced.
    Eager, it is select_kernel. ``needs``: :class:`Needs`' fields in order, plain values (torch 2.9's
    dynamo cannot hand a frozen dataclass to such a function)."""
    return select_kernel(requested, device_type, dtype, Needs(*needs))


def _window(needs: Needs) -> tuple[int, int]:
    """flash-attn's inclusive (left, right) window; -1 means unbounded."""
    left = -1 if needs.window is None else needs.window - 1
    return left, (0 if needs.causal else left)


def run_kernel(
    kernel: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    scale: float,
    needs: Needs,
    dropout: float = 0.0,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> Tensor:
    """(T, H, D) queries, (T_k, H_kv, D) keys/values, (N+1,) int32 boundaries -> (T, H, D) output.

    ``cu_seqlens_k`` / ``max_seqlen_k``: the keys' own boundaries where they differ from the queries'
    (the shared-prefix attention's gathered keys; a flash kernel only). Each sequence's queries are
    then its last keys' positions: the flash kernels align the causal mask and the window at the
    bottom right when seqlen_q != seqlen_k (flash-attn >= 2.1, and torch's bundled copy of it)."""
    fn = SPECS[kernel].load()
    left, right = _window(needs)
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    assert kernel != "sdpa" or cu_k is cu_seqlens, "the dense fallback is self-attention over one set of boundaries"
    if kernel == "flash_attn":
        return fn(
            q,
            k,
            v,
            cu_seqlens,
            cu_k,
            max_seqlen,
            max_k,
            dropout_p=dropout,
            softmax_scale=scale,
            causal=needs.causal,
            window_size=(left, right),
            softcap=softcap or 0.0,
        )
    if kernel == "varlen_attn":
        params, extra = _params(fn), dict[str, Any]()
        if "window_size" in params:
            extra["window_size"] = (left, right)
        elif "is_causal" in params:  # torch 2.10
            extra["is_causal"] = needs.causal
        if needs.gqa and "enable_gqa" in params:
            extra["enable_gqa"] = True
        elif needs.gqa:  # torch 2.11: its varlen_attn wants as many K/V heads as query heads
            times = q.shape[1] // k.shape[1]
            k, v = repeat_heads(k, times), repeat_heads(v, times)
        return fn(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, scale=scale, **extra)
    if kernel == "aten_flash":
        window = {} if needs.window is None else {"window_size_left": left, "window_size_right": right}
        return fn(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, dropout, needs.causal, False, scale=scale, **window)[0]
    return _dense_attention(
        q, k, v, cu_seqlens, scale=scale, needs=needs, dropout=dropout, softcap=softcap, sinks=sinks
    )


def _dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    *,
    scale: float,
    needs: Needs,
    dropout: float,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """The exact fallback: attention over a (T, T) block-diagonal mask. Any device, any dtype."""
    total = q.shape[0]
    mask = block_causal_mask(cu_seqlens, total, causal=needs.causal, window=needs.window)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, T, D)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=needs.gqa
        )
        return out[0].transpose(0, 1)
    # soft-capping and sinks act on the scores, which sdpa does not expose: the eager formula
    times = q.shape[1] // k.shape[1]
    scores = q @ repeat_heads(k, times).transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is not None:  # one extra logit per head that takes probability mass and gives nothing back
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return (probs.to(v.dtype) @ repeat_heads(v, times))[0].transpose(0, 1)


# ---- boundaries of one forward ------------------------------------------------------------------------


def _given_boundaries(
    cu: Any, cu_k: Tensor | None, max_length: Any, total: int, device: torch.device
) -> tuple[Tensor, int]:
    """Checked ``cu_seq_lens_q`` (and ``_k``, ``max_length_q``) as int32 boundaries on ``device``.

    The boundaries must start at 0, never go down and end at the ``total`` tokens of the flattened
    row, and ``max_length_q`` must hold the longest sequence: a kernel given others attends across
    sequences, reads past the row or drops its tail. Checked where free: boundaries on the CPU are
    read (host memory), and without ``max_length_q`` the one read that finds the longest sequence
    carries the other checks too. Device boundaries with ``max_length_q`` given are not read.

    Returns:
        (sequences + 1,) int32 boundaries on ``device``, and the max length the kernel is given.
    """
    _check_boundaries_given(cu, cu_k)
    if max_length is not None and not isinstance(max_length, Tensor):
        max_length = check_int(max_length, "max_length_q", low=0)
    facts = _boundary_facts(cu, read=max_length is None)
    if facts is not None:
        first, last, lowest, longest = facts
        if first != 0 or last != total or lowest < 0:
            expected = f"boundaries rising from 0 to the row's {total} tokens"
            raise input_error("cu_seq_lens_q", None, expected, f"{_shown(cu)}")
        if max_length is not None and int(max_length) < longest:
            expected = f"the longest sequence, {longest} tokens (a shorter max length cuts it)"
            raise input_error("max_length_q", None, expected, f"{int(max_length)}")
        max_length = longest if max_length is None else max_length
    return cu.to(device=device, dtype=torch.int32), int(max_length)


def _traced_boundaries(
    cu: Tensor, cu_k: Tensor | None, max_length: Any, total: int, device: torch.device
) -> tuple[Tensor, int]:
    """:func:`_given_boundaries` inside a forward dynamo traces: the same shape and dtype checks and
    the host ``max_length_q`` checked as an int, but the boundaries' values are not read (a read is
    data-dependent: a graph break, or a recompile per row) and nothing is kept on them (the memo
    reads tensor versions, which dynamo does not trace). The caller vouches for the values, as for
    device boundaries handed with their max length in an eager forward."""
    _check_boundaries_given(cu, cu_k)
    longest = check_int(max_length, "max_length_q", low=0)
    return cu.to(device=device, dtype=torch.int32), longest


def _check_boundaries_given(cu: Any, cu_k: Tensor | None) -> None:
    """``cu_seq_lens_q`` a (sequences + 1,) integer tensor, and ``cu_seq_lens_k`` None or the same
    boundaries (nopad_varlen is self-attention). Shapes and dtypes only, unless ``_k`` is another
    tensor: then its values are compared (a read)."""
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.shape[0] < 2 or cu.dtype.is_floating_point:
        got = f"shape {tuple(cu.shape)}, dtype {cu.dtype}" if isinstance(cu, Tensor) else type(cu).__name__
        raise input_error("cu_seq_lens_q", None, "(sequences + 1,) integer boundaries", got)
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise input_error(
            "cu_seq_lens_k",
            None,
            "the same boundaries as cu_seq_lens_q (self-attention)",
            f"{cu_k.tolist()} vs {cu.tolist()}",
        )


def _boundary_facts(cu: Tensor, read: bool) -> tuple[int, int, int, int] | None:
    """(first boundary, last boundary, shortest sequence, longest sequence) of ``cu``, where they
    cost no sync: from the host lengths nopad recorded for boundaries it made (they start at 0), by
    reading boundaries in host memory, or by one read when ``read`` (the caller needs the longest
    anyway). None: device boundaries not to be read, so not checked."""
    known = known_host_lengths(cu)
    if known is not None:  # boundaries nopad made itself (from 0): their lengths are on the host already
        if not len(known):
            return 0, 0, 0, 0
        return 0, int(known.sum()), int(known.min()), int(known.max())
    if not (read or free_to_read(cu)):
        return None
    steps = cu.diff()
    first, last, lowest, longest = to_host(cu[0], cu[-1], steps.min(), steps.max())
    return first, last, lowest, longest


def _shown(cu: Tensor) -> str:
    values = cu.tolist()
    return str(values) if len(values) <= 10 else f"{str(values[:8])[:-1]}, ..., {values[-1]}]"


def _boundaries(batch: int, length: int, device: torch.device, kwargs: dict) -> tuple[Tensor, int]:
    """(N+1,) int32 cu_seqlens over the flattened B * T tokens, and the longest sequence."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu_k, max_length = kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_q")
        given: Tensor = cu
        total = batch * length
        if torch.compiler.is_compiling() and max_length is not None and not isinstance(max_length, Tensor):
            return _traced_boundaries(given, cu_k, max_length, total, device)
        # one check per forward (every layer passes these same tensors): kept on the boundaries, with
        # the other tensors it was made with (weakly: never taken for another tensor at a freed address)
        others = tuple(x if isinstance(x, Tensor) and x is not cu else None for x in (cu_k, max_length))
        key = ("boundaries", total, str(device), max_length if not isinstance(max_length, Tensor) else None)
        return memo_with(cu, key, others, lambda: _given_boundaries(given, cu_k, max_length, total, device))
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and position_ids.shape[-1] == length and position_ids.numel() == batch * length:
        plan = memo(position_ids, "position_plan", lambda: IndexPlan.from_position_ids(position_ids))
        return plan.cu_seqlens.to(device), plan.max_seqlen
    forward = packed_forward_boundaries()
    if forward is not None and batch == 1:
        # inside a routed packed forward whose decoder hands its layers neither the boundaries nor the
        # position ids (Moshi on transformers 5.20): the forward's row, checked as if it were given
        row, longest = forward
        if torch.compiler.is_compiling() and longest is not None:  # the caller's host max_length_q
            return _traced_boundaries(row, None, longest, length, device)
        return memo(
            row,
            ("boundaries", length, str(device), None, longest),
            lambda: _given_boundaries(row, None, longest, length, device),
        )
    # no boundaries given: every row is one sequence
    cu = torch.arange(0, (batch + 1) * length, length, device=device, dtype=torch.int32)
    return cu, length


# ---- the transformers attention function -----------------------------------------------------------


def forced_kernel(implementation: str | None) -> str:
    """The kernel a nopad_varlen implementation name forces (``"nopad_varlen_fa"``: flash_attn), or 'auto'."""
    return _KERNEL_OF.get((implementation or IMPLEMENTATION).removeprefix(ULYSSES_PREFIX), "auto")


def nopad_varlen_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """HF attention function: (B, H, T, D) queries, (B, H_kv, T, D) keys/values -> (B, T, H, D), None.

    Boundaries, in this order: a (B, T) padding mask (rows unpadded, one sequence each);
    ``cu_seq_lens_q`` (+ ``max_length_q``) from the model kwargs, as
    :func:`nopad.engines._fsdp.prepare_model_inputs` passes them (checked to rise from 0 to B * T,
    with the max length holding the longest: see :func:`_given_boundaries`); packed ``position_ids``
    (a sequence starts where they do not count up by one, as HF's padding-free collators make
    them; one host sync per forward); else every row is one sequence.
    """
    B, H, T, D = query.shape
    owner = type(module).__name__
    if key.shape[2] != T or key.shape[0] != B or H % key.shape[1]:
        raise input_error(
            f"{owner} key",
            None,
            f"keys for the queries' own {T} positions, (batch {B}, a divisor of {H} heads, {T}, dim): nopad_varlen "
            "serves self-attention over a packed row (no KV cache, no compressed or cross-attention keys)",
            f"shape {tuple(key.shape)} against queries {tuple(query.shape)}",
        )
    for name, given in kwargs.items():  # a bias or a selection of keys that spans the row: not ours to drop
        if isinstance(given, Tensor) and name not in _READ_KWARGS:
            raise input_error(
                f"{owner} {name}",
                None,
                "no per-score tensor beyond what nopad_varlen applies per sequence (sinks, windows, soft-capping)",
                f"a {tuple(given.shape)} tensor it would have to ignore, spanning the packed row",
            )
    if sliding_window is None:  # a layer whose window only its mask carries: the mask is not built here
        sliding_window = mask_window(module)
    if sliding_window is not None:  # a window of 0 masks every score: NaN attention, not an error
        sliding_window = check_int(sliding_window, "sliding_window", low=1)
    sinks = kwargs.get("s_aux")
    causal = kwargs.get("is_causal")
    needs = Needs(
        gqa=key.shape[1] != H,
        causal=bool(getattr(module, "is_causal", True) if causal is None else causal),
        window=sliding_window if sliding_window is not None and sliding_window < T else None,
        # a training forward's dropout (a module's float) is symbolic under torch.compile(dynamic=True):
        # guarded to a bool here, so the kernel choice below gets a constant, not a graph break per layer
        dropout=guard_or_false(dropout > 0),
        softcap=softcap is not None,
        sinks=sinks is not None,
    )
    fields = (needs.gqa, needs.causal, needs.window, needs.dropout, needs.softcap, needs.sinks)
    kernel = kernel_for(forced_kernel(current_implementation(module)), query.device.type, query.dtype, *fields)
    scale = D**-0.5 if scaling is None else scaling
    # (B, H, T, D) -> (B * T, H, D): a view of HF's (B, T, H, D) projection after its transpose
    q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (query, key, value))
    if attention_mask is not None:
        if attention_mask.shape != (B, T):
            raise input_error(
                "attention_mask",
                None,
                f"None or a ({B}, {T}) padding mask (nopad_varlen builds no dense masks)",
                f"shape {tuple(attention_mask.shape)}",
            )
        plan = memo(attention_mask, "mask_plan", lambda: IndexPlan.from_mask(attention_mask))
        q, k, v = (t.index_select(0, plan.indices) for t in (q, k, v))
        cu_seqlens, max_seqlen = plan.cu_seqlens, plan.max_seqlen
    else:
        cu_seqlens, max_seqlen = _boundaries(B, T, query.device, kwargs)  # cu_seqlens must end at B * T
        if cu_seqlens.shape[0] - 1 > B:  # a packed row: its state-carrying layers must have been routed too
            _refuse_unrouted(module)
        chunk = _attention_chunk(module)
        if chunk is not None and max_seqlen > chunk:
            cu_seqlens, max_seqlen = memo(cu_seqlens, ("chunks", chunk), lambda: _split(cu_seqlens, chunk))
    out = run_kernel(
        kernel, q, k, v, cu_seqlens, max_seqlen, scale=scale, needs=needs, dropout=dropout, softcap=softcap, sinks=sinks
    )
    if attention_mask is not None:
        out = plan.unpack(out)  # (B, T, H, D), zeros at padding
    return out.reshape(B, T, H, D), None


# config values that name layers carrying state along the sequence (transformers' layer_types and the like)
_STATE_LAYER_TYPES = re.compile(r"linear|mamba|conv|recurrent|rwkv|delta|ssm|^m$", re.IGNORECASE)


def _refuse_unrouted(module: torch.nn.Module) -> None:
    """A packed forward reached nopad_varlen outside a routed model (loaded with the implementation
    but never given to :func:`use_packed_attention`): if its config has layers that carry state
    along the sequence, they ran the row as one sequence already. Checked once per layer, the verdict
    kept on it (nopad.core._memo; under Ulysses the kernel sees a view of the module, which reads it through)."""
    if routed(module) or recall(module, "unrouted checked"):
        return
    config = getattr(module, "config", None)
    kinds = [] if config is None else _state_layer_kinds(config)
    if kinds:
        raise input_error(
            f"{getattr(config, 'model_type', type(config).__name__)} model",
            None,
            "a model given to nopad.modeling.use_packed_attention(model) before its first packed forward",
            f"one loaded with nopad_varlen alone: its {sorted(set(kinds))} layers carry state along the sequence "
            "and have just run the packed row as one sequence",
        )
    remember(getattr(module, "_target", module), "unrouted checked", True)  # the module, not a view of it


def _state_layer_kinds(config: Any) -> list[str]:
    """The layer kinds ``config`` names (transformers' ``layer_types`` and the like) that carry state
    along the sequence: what :func:`_refuse_unrouted` checks, once per layer of an unrouted model."""
    return [
        kind
        for name in ("layer_types", "layers_block_type")
        for kind in (getattr(config, name, None) or [])
        if isinstance(kind, str) and _STATE_LAYER_TYPES.search(kind)
    ]


# kwargs nopad_varlen reads or that carry no scores; any other tensor is refused, never ignored
_READ_KWARGS = frozenset(
    {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "s_aux", "cache_position"}
)


def _attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama 4's local layers: a token attends to the
    earlier tokens of its own ``attention_chunk_size``-token chunk), or None."""
    config = getattr(module, "config", None)
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if not types or index is None or index >= len(types) or types[index] != "chunked_attention":
        return None
    return getattr(config, "attention_chunk_size", None)


def mask_window(module: torch.nn.Module) -> int | None:
    """The sliding window transformers' mask gives this layer, for a call that passes no ``sliding_window``.

    A layer whose ``config.layer_types`` entry is "sliding_attention" gets the mask of
    ``create_sliding_window_causal_mask``, which reads ``config.sliding_window``. Most models hand
    that window to the attention function too; Qwen2-MoE applies it only through the mask, which
    nopad_varlen never builds (a packed row has none), so without this the window would be dropped
    inside every sequence. A model that keeps its window out of ``layer_types`` and out of the call
    (PhiMoE: one window for every layer, in the mask only) is refused by the guard instead."""
    config = getattr(module, "config", None)
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if not types or not isinstance(index, int) or not 0 <= index < len(types) or types[index] != "sliding_attention":
        return None
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def _split(cu_seqlens: Tensor, chunk: int) -> tuple[Tensor, int]:
    """Boundaries cut every ``chunk`` tokens from each sequence's start: chunked attention is varlen
    attention over those pieces. One host read of the boundaries unless nopad knows their lengths."""
    lengths = known_host_lengths(cu_seqlens)
    if lengths is None:
        lengths = np.diff(device_to_host(cu_seqlens.to(torch.int64)))
    pieces = ceil_div(lengths, chunk)
    sizes = np.full(int(pieces.sum()), chunk, dtype=np.int64)
    last = np.cumsum(pieces) - 1
    sizes[last[pieces > 0]] = lengths[pieces > 0] - chunk * (pieces[pieces > 0] - 1)
    cu = host_to_device(host_offsets(sizes), cu_seqlens.device)
    cu = cu.to(torch.int32)
    remember_host_lengths(cu, sizes)
    return cu, int(sizes.max()) if len(sizes) else 0


nopad_varlen_attention.reads_boundaries = True  # type: ignore[attr-defined]  # Ulysses passes the full row's


def reads_boundaries(attn_implementation: str | None) -> bool:
    """True when this implementation takes ``cu_seq_lens_q/k`` (flash-attn's, nopad's, or Ulysses around them)."""
    if attn_implementation is None:
        return False
    base = attn_implementation.removeprefix(ULYSSES_PREFIX)
    return "flash" in base or base.startswith(IMPLEMENTATION)


# ---- registration and switching ---------------------------------------------------------------------


def _register_attention(modeling_utils: Any) -> None:
    for name in _IMPLEMENTATION_OF.values():
        modeling_utils.AttentionInterface.register(name, nopad_varlen_attention)


def _register_masks(masking_utils: Any) -> None:
    # flash-attn's mask builder: None for a packed or unpadded batch, the 2-D padding mask otherwise
    builder = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    for name in _IMPLEMENTATION_OF.values():
        masking_utils.AttentionMaskInterface.register(name, builder)


_REGISTRARS = {"transformers.modeling_utils": _register_attention, "transformers.masking_utils": _register_masks}


@functools.cache
def register() -> None:
    """Register ``nopad_varlen`` (and one name per forced kernel) with transformers. Once.

    Importing this module does it where transformers is installed, so
    ``from_pretrained(..., attn_implementation="nopad_varlen")`` works after ``import nopad.modeling._attention``
    (``import nopad`` alone imports neither this module nor transformers).
    """
    for module_name, registrar in _REGISTRARS.items():
        registrar(importlib.import_module(module_name))


def _model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters(), None)
    if param is None:
        return torch.device("cpu"), torch.float32
    return param.device, param.dtype


def current_implementation(model: torch.nn.Module) -> str | None:
    """``model.config._attn_implementation``, or None for a model without one."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def use_packed_attention(model: torch.nn.Module, kernel: str = "auto") -> torch.nn.Module:
    """Make every position-mixing layer of ``model`` keep the sequences of a packed row apart.

    Its attention switches to ``nopad_varlen`` with ``kernel`` ('auto' or one of :data:`KERNELS`);
    its layers that carry state along the sequence (gated delta nets, Mamba2 scans, causal convs)
    get their packed forms (:mod:`nopad.modeling`), for this model only. A module nopad cannot keep
    apart is refused first, with a ValueError naming its class and what to do, and nothing is
    changed. A forced kernel that cannot run on the model's device and dtype is a ValueError now,
    not at the first forward. A model under Ulysses (:func:`nopad.parallel.enable_ulysses`) stays
    under it, around the new kernel. Idempotent; returns the model (:func:`packed_attention` undoes
    it on leaving its block).
    """
    if kernel not in _IMPLEMENTATION_OF:
        raise input_error("kernel", None, f"'auto' or one of {list(KERNELS)}", repr(kernel))
    _check_configured(model)
    device, dtype = _model_device_dtype(model)
    if kernel != "auto":
        select_kernel(kernel, device.type, dtype, Needs())
    route(model)
    _switch(model, kernel)
    return model


def _check_configured(model: Any) -> None:
    """A transformers model: its attention implementation lives in its config, where nopad sets it."""
    if not isinstance(model, torch.nn.Module) or not hasattr(getattr(model, "config", None), "_attn_implementation"):
        got = type(model).__name__ + ("" if isinstance(model, torch.nn.Module) else " (not a torch module)")
        raise input_error("model", None, "a transformers model (a module with a config naming its attention)", got)


def _switch(model: torch.nn.Module, kernel: str) -> None:
    register()
    current = current_implementation(model) or ""
    set_attn_implementation(model, _IMPLEMENTATION_OF[kernel])
    if current.startswith(ULYSSES_PREFIX):
        enable_ulysses(model)


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module, kernel: str | None = "auto") -> Iterator[torch.nn.Module]:
    """Within the block, ``model``'s packed forwards keep their sequences apart in every layer, as
    after :func:`use_packed_attention`; on leaving it, the model is as it was.

    ``kernel="auto"`` keeps an attention that already reads packed boundaries (flash-attn's,
    ``nopad_varlen``'s) and switches any other (sdpa, eager, flex) to ``nopad_varlen``; a kernel
    name forces that kernel; ``None`` keeps the model's own attention implementation, which must read
    the packed boundaries itself (flash-attn's, ``nopad_varlen``): one that builds masks (sdpa, eager,
    flex) is a ValueError before anything runs, since whether its masks keep the sequences apart
    depends on how each model builds them (Moshi's decoder on transformers 5.20 hands its layers no
    positions, and one mask spans the row), which nopad cannot vouch for.
    """
    _check_configured(model)
    current = current_implementation(model)
    routed = route_of(model) is not None
    switching = kernel is not None and (kernel != "auto" or not reads_boundaries(current))
    if (switching or not routed) and torch.is_grad_enabled() and checkpointed(model):
        raise input_error(
            "model",
            None,
            "a model switched once with use_packed_attention(model) when its layers are checkpointed "
            "(their backward recomputes them after this block would have switched the model back)",
            f"{type(model).__name__} with activation checkpointing on, not switched",
        )
    found = route(model)
    try:
        if kernel is None:
            if found.survey.attention and not reads_boundaries(current):
                raise input_error(
                    "attention",
                    None,
                    "an attention implementation that reads packed boundaries for attention=None "
                    "(flash-attn's or nopad_varlen), or 'auto'",
                    repr(current),
                )
        elif switching:
            if kernel not in _IMPLEMENTATION_OF:
                raise input_error("kernel", None, f"'auto' or one of {list(KERNELS)}", repr(kernel))
            if kernel != "auto":
                device, dtype = _model_device_dtype(model)
                select_kernel(kernel, device.type, dtype, Needs())
            _switch(model, kernel)
        yield model
    finally:
        if current is not None and current_implementation(model) != current:
            set_attn_implementation(model, current)
        if not routed:
            found.remove()
