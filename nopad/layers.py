"""Packed forms of the layers that carry state along the sequence: each sequence of a packed row
computed as if it ran alone, the state reset wherever a sequence starts.

``causal_conv1d`` (the short convs of gated delta nets, Mamba2 and LFM2), ``gated_delta_rule``
(Qwen3.5, Qwen3-Next, OLMo hybrid) and ``ssd_scan`` (Mamba2: Bamba, Granite-4.0-H, Nemotron-H,
Falcon-H1, Zamba2) take the tokens of one packed row and its :class:`PackedRow`. Pure torch on any
device, with autograd; on CUDA the optional kernels (causal-conv1d, flash-linear-attention,
mamba-ssm) run instead where installed and probed. :func:`nopad.attention.use_packed_attention`
routes a transformers model's own layers to these forms; :func:`register_packed_module` serves a
module class of your own.
"""

from nopad._layers import PackedRow, causal_conv1d, gated_delta_rule, register_packed_module, ssd_scan

__all__ = ["PackedRow", "causal_conv1d", "gated_delta_rule", "register_packed_module", "ssd_scan"]
