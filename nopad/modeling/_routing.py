"""Routing one model's packed forwards: every layer that mixes positions keeps the sequences apart.

transformers' layers that carry state along the sequence call module-level primitives
(``causal_conv1d_fn``, ``chunk_gated_delta_rule``, ``mamba_chunk_scan_combined``, ...) whose torch
fallbacks ignore packed boundaries. :func:`route` gives each such layer of ONE model its packed
form: the layer's own methods, rebound to copies whose globals name nopad's adapters instead of
those primitives (the layer's code runs unchanged; transformers' modules and every other model in
the process are untouched). The adapters read the row's boundaries from the forward's kwargs
(``cu_seq_lens_q``, as flash-attention reads them), so they reach every layer, and again when
activation checkpointing recomputes one; a root pre-hook puts them there when the caller gave
only restarting position ids, and turns the cache off for a packed forward.

The guard (:func:`survey`) runs before the first packed forward: every module that mixes positions
must be served (its primitives have packed forms, its attention runs through transformers'
attention interface under a boundary-reading implementation, or a packed form was registered for
its class with :func:`register_packed_module`); anything else is a ValueError naming the module's
class and what to do, before anything runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dis
import inspect
import math
import re
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from nopad.core._batch import takes_keyword
from nopad.core._errors import input_error
from nopad.core._layout import IndexPlan, known_host_lengths, remember_host_lengths
from nopad.core._memo import memo, recall, remember, tagged
from nopad.modeling._layers import (
    ROW_OF_ITS_OWN,
    BoundedRow,
    PackedRow,
    causal_conv1d,
    gated_delta_rule,
    registered_form,
    ssd_scan,
    torch_causal_conv1d,
    torch_selective_scan,
)
from nopad.parallel._ulysses import SP_GROUP_KWARG, all_to_all, gather_seq

# ---- the packed row of a forward -------------------------------------------------------------------


@dataclass(frozen=True)
class _Forward:
    """The packed forward a routed model is running: its root's class, boundaries and SP group, and
    whether its layers are checkpointed (set by the root's pre-hook, cleared after its forward)."""

    owner: str
    cu_seqlens: Tensor
    group: Any
    checkpointed: bool
    longest: int | None = None  # the longest sequence, where the caller or the position ids told it


class _RowState:
    """A per-forward state that torch.compile traces: a context variable's get, set and reset (dynamo
    traces none of them: a graph break each), kept in a context variable in eager code (per thread,
    as before) and on a list of the object's own under compile, innermost last. A set under compile
    pushes and its reset pops, so the list is empty between forwards: nothing (no model, tensor or
    id) is held beyond one. The list is process-wide: two threads running compiled packed forwards
    at once would share it.

    A read finds the innermost compiled value, unless this context set an eager one (an eager
    forward started between two graphs of a compiled one); traced with no compiled value, the eager
    variable is read (a graph break, the value right) only while some eager set is in force, in any
    thread: a block compiled alone under an eager root hook still finds the row."""

    def __init__(self, name: str) -> None:
        self._var: contextvars.ContextVar[Any] = contextvars.ContextVar(name, default=None)
        self._compiled: list[Any] = []
        self._eager = 0  # eager sets not reset yet, in every thread
        self._lock = threading.Lock()

    def get(self) -> Any:
        if self._compiled:
            if torch.compiler.is_compiling():
                return self._compiled[-1]
            eager = self._var.get(_UNSET)
            return self._compiled[-1] if eager is _UNSET else eager
        if not self._eager and torch.compiler.is_compiling():
            return None
        return self._var.get()

    def set(self, value: Any) -> Any:
        if torch.compiler.is_compiling():
            self._compiled.append(value)
            return _PUSHED
        with self._lock:
            self._eager += 1
        return self._var.set(value)

    def reset(self, token: Any) -> None:
        if token is _PUSHED:
            if self._compiled:
                self._compiled.pop()
            return
        self._var.reset(token)
        with self._lock:
            self._eager -= 1


_UNSET, _PUSHED = object(), object()

# the routed packed forward running now (None in a forward that is not packed); set by the root's hooks
_PACKED_FORWARD = _RowState("nopad_packed_forward")

# the boundaries (and SP group) handed to the state layer of transformers 5.10's shape running now, or
# to a module on the way down to it, for the primitives it calls without them (set by their routed
# forwards from their kwargs, so a checkpointed layer's recomputation, given the same kwargs again,
# sets them again; see the section on transformers 5.10 below)
_LAYER_ROW = _RowState("nopad_layer_row")  # (cu_seqlens, SP group, longest or None)


def packed_forward_boundaries() -> tuple[Tensor, int | None] | None:
    """(cu_seqlens, longest or None) of the routed packed forward running now, or None outside one: what
    a layer that is not handed the boundaries (a decoder that drops its kwargs) must still keep apart."""
    forward = _PACKED_FORWARD.get()
    return None if forward is None else (forward.cu_seqlens, forward.longest)


def packed_row_of(cu_seqlens: Tensor) -> PackedRow:
    """The :class:`PackedRow` of these boundaries, made once and kept on the tensor itself (by
    identity: every layer of a forward, and a checkpointed layer's recomputation, get the same one).
    One host sync the first time, unless nopad recorded the lengths when it made the tensor."""
    return memo(cu_seqlens, "packed_row", lambda: PackedRow.from_cu_seqlens(cu_seqlens, known_host_lengths(cu_seqlens)))


def _row_of(cu: Tensor, kwargs: dict, tokens: Any) -> PackedRow:
    """The row a call of ``tokens`` tokens (the whole row's) runs on: :func:`packed_row_of` in eager
    code; under torch.compile a :class:`BoundedRow` of the boundaries, the token count and the longest
    sequence the forward was handed (``max_length_q``, a host int known before it), which dynamo traces
    without a break (no host read of the lengths, no read of the memo, whose entries name other
    forwards' facts: a guard on them would recompile). Built per call: nothing derived in one graph
    is kept for another. A compiled call with no longest known, or on boundaries tagged as carrying a
    row of their own (a shared-prefix row's), takes :func:`packed_row_of` (graph breaks, the row right)."""
    if torch.compiler.is_compiling() and not tagged(cu, ROW_OF_ITS_OWN):
        longest = _longest(cu, kwargs)
        if longest:
            return BoundedRow(cu, tokens, longest)
    return packed_row_of(cu)


def _longest(cu: Tensor, kwargs: dict) -> Any:
    """The longest sequence of the row ``cu`` bounds, as the call's kwargs tell it (``max_length_q``
    beside ``cu_seq_lens_q``; a layer that hands the boundaries on as ``cu_seqlens`` keeps the
    ``_k`` pair), else as the forward was handed it, else None. Under torch.compile one the compiled
    frame was handed is symbolic; the forward's, where the root's hook ran as a frame of its own, is
    a constant of the graph (a graph per value)."""
    for side in ("q", "k"):
        if kwargs.get(f"cu_seq_lens_{side}") is cu and kwargs.get(f"max_length_{side}"):
            return kwargs[f"max_length_{side}"]
    layer = _LAYER_ROW.get()  # a 5.10-shaped layer's: handed on from the kwargs of a module above it
    if layer is not None and layer[0] is cu and layer[2]:
        return layer[2]
    forward = _PACKED_FORWARD.get()
    return forward.longest if forward is not None and forward.cu_seqlens is cu else None


@dataclass
class _Call:
    """One primitive call inside a packed forward: the row, and the SP group when the row is sharded."""

    row: PackedRow
    group: Any = None

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)


def _row_source(kwargs: dict, owner: str, boundaries: Any = None) -> tuple[Tensor, Any] | None:
    """(cu_seqlens, SP group) of the packed row this call is part of, or None for a call that is not packed.

    The boundaries come from ``boundaries`` or the call's kwargs (``cu_seq_lens_q``, as transformers'
    layers hand the model's kwargs on), else from the state layer of transformers 5.10's shape that
    runs the call (it was handed them), else from the packed forward the call runs in: a layer that
    is not handed the kwargs still gets the row. Activation checkpointing recomputes such a layer
    outside the forward, where that row is gone: with checkpointing on it is refused.
    """
    cu = boundaries if boundaries is not None else kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))
    layer = _LAYER_ROW.get()
    if cu is not None:
        group = kwargs.get(SP_GROUP_KWARG)
        if group is None and layer is not None and layer[0] is cu:  # 5.10's delta rule: handed cu_seqlens only
            group = layer[1]
        return cu, group
    if layer is not None:
        return layer[0], layer[1]
    forward = _PACKED_FORWARD.get()
    if forward is None:
        return None
    if forward.checkpointed:
        raise input_error(
            owner,
            None,
            "the packed row's boundaries (cu_seq_lens_q) among its kwargs when its layers are checkpointed "
            "(a recomputation in backward sees only what the layer was given)",
            f"none: {forward.owner} of transformers {_transformers_version()} does not hand them to {owner} (turn "
            "activation checkpointing off, or register a packed form for it with register_packed_module)",
        )
    return forward.cu_seqlens, forward.group


def _packed_call(kwargs: dict, owner: str, local_tokens: int, boundaries: Any = None) -> _Call | None:
    """The packed row this call is part of (where its boundaries come from: :func:`_row_source`), or
    None for a call that is not packed (a padded forward, generation): that call runs the original
    primitive."""
    source = _row_source(kwargs, owner, boundaries)
    if source is None:
        return None
    cu, group = source
    group = None if group is None or dist.get_world_size(group) == 1 else group
    call = _Call(_row_of(cu, kwargs, local_tokens * (1 if group is None else dist.get_world_size(group))), group)
    if local_tokens * call.world != call.row.total:
        raise input_error(
            owner,
            None,
            f"{call.row.total} tokens (the packed row's boundaries end there)"
            + (f" over {call.world} SP ranks" if call.world > 1 else ""),
            f"{local_tokens} tokens{' on this rank' if call.world > 1 else ''}",
        )
    return call


def _no_state(owner: str, **given: Any) -> None:
    """A packed forward starts every sequence from zero and returns no state (no cache)."""
    for name, value in given.items():
        if value is not None and value is not False:
            raise input_error(
                f"{owner} {name}",
                None,
                "None in a packed forward (each sequence starts from a zero state; nopad does not serve "
                "packed generation)",
                "a state" if isinstance(value, Tensor) else repr(value),
            )


# ---- Ulysses sequence parallelism for the state-carrying layers -------------------------------------
# Heads are independent, so the all-to-all that serves attention (sequence-sharded -> head-sharded)
# serves the gated delta rule and the SSD scan; the conv needs only the K - 1 inputs before each
# rank's first token, all-gathered from the ranks' tails. With no SP (one rank) the head helpers below
# return their input itself: no op is added.


def _to_heads(x: Tensor, call: _Call) -> Tensor:
    """(1, L, H, ...) this rank's tokens -> (1, L * W, H / W, ...) the whole row for this rank's heads."""
    return x if call.world == 1 else all_to_all(x, call.group, scatter_dim=2, gather_dim=1)


def _to_tokens(x: Tensor, call: _Call) -> Tensor:
    return x if call.world == 1 else all_to_all(x, call.group, scatter_dim=1, gather_dim=2)


def _heads_of_rank(x: Tensor, call: _Call) -> Tensor:
    """The per-head parameter ``x`` (H, ...) for this rank's heads."""
    return x if call.world == 1 else x.chunk(call.world)[call.rank]


def _rank_heads(call: _Call, owner: str, heads: list, grouped: list) -> tuple[list, list]:
    """:func:`_to_heads` of tensors with one slice per head (None kept) and of those with one per group of
    heads (the delta rule's keys, the scan's B and C), repeated per head where the groups do not split."""
    count = heads[0].shape[2]
    if count % call.world:
        raise input_error(f"{owner} heads", None, f"a multiple of the SP size {call.world}", f"{count}")
    if grouped[0].shape[2] % call.world:  # too few groups to split: one copy per head
        grouped = [x.repeat_interleave(count // x.shape[2], dim=2) for x in grouped]
    return [None if x is None else _to_heads(x, call) for x in heads], [_to_heads(x, call) for x in grouped]


def _conv_history(x: Tensor, call: _Call, taps: int) -> Tensor:
    """(C, K - 1): the inputs just before this rank's first token (zeros before the row)."""
    C, L = x.shape
    tail = min(taps - 1, L)
    tails = gather_seq(x[:, L - tail :].contiguous(), call.group, dim=1)  # (C, tail * W), rank order
    before = torch.cat([x.new_zeros((C, taps - 1)), tails[:, : tail * call.rank]], dim=1)
    return before[:, before.shape[1] - (taps - 1) :]


# ---- adapters: transformers' primitives with nopad's packed forms behind them -----------------------
# One small object per primitive, called with the primitive's signature and returning what it returns:
# a packed call runs nopad's packed form, any other call the original primitive.


@dataclass(frozen=True, eq=False)
class Adapter:
    """What a routed layer calls in place of ``original``, which still runs every call that is not packed
    (a padded forward, generation); ``owner``, the layer's class, names it in messages and in its repr.
    ``original`` is None only where transformers 5.10 found no package, whose path only packed calls take."""

    original: Any = field(repr=False)
    owner: str


@dataclass(frozen=True, eq=False)
class PackedConv(Adapter):
    """``causal_conv1d_fn``: (B, C, L) with weight (C, K) -> (B, C, L), each sequence of a packed row
    convolved alone (under SP, from the K - 1 inputs before this rank's first token)."""

    def __call__(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        B, C, L = hidden_states.shape
        call = _packed_call(kwargs, self.owner, B * L)
        if call is None:
            return self.original(hidden_states, weight, bias, activation=activation, **kwargs)
        states = {name: kwargs.get(name) for name in ("initial_states", "return_final_states")}
        _no_state(self.owner, **states)
        x = hidden_states.transpose(0, 1).reshape(C, B * L)
        if call.world == 1:
            out = causal_conv1d(x, weight, bias, call.row, activation=activation)
        else:
            start = call.rank * B * L
            positions = call.row.position_ids[start : start + B * L]
            history = _conv_history(x, call, weight.shape[-1])
            out = torch_causal_conv1d(x, weight, bias, positions, activation=activation, history=history)
        return out.view(C, B, L).transpose(0, 1)


@dataclass(frozen=True, eq=False)
class PackedGatedDeltaRule(Adapter):
    """``chunk_gated_delta_rule``: q, k (B, L, Hk, D), v (B, L, H, Dv), g and beta (B, L, H) -> ((B, L, H, Dv),
    None), each sequence of a packed row from a zero state (under SP, this rank's heads over the whole row)."""

    def __call__(
        self,
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=None,
        scale=None,
        **kwargs,
    ):
        B, L = value.shape[:2]
        call = _packed_call(kwargs, self.owner, B * L, cu_seqlens)
        if call is None:
            options = dict(chunk_size=chunk_size, initial_state=initial_state, output_final_state=output_final_state)
            rule = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **({} if scale is None else {"scale": scale}))
            return self.original(query, key, value, g=g, beta=beta, **options, **rule, **kwargs)
        _no_state(self.owner, initial_state=initial_state, output_final_state=output_final_state)
        q, k, v, g, beta = (x.reshape(1, B * L, *x.shape[2:]) for x in (query, key, value, g, beta))
        (v, g, beta), (q, k) = _rank_heads(call, self.owner, [v, g, beta], [q, k])
        options = dict(chunk_size=chunk_size, scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel)
        out = _to_tokens(gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], call.row, **options).unsqueeze(0), call)
        return out.view(B, L, *out.shape[2:]), None


@dataclass(frozen=True, eq=False)
class PackedSSDScan(Adapter):
    """``mamba_chunk_scan_combined`` (Mamba2's SSD scan): x (B, L, H, P), dt (B, L, H), B and C (B, L, G, N)
    -> (B, L, H, P), each sequence of a packed row from a zero state (under SP, this rank's heads)."""

    def __call__(
        self,
        hidden_states,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        z=None,
        dt_bias=None,
        initial_states=None,
        dt_softplus=False,
        dt_limit=(0.0, math.inf),
        return_final_states=False,
        **kwargs,
    ):
        batch, L = hidden_states.shape[:2]
        call = _packed_call(kwargs, self.owner, batch * L, kwargs.get("cu_seqlens"))
        options = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        if call is None:
            states = dict(initial_states=initial_states, return_final_states=return_final_states)
            return self.original(hidden_states, dt, A, B, C, chunk_size, **states, **options, **kwargs)
        _no_state(self.owner, initial_states=initial_states, return_final_states=return_final_states)
        x, dt, B, C = (t.reshape(1, batch * L, *t.shape[2:]) for t in (hidden_states, dt, B, C))
        z = None if z is None else z.reshape(1, batch * L, *z.shape[2:])
        (x, dt, z), (B, C) = _rank_heads(call, self.owner, [x, dt, z], [B, C])
        A, D, dt_bias = (None if p is None else _heads_of_rank(p, call) for p in (A, D, dt_bias))
        options.update(D=D, z=None if z is None else z[0], dt_bias=dt_bias)
        out = ssd_scan(x[0], dt[0], A, B[0], C[0], call.row, chunk_size=chunk_size, **options).unsqueeze(0)
        out = _to_tokens(out, call)
        return out.view(batch, L, *out.shape[2:])


@dataclass(frozen=True, eq=False)
class UnfusedMamba2(Adapter):
    """``mamba_split_conv1d_scan_combined``, mamba-ssm's fused conv + scan + norm + projection (zxbcdt
    (B, L, ...)): a packed call returns None, as the torch fallback does, so the layer takes its unfused
    path (conv and scan served)."""

    seq_dim = 1  # where the input's tokens are

    def __call__(self, x, *args, **kwargs):
        if _packed_call(kwargs, self.owner, x.shape[0] * x.shape[self.seq_dim], kwargs.get("cu_seqlens")) is not None:
            return None
        return self.original(x, *args, **kwargs)


def _alone_kwargs(call: _Call, owner: str, what: str, kwargs: dict) -> dict:
    """The kwargs of a primitive run one row per sequence (no SP: refused), less those naming a packed
    row's boundaries, which such a run is not handed."""
    if call.world > 1:
        raise input_error(owner, None, f"no sequence parallelism ({what} under Ulysses)", f"SP {call.world}")
    boundaries = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    return {k: v for k, v in kwargs.items() if k not in boundaries}


def _by_sequence(x: Tensor, call: _Call, seq_dim: int) -> Tensor:
    """(1, T, ...) with the tokens on ``seq_dim`` -> (N, longest, ...) one sequence per row, zeros after it."""
    return call.row.to_padded(x[0].movedim(seq_dim - 1, 0)).movedim(1, seq_dim)


def _by_token(y: Tensor, call: _Call, seq_dim: int) -> Tensor:
    return call.row.from_padded(y.movedim(seq_dim, 1)).movedim(0, seq_dim - 1).unsqueeze(0)


@dataclass(frozen=True, eq=False)
class PackedKDA(Adapter):
    """``chunk_kda`` (Kimi delta attention: a delta rule with a decay per key channel): (B, L, H, D) ->
    ((B, L, H, D), None), transformers' reference run one row per sequence, right-padded (a causal scan:
    what follows a sequence never reaches it). No SP."""

    def __call__(
        self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False, **kwargs
    ):
        B, L = value.shape[:2]
        call = _packed_call(kwargs, self.owner, B * L, kwargs.pop("cu_seqlens", None))
        options = dict(chunk_size=chunk_size, initial_state=initial_state, output_final_state=output_final_state)
        if call is None:
            return self.original(query, key, value, g=g, beta=beta, **options, **kwargs)
        _no_state(self.owner, initial_state=initial_state, output_final_state=output_final_state)
        kwargs = _alone_kwargs(call, self.owner, "Kimi delta attention", kwargs)
        rows = [_by_sequence(t.reshape(1, B * L, *t.shape[2:]), call, 1) for t in (query, key, value, g, beta)]
        out, _ = self.original(*rows[:3], g=rows[3], beta=rows[4], **options, **kwargs)
        return _by_token(out, call, 1).view(B, L, *out.shape[2:]), None


@dataclass(frozen=True, eq=False)
class PackedSelectiveScan(Adapter):
    """``selective_scan_fn`` (Mamba's selective scan): x, dt (B, D, L), B and C (B, N, L) -> (B, D, L), the
    original run one row per sequence, right-padded, as :class:`PackedKDA`. No SP."""

    def __call__(
        self,
        hidden_states,
        dt,
        A,
        B,
        C,
        D=None,
        z=None,
        delta_bias=None,
        delta_softplus=False,
        return_last_state=False,
        **kwargs,
    ):
        batch, _, L = hidden_states.shape
        call = _packed_call(kwargs, self.owner, batch * L)
        options = dict(D=D, delta_bias=delta_bias, delta_softplus=delta_softplus)
        if call is None:
            return self.original(
                hidden_states, dt, A, B, C, z=z, return_last_state=return_last_state, **options, **kwargs
            )
        _no_state(self.owner, return_last_state=return_last_state)
        kwargs = _alone_kwargs(call, self.owner, "Mamba's selective scan", kwargs)
        flat = [
            None if t is None else t.movedim(0, 1).reshape(1, t.shape[1], batch * L)
            for t in (hidden_states, dt, B, C, z)
        ]
        rows = [None if t is None else _by_sequence(t, call, 2) for t in flat]
        out = self.original(*rows[:2], A, *rows[2:4], z=rows[4], return_last_state=False, **options, **kwargs)
        packed = _by_token(out, call, 2)  # (1, channels, T)
        return packed.reshape(packed.shape[1], batch, L).movedim(1, 0)


@dataclass(frozen=True, eq=False)
class UnfusedMamba(UnfusedMamba2):
    """``mamba_inner_fn``, mamba-ssm's fused Mamba (xz (B, 2D, L)): a packed call returns None, so the layer
    takes its unfused path (conv and scan served)."""

    seq_dim = -1


# transformers' primitives (by the kernel name transformers registers them under) -> nopad's adapter
ADAPTERS: dict[str, type[Adapter]] = {
    "causal_conv1d_fn": PackedConv,
    "chunk_gated_delta_rule": PackedGatedDeltaRule,
    "mamba_chunk_scan_combined": PackedSSDScan,
    "mamba_split_conv1d_scan_combined": UnfusedMamba2,
    "chunk_kda": PackedKDA,
    "selective_scan_fn": PackedSelectiveScan,
    "mamba_inner_fn": UnfusedMamba,
}
# primitives of one decoding step (they run only with a cache, which a packed forward never has)
STEP_PRIMITIVES = {
    "causal_conv1d_update",
    "selective_state_update",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
}
# primitives that carry state along the sequence with no packed form here, and what they are
UNSERVED_PRIMITIVES: dict[str, str] = {}


# ---- what a layer calls: transformers' primitives and the helpers that reach them ----------------------
# transformers decorates each sequence primitive with ``use_kernel_func_from_hub_with_fallback(name,
# package)`` and the helpers that call them (``causal_conv1d_forward``, ``mamba2_scan_forward``, ...) with
# ``use_kernel_forward_from_hub(name)``. Without the ``kernels`` package a primitive is a closure over
# ``func_name`` (``__wrapped__`` is the torch fallback) and a helper a plain function; with it (a hard
# dependency since transformers 5.25) both are kernels function modules, whose class carries the name as
# ``kernel_layer_name`` (kernels' own lookup key) and whose forward calls the decorated function. These
# readers are the one place nopad looks inside those wrappers; what they cannot read is refused by name.


def _kernels_function(module: torch.nn.Module) -> Callable | None:
    """The function a kernels function module calls (its forward's ``func``), or None."""
    try:
        func = inspect.getclosurevars(type(module).forward).nonlocals.get("func")
    except (TypeError, ValueError):
        return None
    return func if callable(func) else None


def _fallback_name(fn: Any) -> str | None:
    """The kernel name of a ``use_kernel_func_from_hub_with_fallback`` closure, or None."""
    if not inspect.isfunction(fn) or not hasattr(fn, "__wrapped__"):
        return None
    try:
        name = inspect.getclosurevars(fn).nonlocals.get("func_name")
    except (TypeError, ValueError):
        return None
    return name if isinstance(name, str) else None


@dataclass(frozen=True)
class Callee:
    """A global a layer's code calls, as transformers wrapped it: a sequence ``primitive`` (its kernel
    name; ``function``, transformers' torch implementation behind it, what runs without the CUDA
    package), a ``helper`` whose Python ``function`` may reach primitives, or ``opaque`` (a kernels
    function module whose function nopad cannot read: its ``name`` says what it is)."""

    kind: str  # "primitive", "helper" or "opaque"
    name: str
    function: Callable | None = None


def callee(obj: Any) -> Callee | None:
    """What ``obj`` (a module global) is to the routing, or None for anything that is not a function."""
    if isinstance(obj, torch.nn.Module) and not getattr(type(obj).forward, "__module__", "").startswith("kernels"):
        return None  # a layer instance kept as a global (an activation): per token, and not a function
    layer_name = getattr(type(obj), "kernel_layer_name", None) if isinstance(obj, torch.nn.Module) else None
    if isinstance(layer_name, str):
        func = _kernels_function(obj)
        if func is None:
            return Callee("opaque", layer_name)
        name = _fallback_name(func)
        return Callee("primitive" if name else "helper", name or layer_name, inspect.unwrap(func))
    name = _fallback_name(obj)
    if name is not None:
        return Callee("primitive", name, inspect.unwrap(obj))
    if inspect.isfunction(obj):
        return Callee("helper", obj.__name__, inspect.unwrap(obj))
    return None


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# ---- rebinding a layer's methods ------------------------------------------------------------------


def _replaced(fn: types.FunctionType, old: Callable, new: Callable) -> types.FunctionType:
    """A copy of the wrapper ``fn`` whose closure holds ``new`` where it held ``old``."""
    closure = (
        tuple(types.CellType(new) if cell.cell_contents is old else cell for cell in (fn.__closure__ or ())) or None
    )
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    copy.__dict__.update(fn.__dict__)
    copy.__wrapped__ = new  # type: ignore[attr-defined]
    return copy


def rebind(fn: Callable, globals_: dict[str, Any]) -> Callable:
    """``fn`` (and the decorators around it) with its code reading ``globals_`` over its own globals."""
    chain = [fn]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    inner = chain[-1]
    new_globals = {**inner.__globals__, **globals_}
    # without the module's name: torch.compile reads the globals of a function whose globals name a
    # module from that module (its unrebound primitives), and of any other from the dict itself
    new_globals.pop("__name__", None)
    current = types.FunctionType(inner.__code__, new_globals, inner.__name__, inner.__defaults__, inner.__closure__)
    current.__kwdefaults__, current.__qualname__ = inner.__kwdefaults__, inner.__qualname__
    current.__module__ = inner.__module__
    current.__dict__.update(inner.__dict__)
    for wrapper, wrapped in zip(reversed(chain[:-1]), reversed(chain[1:])):
        current = _replaced(wrapper, wrapped, current)
    return current


def _methods(cls: type) -> Iterator[tuple[str, Callable]]:
    """The plain functions a module class defines or inherits below ``torch.nn.Module``, the library's
    own base classes left out (``PreTrainedModel`` names the attention interface to configure it)."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass in (torch.nn.Module, object):
            break
        if klass.__module__.startswith("transformers.") and not klass.__module__.startswith("transformers.models."):
            continue
        for name, value in vars(klass).items():
            if name not in seen and inspect.isfunction(value):
                seen.add(name)
                yield name, value


@dataclass
class Reach:
    """What one function's code reaches through its module's globals, helpers followed: the primitives
    with packed forms (global name -> (kernel name, the primitive)), the helpers that reach some
    (global name -> (the helper's function, its reach)), what carries state with no packed form here,
    and whether it calls transformers' attention interface."""

    primitives: dict[str, tuple[str, Any]] = field(default_factory=dict)
    helpers: dict[str, tuple[Callable, Reach]] = field(default_factory=dict)
    unserved: set[str] = field(default_factory=set)
    attention_interface: bool = False

    @property
    def served(self) -> bool:
        return bool(self.primitives or self.helpers)


# position-wise kernels transformers wraps like its primitives: nothing to keep apart
POSITIONWISE_KERNELS = {"rotary_pos_emb"}
_REACHES: dict[Callable, Reach] = {}  # by function: functions live as long as their module


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code of the functions defined inside it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def names_read(code: types.CodeType) -> set[str]:
    """The global names ``code`` reads, with those of the functions defined inside it."""
    return {name for inner in _codes(code) for name in inner.co_names}


def _follows(helper: Callable, caller: Callable) -> bool:
    """Helpers of a model's own code: its module's, or any of transformers' modeling files'."""
    module = getattr(helper, "__module__", None) or ""
    return module == getattr(caller, "__module__", None) or module.startswith("transformers.models.")


def _reach(fn: Callable, visiting: frozenset = frozenset()) -> Reach:
    """What ``fn`` (a plain function) reaches. Once per function."""
    if fn in _REACHES:
        return _REACHES[fn]
    found = Reach()
    for global_name in names_read(fn.__code__):
        if global_name == "ALL_ATTENTION_FUNCTIONS":
            found.attention_interface = True
        what = callee(fn.__globals__.get(global_name))
        if what is None:
            continue
        if what.kind == "primitive" or (what.kind == "opaque" and what.name in ADAPTERS):
            if what.name in ADAPTERS:
                found.primitives[global_name] = (what.name, fn.__globals__[global_name])
            elif what.name in UNSERVED_PRIMITIVES:
                found.unserved.add(UNSERVED_PRIMITIVES[what.name])
            elif what.name not in STEP_PRIMITIVES:
                found.unserved.add(
                    f"{what.name} (a sequence primitive of transformers {_transformers_version()} that nopad does "
                    "not know)"
                )
        elif what.kind == "opaque":
            if what.name not in STEP_PRIMITIVES and what.name not in POSITIONWISE_KERNELS:
                found.unserved.add(f"{what.name} (a kernels function module whose code nopad cannot read)")
        elif what.function is not None and what.function not in visiting and _follows(what.function, fn):
            inner = _reach(what.function, visiting | {fn})
            if inner.served:
                found.helpers[global_name] = (what.function, inner)
            found.unserved |= inner.unserved
            found.attention_interface |= inner.attention_interface
    if not visiting:  # a reach found inside a cycle may miss the cycle's head: keep only complete ones
        _REACHES[fn] = found
    return found


@dataclass
class ClassSurvey:
    cls: type
    rebinds: dict[str, Reach] = field(default_factory=dict)  # methods that reach served primitives
    unserved: set[str] = field(default_factory=set)
    attention_interface: bool = False
    attributes: tuple[str, ...] = ()  # transformers 5.10's shapes (see above): primitives kept on the instance
    fast_path: tuple[str, ...] = ()  # ... and those its cuda_kernels_forward reads as globals

    @property
    def served(self) -> bool:
        return bool(self.rebinds or self.attributes or self.fast_path)


_SURVEYS: dict[type, ClassSurvey] = {}
_REBOUND: dict[type, dict[str, Callable]] = {}


def _class_survey(cls: type) -> ClassSurvey:
    """What a module class's own methods reach for: the primitives (served or not, directly or through
    helpers) and the attention interface. Once per class."""
    if cls in _SURVEYS:
        return _SURVEYS[cls]
    survey = _SURVEYS[cls] = ClassSurvey(cls)
    for name, method in _methods(cls):
        found = _reach(inspect.unwrap(method))
        if found.served:
            survey.rebinds[name] = found
        survey.unserved |= found.unserved
        survey.attention_interface |= found.attention_interface
    survey.attributes, survey.fast_path = _attribute_primitives(cls), _fast_path_globals(cls)
    return survey


def _rebound(fn: Callable, found: Reach, owner: str) -> Callable:
    """``fn`` reading nopad's adapters where it read served primitives, and rebound copies of the
    helpers that reach them (the helper's kernels dispatch is not kept: its code runs)."""
    replacements: dict[str, Any] = {
        g: ADAPTERS[kernel](original, owner) for g, (kernel, original) in found.primitives.items()
    }
    replacements.update({g: _rebound(helper, inner, owner) for g, (helper, inner) in found.helpers.items()})
    return rebind(fn, replacements)


def _rebound_methods(cls: type) -> dict[str, Callable]:
    """The class's methods that reach served primitives, rebound to the adapters. Once per class."""
    if cls in _REBOUND:
        return _REBOUND[cls]
    methods = dict(_methods(cls))
    _REBOUND[cls] = {
        name: _rebound(methods[name], found, cls.__name__) for name, found in _class_survey(cls).rebinds.items()
    }
    return _REBOUND[cls]


# ---- transformers before 5.20: the state layers' other shapes ----------------------------------------
# transformers 5.10 (verl 0.9.1 pins 5.10.4) ships the hybrid families with the same primitives, but its
# layers do not call them as the module-level wrapped functions read above (that seam exists from 5.20):
#
# - its gated delta nets (qwen3_5, qwen3_5_moe, qwen3_next, olmo_hybrid) keep them as instance
#   attributes set in ``__init__``: ``self.causal_conv1d_fn = causal_conv1d_fn``, None without the
#   causal-conv1d package, where the forward runs ``F.silu(self.conv1d(x)[..., :L])`` (the layer's own
#   torch Conv1d) instead, and ``self.chunk_gated_delta_rule = chunk_gated_delta_rule or
#   torch_chunk_gated_delta_rule``. Each such layer gets the adapters as its own attributes; a call that
#   is not packed runs what the layer ran before (the attribute's value or, where it was None, that
#   torch conv). olmo_hybrid's convs are ``ShortConvolution`` modules with a forward of their own,
#   given a packed one; any other conv inside such a layer is refused by name.
# - its Mamba2 mixers (bamba, granitemoehybrid, nemotron_h, falcon_h1, mamba2, zamba2), Mamba mixers
#   (mamba, falcon_mamba, jamba, zamba) and LFM2 short convs (lfm2, lfm2_moe) have a
#   ``cuda_kernels_forward`` calling the primitives as module globals (set in ``__init__``, None without
#   mamba-ssm / causal-conv1d), which ``forward`` takes only when they were found and the weights are on
#   CUDA, else a torch forward that calls none and ignores the row's boundaries. A packed forward of
#   such a mixer runs its ``cuda_kernels_forward`` with those globals naming nopad's adapters, the mixer
#   read as not training (so its fused training kernel is skipped: the conv and the scan run unfused, as
#   at eval, and are served); every other call runs the mixer's own forward, unchanged. Where its
#   torch forward clamps the time step and its CUDA forward does not, the packed scan clamps as the
#   sequence alone would on this machine.
# Most of 5.10's decoder layers call these mixers without the model's kwargs, so the modules on the
# way down hand the boundaries on; one that backward recomputes from its own arguments (activation
# checkpointing) hands down only its own, so a mixer it recomputes is refused rather than run as one
# sequence where no boundaries reach it.
# These readers are the one place nopad knows those shapes; from 5.20 on no layer has either.

_ATTRIBUTE_PRIMITIVES = ("causal_conv1d_fn", "chunk_gated_delta_rule")
_FAST_PATH = "cuda_kernels_forward"


def _attribute_names(functions: Iterable[Callable], *opnames: str) -> set[str]:
    """The attribute names the code of ``functions`` stores (``STORE_ATTR``) or loads (``LOAD_ATTR``; a
    method call's load is ``LOAD_METHOD`` before Python 3.12)."""
    codes = [inspect.unwrap(fn).__code__ for fn in functions]
    return {ins.argval for code in codes for ins in dis.get_instructions(code) if ins.opname in opnames}


def _attribute_primitives(cls: type) -> tuple[str, ...]:
    """The primitives a 5.10-shaped layer class keeps as instance attributes: set in its ``__init__``,
    read as ``self.<name>`` by another of its methods."""
    methods = dict(_methods(cls))
    init = methods.pop("__init__", None)
    if init is None:
        return ()
    stored = _attribute_names([init], "STORE_ATTR")
    loaded = _attribute_names(methods.values(), "LOAD_ATTR", "LOAD_METHOD")
    return tuple(name for name in _ATTRIBUTE_PRIMITIVES if name in stored and name in loaded)


def _fast_path_globals(cls: type) -> tuple[str, ...]:
    """The sequence primitives a 5.10-shaped mixer's ``cuda_kernels_forward`` reads as globals."""
    method = dict(_methods(cls)).get(_FAST_PATH)
    if method is None:
        return ()
    return tuple(sorted(names_read(inspect.unwrap(method).__code__) & set(_FAST_PATH_ADAPTERS)))


def primitives_510(cls: type) -> tuple[str, ...]:
    """The primitives a 5.10-shaped layer class calls (kept as attributes, or read as globals by its
    ``cuda_kernels_forward``): what a route serves it with; () for any other class."""
    survey = _class_survey(cls)
    return survey.attributes + survey.fast_path


@dataclass(frozen=True, eq=False)
class PackedConvX(PackedConv):
    """:class:`PackedConv` as transformers 5.10 calls it: its input named ``x`` (causal-conv1d's own name),
    which some layers pass by keyword."""

    def __call__(self, x, weight, bias=None, activation=None, **kwargs):
        return super().__call__(x, weight, bias, activation=activation, **kwargs)


@dataclass(frozen=True, eq=False)
class LayerConv:
    """What a 5.10 gated delta net runs for a conv call that is not packed: the primitive it keeps as its
    attribute (called by keyword) or, where that is None (no causal-conv1d), its own torch conv."""

    module: torch.nn.Module = field(repr=False)
    primitive: Callable | None

    def __call__(self, x, weight, bias=None, activation=None, **kwargs):
        if self.primitive is not None:
            return self.primitive(x=x, weight=weight, bias=bias, activation=activation, **kwargs)
        return F.silu(self.module.conv1d(x)[..., : x.shape[-1]])


@dataclass(frozen=True, eq=False)
class LayerDeltaRule:
    """What a 5.10 gated delta net runs for a delta-rule call that is not packed: the rule it keeps as its
    attribute, handed ``chunk_size`` only where it takes one (fla's kernel chooses its own)."""

    rule: Callable
    chunked: bool

    def __call__(self, query, key, value, chunk_size=64, **kwargs):
        return self.rule(query, key, value, **({"chunk_size": chunk_size} if self.chunked else {}), **kwargs)


def _attribute_adapter(module: torch.nn.Module, name: str) -> Adapter:
    """What a 5.10 gated delta net keeps as its attribute ``name`` (a primitive) in a route."""
    value: Any = getattr(module, name, None)
    if name == "causal_conv1d_fn":
        return PackedConvX(LayerConv(module, value), type(module).__name__)
    return PackedGatedDeltaRule(LayerDeltaRule(value, takes_keyword(value, "chunk_size")), type(module).__name__)


@dataclass(frozen=True, eq=False)
class MixerSSDScan(PackedSSDScan):
    """:class:`PackedSSDScan` as 5.10's Mamba2 mixers call it: they always ask for the final state (kept only
    with a cache, which a packed forward never has: None is returned) and view the output as mamba-ssm
    returns it, contiguous. ``clamped``: the mixer, where its torch forward clamps the time steps at
    ``time_step_min`` and its CUDA forward does not: clamped as the mixer alone would on this machine,
    where it would run its torch forward (no mamba-ssm, ``fast_alone`` False, or off CUDA)."""

    clamped: torch.nn.Module | None = field(default=None, repr=False)
    fast_alone: bool = field(default=False, repr=False)

    def __call__(self, hidden_states, *args, **kwargs):
        if self.clamped is not None and not (self.fast_alone and hidden_states.device.type == "cuda"):
            low, high = kwargs.get("dt_limit", (0.0, math.inf))
            kwargs["dt_limit"] = (max(low, self.clamped.time_step_min), high)
        wanted = kwargs.pop("return_final_states", False)
        out = super().__call__(hidden_states, *args, **kwargs).contiguous()
        return (out, None) if wanted else out


@dataclass(frozen=True, eq=False)
class MixerSelectiveScan(PackedSelectiveScan):
    """:class:`PackedSelectiveScan` as 5.10's Mamba mixers call it: zamba's concatenates the per-head final
    states before it checks for a cache, so zeros of the state's shape stand in where it asks for one
    (discarded: a packed forward has no cache)."""

    def __call__(self, hidden_states, dt, A, *args, return_last_state=False, **kwargs):
        out = super().__call__(hidden_states, dt, A, *args, **kwargs)
        if not return_last_state:
            return out
        return out, A.new_zeros(()).expand(hidden_states.shape[0], *A.shape)


class _OffCudaDevice:
    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def device(device: Any) -> Any:
        return torch.cuda.device(device) if torch.device(device).type == "cuda" else contextlib.nullcontext()


class _OffCuda:
    """``torch`` as falcon_h1's mixer reads it, ``torch.cuda.device(d)`` (its multi-GPU guard around the
    scan) a no-op off CUDA, so that its CUDA forward runs packed on any device."""

    cuda = _OffCudaDevice()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _torch_selective_scan_fn(*args: Any, return_last_state: bool = False, **kwargs: Any) -> Tensor:
    # where 5.10 found no mamba-ssm (it ships no torch form of the primitive): nopad's, one row per sequence
    return torch_selective_scan(*args, **kwargs)


_FAST_PATH_ADAPTERS: dict[str, type[Adapter]] = {
    "causal_conv1d_fn": PackedConvX,
    "mamba_chunk_scan_combined": MixerSSDScan,
    "selective_scan_fn": MixerSelectiveScan,
}
_FAST_PATH_FALLBACKS = {"selective_scan_fn": _torch_selective_scan_fn}  # where the module holds None


def _clamps_at_minimum(torch_path: Callable, fast: Callable) -> bool:
    """Whether a 5.10 mixer's torch forward clamps its time steps at ``time_step_min``, which its CUDA
    forward does not (nemotron_h's and zamba2's: their two paths differ by that clamp)."""
    return "time_step_min" in names_read(inspect.unwrap(torch_path).__code__) and "time_step_min" not in names_read(
        inspect.unwrap(fast).__code__
    )


class _NotTraining:
    """A mixer as its ``cuda_kernels_forward`` reads it in a packed forward: every attribute its own,
    ``training`` False (the fused training kernel, which has no packed form here, is not taken)."""

    training = False

    def __init__(self, module: torch.nn.Module) -> None:
        self.__dict__["_module"] = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


_KEEP = object()


def _checkpoints(module: torch.nn.Module) -> bool:
    """Whether backward recomputes ``module`` or its children (a checkpoint wrapper, or checkpointing on)."""
    return type(module).__name__ == "CheckpointWrapper" or getattr(module, "gradient_checkpointing", False) is True


def _recomputes_itself(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "CheckpointWrapper" or any(
        klass.__name__ == "GradientCheckpointingLayer" for klass in type(module).__mro__
    )


def _scoped_row(module: torch.nn.Module, kwargs: dict) -> Any:
    """The row a module on the way to a 5.10-shaped layer hands the layers below it: the boundaries
    among its kwargs (cu_seqlens, SP group, longest or None); none (so a packed call below reads the
    forward's row, which is refused under checkpointing) where backward recomputes it or its children
    from their own arguments, which an outer row does not reach; else whatever its caller handed
    down (``_KEEP``)."""
    checkpointed = _checkpoints(module)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and (not checkpointed or _recomputes_itself(module)):
        return cu, kwargs.get(SP_GROUP_KWARG), kwargs.get("max_length_q")
    return None if checkpointed else _KEEP


@dataclass(frozen=True, eq=False)
class CarrierForward(Adapter):
    """The forward of a module on the way down to a 5.10-shaped layer (or of that layer): its own (``run``),
    the boundaries it is handed kept for the primitives the layers below it call without them
    (:func:`_scoped_row`)."""

    module: torch.nn.Module = field(repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        row = _scoped_row(self.module, kwargs)
        if row is _KEEP:
            return self.run(*args, **kwargs)
        token = _LAYER_ROW.set(row)
        try:
            return self.run(*args, **kwargs)
        finally:
            _LAYER_ROW.reset(token)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.original(*args, **kwargs)


def _row_forward(module: torch.nn.Module) -> CarrierForward:
    return CarrierForward(module.forward, type(module).__name__, module)


@dataclass(frozen=True, eq=False)
class MixerForward(CarrierForward):
    """A 5.10 mixer's forward in a route: a packed call runs ``packed``, its ``cuda_kernels_forward`` reading
    nopad's adapters, with the mixer read as not training; any other call its own forward."""

    packed: Callable = field(repr=False)
    params: list[str] = field(repr=False)  # what 5.10's forwards hand cuda_kernels_forward: states, cache, mask

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if _row_source(kwargs, self.owner) is None:
            return self.original(*args, **kwargs)
        given = {**dict(zip(self.params, args)), **kwargs}
        states, cache, mask = (given.get(name) for name in self.params)
        _no_state(self.owner, cache=cache)
        return self.packed(_NotTraining(self.module), states, cache, mask)


def _fast_path_forward(module: torch.nn.Module, names: tuple[str, ...]) -> MixerForward:
    """The mixer's forward, its ``cuda_kernels_forward`` reading nopad's adapters for ``names``."""
    owner = type(module).__name__
    fast = getattr(type(module), _FAST_PATH)
    globals_ = inspect.unwrap(fast).__globals__
    adapters = {n: _FAST_PATH_ADAPTERS[n](globals_.get(n) or _FAST_PATH_FALLBACKS.get(n), owner) for n in names}
    torch_path, scan = dict(_methods(type(module))).get("torch_forward"), "mamba_chunk_scan_combined"
    if scan in adapters and torch_path is not None and _clamps_at_minimum(torch_path, fast):
        adapters[scan] = MixerSSDScan(globals_.get(scan), owner, module, bool(globals_.get("is_fast_path_available")))
    packed = rebind(fast, {**adapters, "torch": _OffCuda()})
    return MixerForward(module.forward, owner, module, packed, list(inspect.signature(module.forward).parameters)[:3])


@dataclass(frozen=True, eq=False)
class PackedShortConv(PackedConv):
    """The forward of olmo_hybrid's short conv in 5.10 (a depthwise ``nn.Conv1d`` called with ``(x, cache=,
    use_precomputed=, output_final_state=)``, returning ``(out, conv state)``): a packed call convolves each
    sequence alone and returns no state; any other call runs its own forward."""

    module: torch.nn.Module = field(repr=False)

    def __call__(  # type: ignore[override]  # the conv's forward, which only its module calls
        self, hidden_states: Tensor, cache: Any = None, use_precomputed: bool = False, **kwargs: Any
    ) -> Any:
        if _row_source(kwargs, self.owner) is None:
            return self.original(hidden_states, cache=cache, use_precomputed=use_precomputed, **kwargs)
        _no_state(self.owner, cache=cache, use_precomputed=use_precomputed)
        weight = self.module.weight.squeeze(1)  # type: ignore[operator]
        out = super().__call__(hidden_states.transpose(1, 2), weight, self.module.bias, activation=self.module.act_fn)
        return out.transpose(1, 2), None


# the convs a 5.10-shaped gated delta net holds beside the primitives it keeps as attributes: its
# ``conv1d`` (run through ``causal_conv1d_fn``, served by that attribute) and olmo_hybrid's short convs
_SHORT_CONV = re.compile(r"ShortConvolution$")


def _shaped_510(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, Any]]:
    """What a 5.10-shaped state layer gets in a route: (module, attribute, value), its short convs'
    forwards among them; nothing for other layers."""
    survey = _class_survey(type(module))
    if survey.fast_path:
        return [(module, "forward", _fast_path_forward(module, survey.fast_path))]
    if not survey.attributes:
        return []
    patched = [(module, name, _attribute_adapter(module, name)) for name in survey.attributes]
    patched += [
        (conv, "forward", PackedShortConv(conv.forward, type(conv).__name__, conv))
        for conv in module.modules()
        if isinstance(conv, torch.nn.Conv1d) and _SHORT_CONV.search(type(conv).__name__)
    ]
    return [*patched, (module, "forward", _row_forward(module))]


def _carriers_510(model: torch.nn.Module, names: list[str]) -> list[torch.nn.Module]:
    """The modules between the root and these 5.10-shaped layers: 5.10's decoder layers call most of
    those mixers without the row's boundaries, and activation checkpointing recomputes a decoder layer
    (given its kwargs again) outside the forward whose row the mixer would otherwise read. Each hands
    down what :func:`_scoped_row` says."""
    above = dict.fromkeys(
        ".".join(name.split(".")[:depth]) for name in names for depth in range(1, name.count(".") + 1)
    )
    return [model.get_submodule(name) for name in above]


def _unserved_convs(module: torch.nn.Module) -> list[str]:
    """The convs along the sequence inside a 5.10-shaped gated delta net that none of the above serves."""
    if not _class_survey(type(module)).attributes:
        return []
    return [
        name
        for name, conv in module.named_modules()
        if isinstance(conv, torch.nn.Conv1d)
        and conv.kernel_size[0] > 1
        and not _SHORT_CONV.search(type(conv).__name__)
        and not (name == "conv1d" and "causal_conv1d_fn" in _class_survey(type(module)).attributes)
    ]


# ---- registered packed forms ------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RegisteredForward(Adapter):
    """The forward of a module whose class has a registered packed form: a packed call runs
    ``form(module, row, *args, **kwargs)``; any other call its own forward."""

    module: torch.nn.Module = field(repr=False)
    form: Callable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tokens = next(
            (a.shape[0] * a.shape[1] for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and a.dim() >= 2), 0
        )
        call = _packed_call(kwargs, self.owner, tokens)
        if call is None:
            return self.original(*args, **kwargs)
        return self.form(self.module, call.row, *args, **kwargs)


# ---- the guard -------------------------------------------------------------------------------------

# module classes that mix positions in ways nopad cannot keep apart, found by the architecture sweep
# (tests/test_arch_sweep.py): a pattern on the class name -> what it does
REFUSED_CLASSES: dict[str, str] = {
    r"Indexer$": "selects each query's keys by a top-k over the whole row (a sparse-attention indexer)",
    r"Compressor$": "compresses keys across positions, blocks spanning the whole row (compressed attention)",
    r"^RwkvSelfAttention$": "carries a state along the sequence (RWKV's time-mixing recurrence)",
    r"LightningAttention$": "carries a state along the sequence (lightning attention: a linear-attention recurrence)",
    r"^xLSTM(Block|Layer|Backend)$": "carries a state along the sequence (xLSTM's mLSTM cell)",
    r"Rglru$": "carries a state along the sequence (RecurrentGemma's RG-LRU recurrence)",
    r"^BltCrossAttention$": "attends from patches to bytes across the whole row (BLT's cross attention)",
    r"^DogeAttention$": "adds a dynamic mask of its own to the attention scores over the whole row",
}
# submodules a text-only packed forward never runs (a multimodal model's towers): not surveyed
_TOWER = re.compile(r"(^|\.)[\w]*(vision|visual|audio|image|speech|video)[\w]*(\.|$)", re.IGNORECASE)
_ATTENTION_NAME = re.compile(r"attention|attn", re.IGNORECASE)


def _refusal(module: torch.nn.Module, children_attend: bool) -> str | None:
    """Why this module cannot be kept apart in a packed row, or None."""
    cls = type(module)
    survey = _class_survey(cls)
    if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
        return (
            f"(kernel {module.kernel_size[0]}) convolves along the sequence outside a layer nopad serves: its taps "
            "would reach into the previous sequence"
        )
    unserved_convs = _unserved_convs(module)
    if unserved_convs:
        return (
            f"convolves along the sequence through {', '.join(unserved_convs)}, a conv of transformers "
            f"{_transformers_version()}'s shape that nopad does not serve"
        )
    if survey.unserved:
        kinds = ", ".join(sorted(survey.unserved))
        return f"carries state along the sequence through {kinds}, which has no packed form in nopad"
    for pattern, reason in REFUSED_CLASSES.items():
        if re.search(pattern, cls.__name__):
            return reason
    if (
        _ATTENTION_NAME.search(cls.__name__)
        and not survey.attention_interface
        and not survey.served
        and not children_attend
        and not cls.__module__.startswith("torch.")
    ):
        return (
            "computes its attention itself rather than through transformers' attention interface, so no "
            "packed attention kernel reaches it (its mask or position biases would span the whole packed row)"
        )
    return None


@dataclass
class Survey:
    """What :func:`route` would do to a model: the modules it serves and how, and those it refuses."""

    rebound: list[tuple[str, str]]  # (module name, class name) whose primitives get packed forms
    registered: list[tuple[str, str]]
    attention: list[tuple[str, str]]  # modules whose attention runs through the interface
    refused: list[tuple[str, str, str]]  # (module name, class name, why)

    def error(self, model: torch.nn.Module) -> ValueError | None:
        if not self.refused:
            return None
        seen: dict[str, tuple[str, str]] = {}
        for name, cls, why in self.refused:
            seen.setdefault(cls, (name or "the model", why))
        listed = "; ".join(f"{cls} ({name}) {why}" for cls, (name, why) in seen.items())
        return input_error(
            "model",
            None,
            "a model whose every position-mixing layer nopad can keep apart in a packed row",
            f"{type(model).__name__}, whose {listed}. Run it padded, switch its attention with "
            "nopad.modeling.use_packed_attention, or register a packed form for the class with "
            "nopad.modeling.register_packed_module",
        )


def survey(model: torch.nn.Module) -> Survey:
    """Classify every module of ``model`` (no change is made; host work only)."""
    result = Survey([], [], [], [])
    windowed = _builds_window_mask(model)
    attends: dict[int, bool] = {}
    served: set[int] = set()  # modules inside a served one: its packed form covers them
    for name, module in model.named_modules():  # parents before children
        if _TOWER.search(name):
            served.add(id(module))
        if id(module) in served or registered_form(type(module)) is not None or _class_survey(type(module)).served:
            served.update(id(child) for child in module.children())
    for name, module in reversed(list(model.named_modules())):  # children before parents
        cls = type(module)
        children_attend = any(attends.get(id(child), False) for child in module.children())
        class_survey = _class_survey(cls)
        attends[id(module)] = children_attend or class_survey.attention_interface or class_survey.served
        if id(module) in served:
            continue
        if registered_form(cls) is not None:
            result.registered.append((name, cls.__name__))
            attends[id(module)] = True
            continue
        why = _refusal(module, children_attend)
        if why is None and windowed and class_survey.attention_interface:
            why = _dropped_window(module)
        if why is not None:
            result.refused.append((name, cls.__name__, why))
        elif class_survey.served:
            result.rebound.append((name, cls.__name__))
        elif class_survey.attention_interface:
            result.attention.append((name, cls.__name__))
    for found in (result.rebound, result.registered, result.attention, result.refused):
        found.reverse()
    if result.attention and not _reads_positions(model):
        result.refused.insert(
            0,
            (
                "",
                type(model).__name__,
                "takes no position ids past its embeddings, so its positions would count on across the packed "
                "row (each sequence must restart at 0)",
            ),
        )
    return result


# transformers' mask builder that carries a sliding window. A packed row has no mask, so an attention
# layer of a model that builds it must hand the window to the attention function (``sliding_window=``)
# or be a "sliding_attention" layer of ``config.layer_types`` (nopad_varlen reads that window itself)
_WINDOW_MASK = "create_sliding_window_causal_mask"


def _builds_window_mask(model: torch.nn.Module) -> bool:
    """Whether some module of ``model`` builds transformers' sliding-window mask (its decoder's forward)."""
    classes = {type(m) for m in model.modules()}
    return any(_WINDOW_MASK in names_read(inspect.unwrap(fn).__code__) for cls in classes for _, fn in _methods(cls))


def _mentions(code: types.CodeType, name: str) -> bool:
    """Whether ``code`` (or a function defined inside it) reads ``name`` or passes it as a keyword."""
    return any(
        name in inner.co_names
        or any(const == name or (isinstance(const, tuple) and name in const) for const in inner.co_consts)
        for inner in _codes(code)
    )


def _passes_window(cls: type) -> bool:
    """Whether the class's code that calls the attention interface hands it a ``sliding_window``."""
    for _, method in _methods(cls):
        code = inspect.unwrap(method).__code__
        if "ALL_ATTENTION_FUNCTIONS" in names_read(code) and _mentions(code, "sliding_window"):
            return True
    return False


def _dropped_window(module: torch.nn.Module) -> str | None:
    """Why the sliding window of this attention module (of a model that builds a sliding-window mask)
    would be dropped inside each sequence of a packed row, or None. Dropped: a window that bites, not
    handed to the attention function and not named by the layer's type (PhiMoE's, one window for
    every layer, applied through the mask only)."""
    config = getattr(module, "config", None)
    window, longest = getattr(config, "sliding_window", None), getattr(config, "max_position_embeddings", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0 or _passes_window(type(module)):
        return None
    if isinstance(longest, int) and window >= longest:
        return None  # no sequence the model takes is longer than its window: dropping it changes nothing
    kinds, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if kinds and (isinstance(index, int) and 0 <= index < len(kinds) or "sliding_attention" not in kinds):
        return None  # its layer's type says: nopad_varlen gives a "sliding_attention" layer its window
    return (
        f"applies the model's {window}-token sliding window only through the attention mask (its call to "
        "the attention interface passes no sliding_window=), and a packed row has no mask: each sequence "
        "would attend past its window"
    )


def _reads_positions(model: torch.nn.Module) -> bool:
    """Whether the packed row's ``position_ids`` reach the model's layers: some module past the
    embeddings (the model, its decoder, a layer) takes them. Where only a positional embedding takes
    them, the model derives its positions from the row's length instead (BART-style decoders)."""
    return any(
        takes_keyword(module.forward, "position_ids", any_keyword=False)
        for name, module in model.named_modules()
        if not _TOWER.search(name) and "Embedding" not in type(module).__name__
    )


# ---- the route -------------------------------------------------------------------------------------


class Route:
    """One model's packed routing: its layers' rebound methods and its root hooks. :meth:`remove` undoes it."""

    def __init__(self, model: torch.nn.Module, found: Survey) -> None:
        self.model = weakref.ref(model)
        self.survey = found
        self._patched: list[tuple[torch.nn.Module, str, Any]] = []
        names = {name for name, _ in found.rebound}
        registered = {name for name, _ in found.registered}
        shaped_510: list[str] = []
        for name, module in model.named_modules():
            form = registered_form(type(module)) if name in registered else None
            if form is not None:
                self._patch(module, "forward", RegisteredForward(module.forward, type(module).__name__, module, form))
            elif name in names:
                for method, fn in _rebound_methods(type(module)).items():
                    self._patch(module, method, types.MethodType(fn, module))
                shaped = _shaped_510(module)
                for owner, attribute, value in shaped:
                    self._patch(owner, attribute, value)
                if shaped:
                    shaped_510.append(name)
        for carrier in _carriers_510(model, shaped_510):
            self._patch(carrier, "forward", _row_forward(carrier))
        self.removed = False
        mark = weakref.ref(self)  # weak: the model holds its route, never the other way round
        for module in model.modules():  # the layers that read a config (attention among them): see routed
            if getattr(module, "config", None) is not None:
                remember(module, "routed by", mark)
        self._hooks = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, always_call=True),
        ]
        self._tokens: list[Any] = []
        # read now, not at the first forward: a compiled forward that kept them on the model would
        # change what its graph was guarded on (one recompile)
        for name in ("use_cache", "cu_seq_lens_q"):
            _takes(model, name)

    def _patch(self, module: torch.nn.Module, name: str, value: Any) -> None:
        self._patched.append((module, name, module.__dict__.get(name, _MISSING)))
        setattr(module, name, value)

    def remove(self) -> None:
        self.removed = True
        for hook in self._hooks:
            hook.remove()
        for module, name, own in reversed(self._patched):
            if own is _MISSING:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, own)
        self._patched.clear()
        model = self.model()
        if model is not None and recall(model, "route") is self:
            remember(model, "route", None)

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        boundaries = _row_boundaries(args, kwargs)
        owner = type(module).__name__
        forward = None
        if boundaries is not None:
            cu, longest = boundaries
            forward = _Forward(owner, cu, kwargs.get(SP_GROUP_KWARG), checkpointed(module), longest or None)
        # under torch.compile on a list dynamo traces, not the context variable (see _RowState)
        self._tokens.append(_PACKED_FORWARD.set(forward))
        if boundaries is None:
            return None
        kwargs = _without_cache(kwargs, owner, _takes(module, "use_cache"))
        if "cu_seq_lens_q" not in kwargs and _takes(module, "cu_seq_lens_q"):
            # found from the position ids: every layer gets them as kwargs (a forward that takes no such
            # kwargs leaves its layers to the forward's row, which _packed_call falls back to)
            cu, longest = boundaries
            kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return args, kwargs

    def _after(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._tokens:
            _PACKED_FORWARD.reset(self._tokens.pop())


def checkpointed(model: torch.nn.Module) -> bool:
    """Whether some layer of ``model`` recomputes its forward in backward (activation checkpointing)."""
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else ""
    if getattr(model, flag or "is_gradient_checkpointing", False):
        return True
    return any(_checkpoints(m) for m in model.modules())


_MISSING = object()


def routed(module: Any) -> bool:
    """Whether ``module`` (or the module a view stands for: its memo is read through the view) is a
    layer of a model given to :func:`route`, not removed since: its attention is reached by routed
    forwards (and by the recomputations of checkpointed layers, which run outside any forward).
    Kept on the layer (nopad.core._memo), so a layer freed and another made at its address is not."""
    mark = recall(module, "routed by")
    found = None if mark is None else mark()
    return found is not None and not found.removed


def _without_cache(kwargs: dict, owner: str, takes_it: bool) -> dict:
    """A packed forward builds no cache: ``use_cache`` left at None would make transformers start one."""
    use_cache = kwargs.get("use_cache")
    if use_cache:
        raise input_error(
            f"{owner} use_cache",
            None,
            "False or None in a packed forward (a cache across packed sequences would mix them)",
            repr(use_cache),
        )
    return {**kwargs, "use_cache": False} if takes_it or "use_cache" in kwargs else dict(kwargs)


def _takes(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module``'s forward takes the keyword ``name`` (or any keyword). Read once per module."""
    return memo(module, ("takes", name), lambda: takes_keyword(module.forward, name))


def _row_boundaries(args: tuple, kwargs: dict) -> tuple[Tensor, int] | None:
    """(cu_seqlens int32, longest) of a packed forward, or None for one that is not packed.

    Packed: boundaries given (``cu_seq_lens_q``), or no attention mask and position ids that
    restart inside a row (transformers' own packed convention; one host sync per new position-ids
    tensor). A padded forward (attention mask), a plain batch and a cached forward are not packed.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return cu, int(kwargs.get("max_length_q") or 0)
    if any(kwargs.get(name) is not None for name in ("attention_mask", "past_key_values", "cache")):
        return None
    positions = kwargs.get("position_ids")
    if not isinstance(positions, Tensor) or positions.dim() not in (2, 3):
        return None
    text = positions[0] if positions.dim() == 3 else positions  # (B, T); mrope's row 0 is the text position
    # kept on the tensor: the layers of one forward, and the forwards that reuse it, share one derivation
    plan = memo(text, "position_plan", lambda: IndexPlan.from_position_ids(text))
    if plan.batch_size == text.shape[0]:  # one sequence per row: nothing to keep apart
        return None
    cu = plan.cu_seqlens
    lengths = known_host_lengths(plan.offsets)
    if lengths is not None:
        remember_host_lengths(cu, lengths)
    return cu, plan.max_seqlen


def route(model: torch.nn.Module) -> Route:
    """Give every state-carrying layer of ``model`` its packed form and hook its forward (idempotent).

    Refuses (ValueError, before any change) a model with a position-mixing module nopad cannot keep
    apart: see :func:`survey`. The attention implementation is the caller's to switch
    (:func:`nopad.modeling._attention.use_packed_attention` does both).
    """
    existing = route_of(model)
    if existing is not None:
        return existing
    found = survey(model)
    error = found.error(model)
    if error is not None:
        raise error
    return remember(model, "route", Route(model, found))  # kept on the model (nopad.core._memo)


def route_of(model: torch.nn.Module) -> Route | None:
    """The route of ``model`` made by :func:`route` and not removed since, else None."""
    return recall(model, "route")
