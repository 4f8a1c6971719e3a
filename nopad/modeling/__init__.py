"""The model: packed attention, packed forms of the layers that carry state, and the output head.

``attn_implementation="nopad_varlen"``: one varlen kernel call per layer over a packed row's
``cu_seqlens`` (``flash_attn``, ``aten_flash``, ``varlen_attn`` or exact ``sdpa``), registered with
transformers when this package is imported (``import nopad`` alone imports neither). A model given to
:func:`use_packed_attention` has its state layers routed to ``causal_conv1d``, ``gated_delta_rule`` and
``ssd_scan``, which take one packed row's tokens and its :class:`PackedRow` (state reset where each
sequence starts); :func:`register_packed_module` serves a class of your own. Log-probs and entropy
come from logits (:func:`token_log_probs`) or from the hidden states, never the logits (:func:`head_log_probs`).
"""

import importlib.util

from nopad.modeling._attention import KERNELS, available_kernels, packed_attention, register, use_packed_attention
from nopad.modeling._layers import PackedRow, causal_conv1d, gated_delta_rule, register_packed_module, ssd_scan
from nopad.modeling._logprobs import head_log_probs, token_log_probs

if importlib.util.find_spec("transformers") is not None:
    register()

__all__ = [
    "KERNELS",
    "PackedRow",
    "available_kernels",
    "causal_conv1d",
    "gated_delta_rule",
    "head_log_probs",
    "packed_attention",
    "register_packed_module",
    "ssd_scan",
    "token_log_probs",
    "use_packed_attention",
]
