"""verl's fused-kernel head (``use_fused_kernels``, torch backend) served by nopad's chunked head.

verl 0.9.1's ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` computes log-probs and
entropy from the hidden states in chunks of 512 tokens, each chunk through full (512, V) float32
logits, softmax, log-softmax and a one-hot in its backward. Its model forwards import the class by
name at call time, so rebinding that one name routes every fused forward here.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

from nopad._errors import input_error
from nopad._logprobs import head_log_probs

TORCH_FUNCTIONAL_MODULE = "verl.utils.experimental.torch_functional"


class FusedLinearForPPO(torch.nn.Module):
    """verl's ``FusedLinearForPPO`` with nopad's chunked head: same signature, same outputs.

    ``forward(hidden_states (T, H) or (B, T, H), vocab_weights (V, H), input_ids (T,) or (B, T),
    temperature=1.0) -> (log_probs float32, entropy in the hidden states' dtype)``, both shaped like
    ``input_ids``. ``chunk_size`` is verl's tokens per chunk, kept as the head's tile height.
    ``impl_backend="liger"`` with Liger installed runs Liger's kernel exactly as verl calls it.
    """

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise input_error(
                "impl_backend", None, "'torch' or 'liger' (verl's FusedLinearForPPO backends)", repr(impl_backend)
            )
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(
        self, hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor, temperature: float | Tensor = 1.0
    ) -> tuple[Tensor, Tensor]:
        liger = getattr(sys.modules.get(TORCH_FUNCTIONAL_MODULE), "_LIGER_FUSED_LINEAR_SCALED_CROSS_ENTROPY", None)
        if self.impl_backend == "liger" and liger is not None:
            return _liger(liger, hidden_states, vocab_weights, input_ids, temperature)
        shape = input_ids.shape
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        labels = input_ids.reshape(-1).to(torch.int64)
        if isinstance(temperature, Tensor) and temperature.numel() == 1:
            temperature = float(temperature)  # verl passes a host scalar; a 0-d tensor reads the same
        if isinstance(temperature, Tensor):
            temperature = temperature.reshape(-1)
        log_probs, entropy = head_log_probs(hidden, vocab_weights, labels, temperature, True, self.chunk_size)
        assert entropy is not None
        return log_probs.view(shape), entropy.to(hidden_states.dtype).view(shape)


def _liger(
    function: Any, hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor, temperature: Any
) -> tuple[Tensor, Tensor]:
    """verl's Liger path, as verl calls it (nopad does not replace a fused GPU kernel the user chose)."""
    shape = input_ids.shape
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    nll, entropy = function.apply(
        hidden, vocab_weights, input_ids.reshape(-1).to(torch.int64), temperature, -100, 1, True
    )
    return (-nll).reshape(shape), entropy.reshape(shape)
