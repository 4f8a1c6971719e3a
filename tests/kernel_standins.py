"""CPU stand-ins for the CUDA varlen kernels, with each real kernel's exact signature.

Substituted for the real ones (see :func:`use_standins`), they exercise nopad's wiring on a CPU:
the (tokens, heads, dim) layout, boundaries, GQA handling, scale, window and causal arguments.
Each computes every segment on its own with sdpa and an explicit causal and window mask, aligned
at the bottom right where a segment has fewer queries than keys, as the real kernels do: a
deliberate loop, as a reference should be. Each call is recorded (kernel, K/V heads, keyword arguments).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

# private: stand-ins replace the kernels' calls inside the attention module
import nopad.modeling._attention as attention

CALLS: list[dict] = []


def _reference(q, k, v, cu_q, cu_k, scale, left, right, *, gqa_native: bool, name: str, **recorded):
    """Each segment alone, as the flash kernels define it: query i of a segment of ``n_q`` queries over
    ``n_k`` keys sits at key position ``i + n_k - n_q`` (the bottom-right alignment of flash-attn >= 2.1
    and torch's copy of it), and sees the keys within ``left`` before and ``right`` after that position
    (-1: unbounded); a query that sees no key gets zeros."""
    assert q.dim() == 3 and k.dim() == 3 and v.shape == k.shape, (q.shape, k.shape)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "kernels need the last dim contiguous"
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape, "int32 boundaries, one per sequence"
    assert int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0], (cu_q, cu_k, q.shape, k.shape)
    heads, kv_heads = q.shape[1], k.shape[1]
    if not gqa_native:
        assert heads == kv_heads, f"{name} takes as many K/V heads as query heads, got {heads} and {kv_heads}"
    CALLS.append(
        {"kernel": name, "kv_heads": kv_heads, "heads": heads, "own_keys": not torch.equal(cu_q, cu_k), **recorded}
    )
    out = torch.zeros_like(q)
    for q0, q1, k0, k1 in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        n_q, n_k = q1 - q0, k1 - k0
        if n_q == 0:
            continue
        at = torch.arange(n_q).unsqueeze(1) + (n_k - n_q)  # each query's key position
        j = torch.arange(n_k).unsqueeze(0)
        allowed = torch.ones(n_q, n_k, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= at - left
        if right >= 0:
            allowed &= j <= at + right
        qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        seg = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=heads != kv_heads)
        seen = allowed.any(-1).view(1, 1, n_q, 1)
        out[q0:q1] = torch.where(seen, seg, 0)[0].transpose(0, 1)
    return out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    assert dropout_p == 0.0 and softcap == 0.0 and isinstance(max_seqlen_q, int)
    left, right = window_size
    right = 0 if causal else right
    return _reference(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        softmax_scale,
        left,
        right,
        gqa_native=True,
        name="flash_attn",
        window_size=tuple(window_size),
        causal=causal,
    )


def varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """torch 2.12 and later."""
    assert isinstance(max_q, int)
    return _reference(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        scale,
        *window_size,
        gqa_native=enable_gqa,
        name="varlen_attn",
        window_size=tuple(window_size),
        enable_gqa=enable_gqa,
    )


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """torch 2.11: a window, no enable_gqa."""
    return _reference(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        scale,
        *window_size,
        gqa_native=False,
        name="varlen_attn",
        window_size=tuple(window_size),
    )


def varlen_attn_2_10(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False, scale=None
):
    """torch 2.10: is_causal, no window, no enable_gqa."""
    return _reference(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        scale,
        -1,
        0 if is_causal else -1,
        gqa_native=False,
        name="varlen_attn",
        is_causal=is_causal,
    )


def aten_flash_attention_forward(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
):
    assert dropout_p == 0.0 and not return_debug_mask and isinstance(max_q, int)
    left = -1 if window_size_left is None else window_size_left
    right = 0 if is_causal else (-1 if window_size_right is None else window_size_right)
    out = _reference(
        query,
        key,
        value,
        cum_seq_q,
        cum_seq_k,
        scale,
        left,
        right,
        gqa_native=True,
        name="aten_flash",
        is_causal=is_causal,
        window=(window_size_left, window_size_right),
    )
    empty = query.new_empty(0)
    return out, empty, empty, empty, empty


def aten_flash_without_window(
    query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None
):
    """An older torch's op, before window_size_left/right."""
    return aten_flash_attention_forward(
        query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, scale=scale
    )


STANDINS = {
    "flash_attn": flash_attn_varlen_func,
    "varlen_attn": varlen_attn,
    "aten_flash": aten_flash_attention_forward,
}


def use_standins(monkeypatch: pytest.MonkeyPatch, **overrides) -> None:
    """Make the three CUDA kernels 'available' on the CPU at any dtype, as their stand-ins.

    ``overrides``: kernel name -> stand-in function (another torch's signature), or None to make
    that kernel absent.
    """
    specs = dict(attention.SPECS)
    for name, standin in {**STANDINS, **overrides}.items():
        present = standin is not None
        specs[name] = attention.KernelSpec(("cpu", "cuda"), None, lambda p=present: p, lambda s=standin: s)
    monkeypatch.setattr(attention, "SPECS", specs)
    # a fresh choice cache for this test; the real one comes back untouched with monkeypatch's undo
    monkeypatch.setattr(attention, "select_kernel", functools.lru_cache(attention.select_kernel.__wrapped__))
    CALLS.clear()
