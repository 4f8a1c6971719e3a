"""verl's packed Qwen3.5 linear attention served by nopad's packed forms.

verl 0.9.1 patches Qwen3.5's gated delta net (``verl.models.transformers.qwen3_5``) for packed rows.
Where flash-linear-attention and causal-conv1d are missing, its forward falls back to two loops over
the sequences of the row, one slice (and one host read of the boundaries) per sequence:
``_packed_causal_conv1d_fallback`` and ``_packed_chunk_gated_delta_rule``. Both are module-level
names that its forward looks up when it runs, so rebinding them there routes every packed Qwen3.5
forward to nopad's forms: a fixed number of tensor ops whatever the number of sequences, with
verl's signatures, each sequence computed as if it ran alone. Where verl's kernels are installed,
verl's own calls run as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from nopad.core._batch import takes_keyword
from nopad.core._layout import known_host_lengths, remember_host_lengths
from nopad.integrations.verl._originals import verl_original
from nopad.modeling._layers import PackedRow, causal_conv1d, gated_delta_rule
from nopad.modeling._routing import packed_row_of

QWEN3_5_MODULE = "verl.models.transformers.qwen3_5"


def _row(cu_seqlens: Tensor, cu_seqlens_cpu: Tensor | None) -> PackedRow:
    """The row of verl's boundaries; verl's host copy of them, when it passes one, saves the read."""
    if cu_seqlens_cpu is not None and known_host_lengths(cu_seqlens) is None:
        remember_host_lengths(cu_seqlens, np.diff(cu_seqlens_cpu.to(torch.int64).numpy()))
    return packed_row_of(cu_seqlens)


def packed_causal_conv1d_fallback(
    self: Any, mixed_qkv: Tensor, cu_seqlens: Tensor, cu_seqlens_cpu: Tensor | None = None
) -> Tensor:
    """verl's ``_packed_causal_conv1d_fallback``: (1, C, T) -> (1, C, T), the silu of each sequence's
    depthwise causal conv as if it ran alone (verl: one conv per sequence)."""
    weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
    row = _row(cu_seqlens, cu_seqlens_cpu)
    return causal_conv1d(mixed_qkv[0], weight, bias, row, activation="silu").unsqueeze(0)


def packed_chunk_gated_delta_rule(
    self: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    cp_context: Any = None,
) -> tuple[Tensor, Any]:
    """verl's ``_packed_chunk_gated_delta_rule``: its kernel paths as they were (no boundaries, fla's
    context parallelism, a kernel that takes ``cu_seqlens``: verl's function runs them), and instead of
    its loop over sequences, or of a fallback that would ignore the boundaries, one packed call of
    :func:`nopad.modeling.gated_delta_rule`. A kernel takes ``cu_seqlens`` as a parameter of its own: verl
    also counts a ``**kwargs``, which makes transformers' torch fallback look as if it took them; it ignores
    them, and verl's packed Qwen3.5 then runs the row as one sequence (measured: 2e-4 off per sequence)."""
    takes_them = takes_keyword(self.chunk_gated_delta_rule, "cu_seqlens", any_keyword=False)
    if cu_seqlens is None or cp_context is not None or takes_them:
        original = verl_original(QWEN3_5_MODULE, "_packed_chunk_gated_delta_rule")
        return original(self, query, key, value, g, beta, cu_seqlens, cu_seqlens_cpu, cp_context)
    row = _row(cu_seqlens, cu_seqlens_cpu)
    out = gated_delta_rule(query[0], key[0], value[0], g[0], beta[0], row, use_qk_l2norm=True)
    return out.unsqueeze(0), None
