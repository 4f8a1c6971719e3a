"""Ulysses sequence parallelism for a packed row: index math, autograd collectives, attention wrapper.

The packed row of ``T`` tokens is padded to ``T_pad``, a multiple of the SP size ``W``; rank ``r``
holds tokens ``[r * T_pad / W, (r + 1) * T_pad / W)``. Around attention an all-to-all swaps the
sharded dimension: every rank then sees the WHOLE row for ``H / W`` of the heads, so attention
keeps its sequence boundaries exactly as on one process. After the model, the per-token outputs
are all-gathered and the pad is stripped.

Every collective here is one call over the whole tensor (no loop over ranks) and is an autograd
Function. ``group`` is always an explicit argument; nothing is read from a global.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nopad.core._batch import check_transformers_model
from nopad.core._errors import check_int, input_error
from nopad.core._layout import block_causal_mask, round_up
from nopad.core._memo import recall, remember

ULYSSES_PREFIX = "nopad_ulysses_"
SP_GROUP_KWARG = "nopad_sp_group"

# ---- index math (pure arithmetic, no sync) -------------------------------------------------


def padded_length(total: int, sp_size: int = 1, pad_to_multiple: int | None = None) -> int:
    """Smallest row length >= ``total`` divisible by both ``sp_size`` and ``pad_to_multiple`` (>= 1 each)."""
    pad_to_multiple = 1 if pad_to_multiple is None else check_int(pad_to_multiple, "pad_to_multiple", low=1)
    total, sp_size = check_int(total, "total", low=0), check_int(sp_size, "sp_size", low=1)
    return round_up(total, math.lcm(sp_size, pad_to_multiple))


def local_range(padded_total: int, sp_size: int, sp_rank: int) -> tuple[int, int]:
    """[start, stop) of rank ``sp_rank``'s slice of a row of ``padded_total`` tokens."""
    if padded_total % sp_size:
        raise input_error("padded_total", None, f"a multiple of sp_size {sp_size}", f"{padded_total}")
    if not 0 <= sp_rank < sp_size:
        raise input_error("sp_rank", None, f"0 <= rank < {sp_size}", f"{sp_rank}")
    local = padded_total // sp_size
    return sp_rank * local, (sp_rank + 1) * local


def slice_for_rank(x: Tensor, sp_size: int, sp_rank: int, dim: int = -1) -> Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (whose size must divide by ``sp_size``)."""
    if not isinstance(x, Tensor) or getattr(x, "is_nested", False) or x.dim() == 0:
        got = type(x).__name__ if not isinstance(x, Tensor) else "a nested tensor" if x.is_nested else "a 0-d tensor"
        raise input_error("x", None, "a dense tensor with the dim to slice", got)
    sp_size = check_int(sp_size, "sp_size", low=1)
    sp_rank = check_int(sp_rank, "sp_rank", low=0)
    dim = check_int(dim, "dim", low=-x.dim(), high=x.dim() - 1)
    start, stop = local_range(x.shape[dim], sp_size, sp_rank)
    return x.narrow(dim, start, stop - start)


# ---- autograd collectives -------------------------------------------------------------------


def _all_to_all(x: Tensor, group, scatter_dim: int, gather_dim: int) -> Tensor:
    world = dist.get_world_size(group)
    # Rank-major layout: chunk r of the scatter dim goes to rank r, in one all_to_all_single call.
    # After moving the rank axis to the front, original dim d sits at d + 1.
    chunks = x.unflatten(scatter_dim, (world, x.shape[scatter_dim] // world)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    # received[r] is rank r's piece of the gather dim: put the rank axis just before it and merge.
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: Tensor, group, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split ``x`` along ``scatter_dim`` across the group and concatenate what arrives along ``gather_dim``.

    (…, S_local, …, H, …) -> (…, S_local * W, …, H / W, …). Its backward is the reverse all-to-all.
    Both dims must be non-negative; ``x.shape[scatter_dim]`` must divide by the group size.
    """
    if scatter_dim < 0 or gather_dim < 0 or scatter_dim == gather_dim:
        raise input_error("scatter_dim/gather_dim", None, "two distinct dims >= 0", f"{scatter_dim}/{gather_dim}")
    world = dist.get_world_size(group)
    if x.shape[scatter_dim] % world:
        raise input_error(
            "tensor",
            None,
            f"dim {scatter_dim} divisible by the group size {world}",
            f"shape {tuple(x.shape)}",
        )
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


# torch 2.13 renamed the tensor collectives; older releases only have the *_tensor names.
_all_gather_rows = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_rows = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        rows = x.movedim(dim, 0).contiguous()  # rank-major along dim 0
        out = rows.new_empty((dist.get_world_size(group) * rows.shape[0], *rows.shape[1:]))
        _all_gather_rows(out, rows, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        # d(sum over ranks of each rank's loss) / d(local slice) = that slice of the grads, summed over ranks.
        rows = grad.movedim(ctx.dim, 0).contiguous()
        out = rows.new_empty((rows.shape[0] // dist.get_world_size(ctx.group), *rows.shape[1:]))
        _reduce_scatter_rows(out, rows, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def gather_seq(x: Tensor, group, dim: int = -1) -> Tensor:
    """All-gather equal local slices along ``dim`` (rank order): (…, L, …) -> (…, L * W, …).

    Backward is the true derivative of the SUM of every rank's loss: the gathered gradients are
    summed over the group and each rank keeps its slice. When every SP rank computes the same loss
    from the gathered tensor, the per-rank parameter gradients therefore sum to W times the
    one-process gradient; averaging gradients over the SP ranks (as FSDP does over its ranks)
    gives the one-process gradient back.
    """
    return _GatherSeq.apply(x, group, dim % x.dim())


# ---- attention wrapper ----------------------------------------------------------------------


class _AttributeView:
    """``target`` with some attributes overridden; everything else is read from ``target``."""

    def __init__(self, target: Any, **overrides: Any):
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def _heads_view(module: torch.nn.Module, num_key_value_groups: int, base: str) -> Any:
    """The attention module as the base kernel should see it after the head all-to-all.

    Its config names the base implementation: HF's flash path picks its kernel from
    ``module.config._attn_implementation``, which on the real module names the wrapper.
    """
    config = _AttributeView(module.config, _attn_implementation=base)
    return _AttributeView(module, num_key_value_groups=num_key_value_groups, config=config)


def repeat_heads(x: Tensor, times: int, dim: int = 1) -> Tensor:
    """Each key/value head ``times`` times along ``dim``, as grouped-query attention pairs them with
    query heads (a copy; ``times == 1`` returns ``x``)."""
    return x if times == 1 else x.repeat_interleave(times, dim=dim)


def ulysses_attention(base: str):
    """An HF attention function that runs ``base`` ('sdpa', 'eager', 'flash_attention_2', ...) under Ulysses SP.

    It reads the SP group from the ``nopad_sp_group`` kwarg and the full row's boundaries from
    ``cu_seq_lens_q`` (both put there by :func:`nopad.engines._fsdp.prepare_model_inputs`). Without
    a group it is ``base`` unchanged. Query/key/value arrive (B, H, L, D) for the local slice; the
    all-to-all turns them into (B, H / W, L * W, D), ``base`` runs on the whole row, and the output
    (B, L * W, H / W, D) goes back to (B, L, H, D).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward  # the generic eager kernel

    def forward(module, query, key, value, attention_mask, *args, **kwargs):
        group = kwargs.pop(SP_GROUP_KWARG, None)
        base_fn = ALL_ATTENTION_FUNCTIONS.get_interface(base, eager_attention_forward)
        if group is None or dist.get_world_size(group) == 1:
            return base_fn(module, query, key, value, attention_mask, *args, **kwargs)
        world = dist.get_world_size(group)
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads % world:
            raise input_error("attention heads", None, f"a multiple of the SP size {world}", f"{heads}")
        groups = heads // kv_heads
        if kv_heads % world:  # too few kv heads to split: give every query head its own copy
            key, value, groups = repeat_heads(key, groups), repeat_heads(value, groups), 1
        query, key, value = (all_to_all(t, group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
        total = query.shape[2]
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:
            raise input_error(
                "cu_seq_lens_q",
                None,
                "the full row's boundaries in the model kwargs under Ulysses SP",
                "none (build the inputs with nopad.engines._fsdp.prepare_model_inputs)",
            )
        if not getattr(base_fn, "reads_boundaries", "flash" in base):  # sdpa, eager: the mask carries them
            additive = None if base == "sdpa" else query.dtype
            attention_mask = block_causal_mask(cu_seqlens, total, additive_dtype=additive)
        out, weights = base_fn(_heads_view(module, groups, base), query, key, value, attention_mask, *args, **kwargs)
        return all_to_all(out, group, scatter_dim=1, gather_dim=2), weights

    return forward


def enable_ulysses(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model``'s attention to the Ulysses wrapper around its current implementation.

    Registers the wrapper as ``nopad_ulysses_<base>`` in transformers' attention registry (a name,
    not state: the group still comes with each forward). Idempotent; returns the model.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config: Any = check_transformers_model(model).config
    base: str = config._attn_implementation
    if base.startswith(ULYSSES_PREFIX):
        return model
    name = ULYSSES_PREFIX + base
    AttentionInterface.register(name, ulysses_attention(base))
    # transformers builds masks only for implementations it knows: give the wrapper its base's mask
    # builder, so a forward without a group (or a padded forward) is masked exactly as before.
    if base in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    set_attn_implementation(model, name)
    return model


def set_attn_implementation(model: torch.nn.Module, name: str) -> None:
    """Set ``_attn_implementation`` on every config of ``model`` (a VL model has one per tower).

    The configs are found once per model (a walk over its modules) and remembered.
    """
    configs = recall(model, "configs")
    if configs is None or (configs and configs[0] is not getattr(model, "config", configs[0])):
        found = {
            id(m.config): m.config
            for m in model.modules()
            if hasattr(getattr(m, "config", None), "_attn_implementation")
        }
        configs = remember(model, "configs", list(found.values()))
    for each in configs:
        each._attn_implementation = name
