"""Packed attention for HF models: ``attn_implementation="nopad_varlen"``, one varlen kernel call per
layer over a packed row's ``cu_seqlens``, no dense mask ever built.

Importing this module registers ``nopad_varlen`` with transformers (where transformers is
installed), so ``from_pretrained(..., attn_implementation="nopad_varlen")`` works after it;
``import nopad`` alone imports neither this module nor transformers. Kernels, in the order
``"auto"`` tries them: ``flash_attn`` (the optional extra), ``aten_flash`` and ``varlen_attn``
(torch's own, CUDA), ``sdpa`` (any device, exact); :func:`available_kernels` lists what runs where.
"""

import importlib.util

from nopad._attention import KERNELS, available_kernels, packed_attention, register, use_packed_attention

if importlib.util.find_spec("transformers") is not None:
    register()

__all__ = ["KERNELS", "available_kernels", "packed_attention", "use_packed_attention"]
