"""Attention over the shared-prefix layout: a completion attends to its prompt and its own earlier
tokens, never to a sibling; a prompt attends causally to itself.

Registered with transformers as ``"nopad_shared"`` (``AttentionInterface``; ``AttentionMaskInterface``
so that no dense mask is built). The plan (:class:`nopad.batches._prefixes.SharedPrefixPlan`, made by
``plan_shared_prefixes``) travels in the forward's kwargs under ``shared_prefixes``, as flash
attention's ``cu_seq_lens_q`` do, so it reaches every layer (and a checkpointed layer's recompute).

Which of the two exact formulations, and why: a key/value gather. Each row's keys and values are its
group's prompt's followed by its own completion's (``plan.kv_index``), and its queries (its block)
are aligned at the end of them, so one causal varlen call with ``cu_seqlens_q != cu_seqlens_k``
computes it. Cascade attention (the prompt's part and the completion's part in two calls, merged
by their log-sum-exp) avoids the gather's copy of the prompt's keys per completion, but training
needs the gradient through the log-sum-exp, which the varlen flash kernels do not return; the
gather's backward is the index_add of the gradients into the one prompt, which is also exactly the
sum n separate rows would give. The copy is keys and values only (heads_kv x head_dim per token).

Which kernel runs where: nopad_varlen's choice (:func:`nopad.modeling._attention.select_kernel`,
the same order, availability and refusals). On CUDA at fp16/bf16, "auto" takes the first of
flash_attn, aten_flash, varlen_attn that runs and honours the layer's window
(:func:`gathered_attention`: the keys and values gathered, then ONE varlen call with the queries'
boundaries ``plan.cu_seqlens_q`` and the gathered keys' ``plan.cu_seqlens_k``; the flash kernels
align the causal mask and the window at the bottom right when seqlen_q != seqlen_k, so HF's window
is the same (window - 1, 0) as for a row alone). Everywhere else (the CPU, fp32, a window the
installed kernels cannot slide) the exact tiled path runs (:func:`tiled_attention`): the queries
cut into tiles of ``plan.tile``, each tile with its row's keys up to its last query, one batched
sdpa over all tiles with a (tiles, C, max_k) mask; its cost grows with tiles x max_k, not with
T x T as a dense mask's does. Both are a fixed number of ops whatever the number of rows. A kernel
is forced as nopad_varlen's is, by the implementation name (``nopad_shared_fa``, ``_aten``,
``_torch``; ``_tiled`` for the tiled path; ``use_shared_prefix_attention(model, kernel)``), and a
forced kernel that cannot run or cannot honour a need is a ValueError naming it, never a silent
fallback. A model forced to one of nopad_varlen's kernels keeps it for its shared-prefix forwards.
Soft-capping, dropout and attention sinks are refused on every path (the tiled path has none).

Layers that carry state along the sequence continue each completion from its prompt's final state:
the causal conv (LFM2's short conv, the conv inside a gated delta net or a Mamba2 mixer) reads the
prompt's last K - 1 inputs, the gated delta rule and Mamba2's SSD scan start from the prompt's final
recurrent state. transformers' primitives are served by nopad's adapters (:mod:`nopad.modeling._routing`,
routed as for a packed forward); the shared-prefix mode reaches them through the row they already
receive: a root pre-hook hands the layers boundaries (``cu_seq_lens_q``) whose packed row is a
:class:`nopad.modeling._layers.SharedPrefixRow` made from the plan (one host sync per plan), and the
packed forms in :mod:`nopad.modeling._layers` run the shared-prefix form for such a row: the prompts
as one packed row (final state per prompt), then the completions as another, each from its
prompt's state (a gather; its backward sums every completion's gradient into the one prompt). A
fixed number of ops whatever the number of groups. transformers 5.10's layer shapes (verl 0.9.1's pin:
primitives kept as a gated delta net's attributes, or read by a Mamba2 / LFM2 mixer's
``cuda_kernels_forward``) are served the same way: the route gives them adapters that read the row
from the same boundaries (handed down by the modules on the way to the layer), so they take the
shared-prefix form too; their primitives are checked as the module-level ones are. Any other state
layer (Kimi delta attention, Mamba's selective scan in either shape, a registered packed form) is
refused by :func:`use_shared_prefix_attention`, naming the layer's class, before anything runs.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nopad.core._batch import takes_keyword
from nopad.core._errors import check_int, input_error
from nopad.core._layout import device_to_host
from nopad.core._memo import memo, recall, remember
from nopad.modeling._attention import KERNELS, Needs, forced_kernel, kernel_for, mask_window, run_kernel
from nopad.modeling._layers import SharedPrefixRow
from nopad.modeling._routing import ADAPTERS, callee, names_read, packed_row_of, primitives_510, route, survey
from nopad.parallel._ulysses import SP_GROUP_KWARG, set_attn_implementation

IMPLEMENTATION = "nopad_shared"
# a forced kernel's implementation name, as nopad_varlen's (no "flash" in it: transformers would take
# it for flash-attn's); "sdpa", nopad_varlen's exact fallback, is the exact tiled path here
_IMPLEMENTATION_OF = {
    "auto": IMPLEMENTATION,
    "flash_attn": IMPLEMENTATION + "_fa",
    "varlen_attn": IMPLEMENTATION + "_torch",
    "aten_flash": IMPLEMENTATION + "_aten",
    "sdpa": IMPLEMENTATION + "_tiled",
}
_KERNEL_OF = {name: kernel for kernel, name in _IMPLEMENTATION_OF.items()}
PLAN_KWARG = "shared_prefixes"
_CHECKED = "shared prefixes checked"
_HOOKED = "shared prefixes hooked"
# the layer kinds of transformers' ``config.layer_types`` this attention serves; any other (Llama 4's
# chunked attention) is refused rather than run as full attention. The state layers' kinds are served
# by their layers' packed forms (each layer's primitives checked below). transformers 5.10 names some
# models' kinds "attention" (full attention) and "mamba" (a Mamba mixer, its primitives checked as above)
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "conv", "attention", "mamba")
# transformers' primitives whose packed forms take a shared-prefix row (the fused Mamba2 kernel's
# adapter sends a packed forward down the layer's unfused conv and scan)
SERVED_PRIMITIVES = (
    "causal_conv1d_fn",
    "chunk_gated_delta_rule",
    "mamba_chunk_scan_combined",
    "mamba_split_conv1d_scan_combined",
)


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, plan: Any, *, scale: float, window: int | None = None) -> Tensor:
    """(T, H, D) packed queries, (T, H_kv, D) keys / values -> (T, H, D) attention over the plan.

    Each query slot of a tile sees its row's first ``tile_end`` keys (its prompt, then its own
    completion up to itself); with ``window``, only the last ``window`` of them (HF's sliding
    window: the token and window - 1 before it). Empty slots see one key and are dropped."""
    total, heads, dim = q.shape
    tiles, tile, width = plan.tiles, plan.tile, plan.max_seqlen_k
    pad_q, pad_k, pad_v = (F.pad(t, (0, 0, 0, 0, 0, 1)) for t in (q, k, v))  # row T: an empty slot
    q_t = pad_q.index_select(0, plan.tile_q).view(tiles, tile, heads, dim).transpose(1, 2)
    k_t, v_t = (t.index_select(0, plan.tile_k).view(tiles, width, -1, dim).transpose(1, 2) for t in (pad_k, pad_v))
    key = torch.arange(width, device=q.device)
    end = plan.tile_end.unsqueeze(-1)  # (tiles, C, 1)
    allowed = key < end
    if window is not None:
        allowed &= key >= end - window
    out = F.scaled_dot_product_attention(
        q_t, k_t, v_t, attn_mask=allowed.unsqueeze(1), scale=scale, enable_gqa=k.shape[1] != heads
    )
    return out.transpose(1, 2).reshape(tiles * tile, heads, dim).index_select(0, plan.tile_out)


def gathered_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: Any, *, kernel: str, scale: float, needs: Needs
) -> Tensor:
    """(T, H, D) packed queries, (T, H_kv, D) keys / values -> (T, H, D) attention over the plan,
    through ONE call of a flash ``kernel`` (nopad_varlen's call, :func:`run_kernel`).

    Each row's keys and values are gathered (``plan.kv_index``: its prompt's, then its own
    completion's), segments ``plan.cu_seqlens_k``; its queries, segments ``plan.cu_seqlens_q``, are
    the last of those positions (the whole row for a group's first row, the completion for the
    others). Causal masks and windows align at the bottom right when seqlen_q != seqlen_k in
    flash-attn >= 2.1 (flash_attn_varlen_func's docstring, Dao-AILab/flash-attention,
    flash_attn/flash_attn_interface.py: "If causal=True, the causal mask is aligned to the bottom
    right corner of the attention matrix", the window [i + seqlen_k - seqlen_q - window_size[0],
    i + seqlen_k - seqlen_q + window_size[1]]) and in torch's bundled copy of that kernel (why torch's
    sdpa refuses is_causal for seqlen_q != seqlen_k on it: pytorch/pytorch#111007), so each query
    sees its row's keys up to itself, and with a window the same (window - 1, 0) as in a row alone.
    A completion that is empty is a segment of no queries. The gather's backward adds each row's
    key gradients into the one prompt."""
    k_rows, v_rows = (t.index_select(0, plan.kv_index) for t in (k, v))
    return run_kernel(
        kernel,
        q,
        k_rows,
        v_rows,
        plan.cu_seqlens_q,
        plan.max_seqlen_q,
        scale=scale,
        needs=needs,
        cu_seqlens_k=plan.cu_seqlens_k,
        max_seqlen_k=plan.max_seqlen_k,
    )


def _requested_kernel(module: torch.nn.Module) -> str:
    """The kernel ``module``'s implementation name forces, or 'auto'."""
    name = getattr(getattr(module, "config", None), "_attn_implementation", None) or IMPLEMENTATION
    return _KERNEL_OF.get(name, "auto")


def shared_prefix_attention(
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
    """HF attention function: (1, H, T, D) queries, (1, H_kv, T, D) keys/values over the shared-prefix
    layout -> (1, T, H, D), None. The plan comes from the kwargs (``shared_prefixes=``)."""
    owner = type(module).__name__
    plan = kwargs.get(PLAN_KWARG)
    if not recall(module, _CHECKED):
        raise input_error(
            f"{owner} attention",
            None,
            "a model given to use_shared_prefix_attention(model) first (it refuses layers that carry "
            "state along the sequence)",
            f"{IMPLEMENTATION} set on a model it has not checked",
        )
    if plan is None or not hasattr(plan, "tile_out"):
        got = "no plan" if plan is None else type(plan).__name__
        raise input_error(PLAN_KWARG, None, "the shared-prefix plan of the packed row, in the forward's kwargs", got)
    B, H, T, D = query.shape
    if B != 1 or T != plan.total or key.shape[2] != T:
        raise input_error(
            f"{owner} query",
            None,
            f"the plan's packed row, (1, heads, {plan.total}, dim) queries and keys (no KV cache)",
            f"queries {tuple(query.shape)}, keys {tuple(key.shape)}",
        )
    for name, given in (("attention_mask", attention_mask), ("s_aux", kwargs.get("s_aux"))):
        if given is not None:
            raise input_error(f"{owner} {name}", None, "None (the plan keeps the rows apart)", "a tensor")
    if softcap is not None or dropout > 0:
        feature = "soft-capping" if softcap is not None else "attention dropout"
        raise input_error(f"{owner} attention", None, "no soft-capping and no dropout", f"{feature}")
    if sliding_window is None:  # a layer whose window only transformers' mask carries (Qwen2-MoE)
        sliding_window = mask_window(module)
    if sliding_window is not None:  # a flash kernel reads a window of 0 as none: refused for every path
        sliding_window = check_int(sliding_window, "sliding_window", low=1)
    # a window no row outgrows changes nothing: no need to ask a kernel for it
    window = sliding_window if sliding_window is not None and sliding_window < plan.max_seqlen_k else None
    needs = Needs(gqa=key.shape[1] != H, window=window)
    fields = (needs.gqa, needs.causal, needs.window, needs.dropout, needs.softcap, needs.sinks)
    kernel = kernel_for(_requested_kernel(module), query.device.type, query.dtype, *fields)
    scale = D**-0.5 if scaling is None else scaling
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D) views
    if kernel == "sdpa":  # no flash kernel here (the CPU, fp32, a need refused): the exact tiled path
        out = tiled_attention(q, k, v, plan, scale=scale, window=window)
    else:
        out = gathered_attention(q, k, v, plan, kernel=kernel, scale=scale, needs=needs)
    return out.unsqueeze(0), None


def shared_prefix_row(plan: Any) -> SharedPrefixRow:
    """The :class:`SharedPrefixRow` of ``plan`` (its blocks' prompt parts and completions), made once
    per plan (kept on ``plan.pack_index``) with one host sync, and kept as the packed row of its own
    boundaries (``row.cu_seqlens``), so the adapters' ``packed_row_of(cu_seq_lens_q)`` finds it."""

    def make() -> SharedPrefixRow:
        order = plan.block_order
        leads = plan.leader == torch.arange(plan.rows, device=order.device)
        parts = torch.stack(
            [(plan.prompt_lengths * leads).index_select(0, order), plan.completion_lengths.index_select(0, order)]
        )
        prompt_parts, completions = device_to_host(parts)
        row = SharedPrefixRow(prompt_parts, completions, order.device)
        remember(row.cu_seqlens, "packed_row", row)  # what packed_row_of reads (checked next)
        assert packed_row_of(row.cu_seqlens) is row, "the routing no longer reads the row kept on its boundaries"
        return row

    return memo(plan.pack_index, "shared prefix row", make)


def _hand_row(module: torch.nn.Module, args: tuple, kwargs: dict, *, stateful: bool) -> tuple[tuple, dict] | None:
    """Root pre-hook (before the routing's): a forward given ``shared_prefixes=plan`` gets the plan's
    position ids where none were given and, for a model with state layers (``stateful``), hands its
    layers the boundaries of the plan's :class:`SharedPrefixRow`, so each runs its shared-prefix form."""
    plan = kwargs.get(PLAN_KWARG)
    if plan is None:
        return None
    owner = type(module).__name__
    if not hasattr(plan, "tile_out"):
        raise input_error(PLAN_KWARG, None, "the shared-prefix plan of the packed row", type(plan).__name__)
    if kwargs.get("position_ids") is None:
        kwargs = {**kwargs, "position_ids": plan.position_ids[None]}
    if not stateful:
        return args, kwargs
    group = kwargs.get(SP_GROUP_KWARG)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        raise input_error(
            f"{owner} {SP_GROUP_KWARG}", None, "no sequence parallelism with shared prefixes", "an SP group"
        )
    row = shared_prefix_row(plan)
    given = kwargs.get("cu_seq_lens_q")
    if given is not None and given is not row.cu_seqlens:
        raise input_error(
            f"{owner} cu_seq_lens_q", None, "None with shared_prefixes (the plan gives the boundaries)", "a tensor"
        )
    longest = int(row.lengths.max()) if len(row.lengths) else 0
    cu = row.cu_seqlens
    kwargs = {**kwargs, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    return args, kwargs


_ADAPTED: dict[type, frozenset[str]] = {}


def _adapted_primitives(cls: type) -> frozenset[str]:
    """The primitives with nopad adapters that the methods of ``cls`` (a transformers layer class) reach,
    through transformers' helpers, by kernel name (as the routing finds them). Once per class."""
    if cls in _ADAPTED:
        return _ADAPTED[cls]
    found: set[str] = set()
    seen: set[Any] = set()

    def walk(fn: Any) -> None:
        fn = inspect.unwrap(fn)
        if fn in seen or not inspect.isfunction(fn):
            return
        seen.add(fn)
        for name in names_read(fn.__code__):
            what = callee(fn.__globals__.get(name))
            if what is None:
                continue
            if what.name in ADAPTERS:
                found.add(what.name)
            elif what.function is not None and (what.function.__module__ or "").startswith("transformers.models."):
                walk(what.function)

    for klass in cls.__mro__:
        if klass.__module__.startswith("transformers.models."):
            for value in vars(klass).values():
                walk(value)
    _ADAPTED[cls] = frozenset(found)
    return _ADAPTED[cls]


def _unserved_state_layers(model: torch.nn.Module, found: Any) -> list[str]:
    """The state layers of ``model`` (from its survey) whose packed forms take no shared-prefix row:
    each as "Class (why)"."""
    why: dict[str, str] = {}
    for _, cls in found.registered:
        why.setdefault(cls, "a packed form registered with register_packed_module, which takes no prompt's state")
    for name, cls_name in found.rebound:
        cls = type(model.get_submodule(name))
        # transformers 5.10's shapes: the primitives its route serves the layer with (their adapters read
        # the same row, so a shared-prefix row reaches them as it does the module-level ones)
        reached = _adapted_primitives(cls) | set(primitives_510(cls))
        unserved = sorted(reached - set(SERVED_PRIMITIVES))
        if unserved or not reached:  # none found: a shape of the layer not read here
            because = f"its {unserved} take" if unserved else "its primitives (none found) take"
            why.setdefault(cls_name, f"{because} no prompt's final state")
    return [f"{cls} ({reason})" for cls, reason in why.items()]


@functools.cache
def register() -> None:
    """Register ``nopad_shared`` with transformers' attention and mask interfaces. Once."""
    modeling_utils = importlib.import_module("transformers.modeling_utils")
    masking_utils = importlib.import_module("transformers.masking_utils")
    builder = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]  # None without a padding mask
    for name in _IMPLEMENTATION_OF.values():
        modeling_utils.AttentionInterface.register(name, shared_prefix_attention)
        masking_utils.AttentionMaskInterface.register(name, builder)


def shared_implementation(kernel: str = "auto") -> str:
    """The attention implementation name of the shared-prefix attention with ``kernel`` ('auto' or
    one of nopad_varlen's kernels, 'sdpa' meaning the exact tiled path); a ValueError otherwise."""
    if kernel not in _IMPLEMENTATION_OF:
        raise input_error("kernel", None, f"'auto' or one of {list(KERNELS)}", repr(kernel))
    return _IMPLEMENTATION_OF[kernel]


def kernel_of_implementation(name: str | None) -> str:
    """The kernel an implementation name forces (the shared-prefix attention's or nopad_varlen's:
    a model forced to a kernel keeps it for its shared-prefix forwards), or 'auto'."""
    return _KERNEL_OF.get(name or "") or forced_kernel(name)


def use_shared_prefix_attention(model: torch.nn.Module, kernel: str = "auto") -> torch.nn.Module:
    """Switch ``model``'s attention to ``nopad_shared`` after checking every position-mixing layer is
    softmax attention through transformers' interface. A layer that carries state along the sequence,
    a registered packed form or a module nopad cannot keep apart is a ValueError naming its class,
    and nothing is changed. ``kernel``: as nopad_varlen's, 'auto' (the first flash kernel that runs
    on the device and dtype and honours the layer's window, else the exact tiled path) or one
    forced (a ValueError now if it cannot run on the model's device and dtype; at the first forward
    if it cannot honour a layer's window). Returns the model."""
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(config, "_attn_implementation"):
        expected = "a transformers model (a module with a config naming its attention)"
        raise input_error("model", None, expected, type(model).__name__)
    implementation = shared_implementation(kernel)
    if kernel != "auto":
        param = next(model.parameters(), None)
        device_type, dtype = ("cpu", torch.float32) if param is None else (param.device.type, param.dtype)
        kernel_for(kernel, device_type, dtype)  # a kernel that cannot run here: its ValueError, nothing changed
    found = survey(model)
    error = found.error(model)
    if error is not None:
        raise error
    unserved_layers = _unserved_state_layers(model, found)
    if unserved_layers:
        raise input_error(
            "model",
            None,
            "a model whose position-mixing layers are softmax attention, causal convs, gated delta rules "
            "or Mamba2 scans (their packed forms carry a prompt's final state into its completions)",
            f"{type(model).__name__}, whose {'; '.join(unserved_layers)}",
        )
    stateful = bool(found.rebound)
    if stateful and not takes_keyword(model.forward, "cu_seq_lens_q"):
        raise input_error(
            "model",
            None,
            "a model whose forward takes the packed row's boundaries (cu_seq_lens_q) for its state layers",
            f"{type(model).__name__}.forward, which does not",
        )
    unserved = sorted({t for t in getattr(config, "layer_types", None) or [] if t not in SERVED_LAYER_TYPES})
    if unserved:
        raise input_error(
            "model", None, f"layers of the types {list(SERVED_LAYER_TYPES)}", f"{type(model).__name__}'s {unserved}"
        )
    for name, _ in found.attention:
        remember(model.get_submodule(name), _CHECKED, True)
    register()
    if stateful:
        route(model)  # the state layers' primitives served by the adapters, as in a packed forward
    if recall(model, _HOOKED) is None:  # before the routing's own pre-hook: it reads the boundaries
        hook = functools.partial(_hand_row, stateful=stateful)
        remember(model, _HOOKED, model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
    set_attn_implementation(model, implementation)
    return model
