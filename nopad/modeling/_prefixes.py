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

The exact path here runs on any device and dtype: the queries cut into tiles of ``plan.tile``, each
tile with its row's keys up to its last query, one batched sdpa over all tiles with a (tiles, C,
max_k) mask. A fixed number of ops whatever the number of rows; its cost grows with tiles x max_k,
not with T x T as a dense mask's does.

Layers that carry state along the sequence (gated delta nets, Mamba2 scans, convs) would have to
continue each completion from its prompt's final state: not served yet, so a model with such a
layer is refused by :func:`use_shared_prefix_attention`, naming the layer's class.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from nopad.core._errors import input_error
from nopad.core._memo import recall, remember
from nopad.modeling._attention import mask_window
from nopad.modeling._routing import survey
from nopad.parallel._ulysses import set_attn_implementation

IMPLEMENTATION = "nopad_shared"
PLAN_KWARG = "shared_prefixes"
_CHECKED = "shared prefixes checked"
# the layer kinds of transformers' ``config.layer_types`` this attention serves; any other (Llama 4's
# chunked attention, a linear attention) is refused rather than run as full attention
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")


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
    scale = D**-0.5 if scaling is None else scaling
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D) views
    out = tiled_attention(q, k, v, plan, scale=scale, window=sliding_window)
    return out.unsqueeze(0), None


@functools.cache
def register() -> None:
    """Register ``nopad_shared`` with transformers' attention and mask interfaces. Once."""
    modeling_utils = importlib.import_module("transformers.modeling_utils")
    masking_utils = importlib.import_module("transformers.masking_utils")
    modeling_utils.AttentionInterface.register(IMPLEMENTATION, shared_prefix_attention)
    builder = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]  # None without a padding mask
    masking_utils.AttentionMaskInterface.register(IMPLEMENTATION, builder)


def use_shared_prefix_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model``'s attention to ``nopad_shared`` after checking every position-mixing layer is
    softmax attention through transformers' interface. A layer that carries state along the sequence,
    a registered packed form or a module nopad cannot keep apart is a ValueError naming its class,
    and nothing is changed. Returns the model."""
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(config, "_attn_implementation"):
        expected = "a transformers model (a module with a config naming its attention)"
        raise input_error("model", None, expected, type(model).__name__)
    found = survey(model)
    error = found.error(model)
    if error is not None:
        raise error
    stateful = found.rebound + found.registered
    if stateful:
        classes = sorted({cls for _, cls in stateful})
        raise input_error(
            "model",
            None,
            "a model whose every position-mixing layer is softmax attention (shared prefixes do not yet "
            "carry a prompt's final state into its completions)",
            f"{type(model).__name__}, whose {classes} layers carry state along the sequence",
        )
    unserved = sorted({t for t in getattr(config, "layer_types", None) or [] if t not in SERVED_LAYER_TYPES})
    if unserved:
        raise input_error(
            "model", None, f"layers of the types {list(SERVED_LAYER_TYPES)}", f"{type(model).__name__}'s {unserved}"
        )
    for name, _ in found.attention:
        remember(model.get_submodule(name), _CHECKED, True)
    register()
    set_attn_implementation(model, IMPLEMENTATION)
    return model
