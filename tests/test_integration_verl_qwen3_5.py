"""verl's packed Qwen3.5 under install(): its per-sequence fallbacks become nopad's packed forms, same results.

verl 0.9.1 patches Qwen3.5's gated delta net for packed rows (``verl.models.transformers.qwen3_5``);
without flash-linear-attention and causal-conv1d it loops over the row's sequences. Runs in CI's
verl leg (verl's pinned transformers), skipped elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch

try:
    import verl.models.transformers.qwen3_5 as verl_qwen3_5
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
except Exception as exc:  # noqa: BLE001 - any import failure means verl (or its transformers) is absent
    if os.environ.get("NOPAD_REQUIRE_VERL"):
        raise
    pytest.skip(f"verl's Qwen3.5 patch is not importable ({exc!r}); CI's verl leg runs it", allow_module_level=True)

from nopad.core import IndexPlan  # noqa: E402
from nopad.integrations import verl as nopad_verl  # noqa: E402

LENGTHS = (70, 1, 3, 64, 9, 2)  # past a chunk, length 1, below the conv kernel, exactly a chunk


def _layer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention"],
    )
    return Qwen3_5ForCausalLM(config).float().model.layers[0].linear_attn


def _run(layer, hidden, cu):
    """verl's patched gated delta net on one packed row, and the gradient of its input."""
    hidden = hidden.detach().requires_grad_()
    out = verl_qwen3_5.qwen3_5_gated_delta_net_forward(layer, hidden, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), hidden.grad


def test_verls_packed_qwen3_5_fallbacks_become_one_packed_call_with_verls_results():
    assert verl_qwen3_5.qwen3_5_gated_delta_net_forward is not None
    layer = _layer()
    assert layer.causal_conv1d_fn is None  # no causal-conv1d here: verl takes its loops
    plan = IndexPlan.from_lengths(torch.tensor(LENGTHS))
    cu = plan.offsets
    hidden = torch.randn(1, plan.total, 32, generator=torch.Generator().manual_seed(3))
    verl_out, _ = _run(layer, hidden, cu)
    pieces = [hidden[:, s:e].detach().requires_grad_() for s, e in zip(cu[:-1], cu[1:])]
    alone = torch.cat([verl_qwen3_5.qwen3_5_gated_delta_net_forward(layer, piece) for piece in pieces], 1)
    (alone * torch.linspace(-1, 1, alone.numel()).view_as(alone)).sum().backward()
    alone_grad = torch.cat([piece.grad for piece in pieces], 1)
    alone = alone.detach()
    # verl alone here (transformers' torch fallback takes **kwargs, so verl hands it cu_seqlens, which
    # it ignores): the row runs as one sequence
    assert (verl_out - alone).abs().max() > 1e-5
    patch = nopad_verl.install(check_version=False)
    try:
        assert verl_qwen3_5._packed_chunk_gated_delta_rule.__module__.startswith("nopad.")
        assert verl_qwen3_5._packed_causal_conv1d_fallback.__module__.startswith("nopad.")
        ours_out, ours_grad = _run(layer, hidden, cu)
    finally:
        patch.uninstall()
    assert not verl_qwen3_5._packed_chunk_gated_delta_rule.__module__.startswith("nopad.")
    assert (ours_out - alone).abs().max() <= 1e-5  # under install(): each sequence as if alone
    assert (ours_grad - alone_grad).abs().max() <= 1e-5 * max(1.0, alone_grad.abs().max().item())
