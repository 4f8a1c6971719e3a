"""verl's fused-kernel heads (``use_fused_kernels``) served by nopad's chunked head.

verl 0.9.1's ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (the torch backend)
computes log-probs and entropy from the hidden states in chunks of 512 tokens, each chunk through
full (512, V) float32 logits, softmax, log-softmax and a one-hot in its backward. Its model forwards
import the class by name at call time, so rebinding that one name routes every fused forward here.

``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (the Triton backend, with a
vocabulary-parallel form for Megatron) needs a CUDA GPU its Triton supports; its HF forwards import it
at call time and its Megatron forwards at import. :func:`linear_cross_entropy` keeps verl's kernel
where it runs and serves nopad's tiles (vocabulary-parallel too) everywhere else.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import Tensor

from nopad.core._batch import check_choice
from nopad.core._errors import input_error
from nopad.core._probe import probe
from nopad.integrations.verl._originals import verl_original
from nopad.modeling._logprobs import checked_head, head_log_probs

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
        temperature = _per_token(temperature)
        log_probs, entropy = head_log_probs(hidden, vocab_weights, labels, temperature, True, self.chunk_size)
        assert entropy is not None
        return log_probs.view(shape), entropy.to(hidden_states.dtype).view(shape)


def _per_token(temperature: float | Tensor) -> float | Tensor:
    """verl's temperature as the head takes it: a host scalar in verl, which a 1-element tensor reads the
    same as; any other tensor flattened to one per token."""
    if isinstance(temperature, Tensor):
        return float(temperature) if temperature.numel() == 1 else temperature.reshape(-1)
    return temperature


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


# ---- verl's fused Triton head: verl.utils.kernel.linear_cross_entropy ------------------------------

KERNEL_MODULE = "verl.utils.kernel.linear_cross_entropy"
KERNEL_CHOICES = ("auto", "verl", "nopad")
REDUCTIONS = ("none", "sum", "mean")
_choice = {"kernel": "auto"}


def use_kernel(kernel: str) -> None:
    """Which head serves verl's ``linear_cross_entropy`` under ``install()``: "auto" (verl's Triton
    kernel where it runs and serves the call, nopad's tiles everywhere else), "verl" (verl's own
    function, always: verl's behaviour), "nopad" (nopad's tiles, always)."""
    _choice["kernel"] = check_choice(kernel, "head_kernel", KERNEL_CHOICES)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float | Tensor = 1.0,
    reduction: str = "none",
    dist_process_group: Any = None,
    *,
    original: Any = None,
) -> tuple[Tensor, Tensor]:
    """verl's ``linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group)``.

    ``hidden`` (..., H) and ``labels`` (...) are flattened to (T, H) and (T,); ``weight`` (V, H), or this
    rank's (V / tp, H) vocabulary shard when ``dist_process_group`` has more than one rank (labels
    global). Returns ``(log_probs, entropy)``: float32 (T,) each, or with ``reduction`` "sum" / "mean" a
    0-d sum / mean of the log-probs (the entropy stays (T,)), as verl's kernel returns them. Backward:
    the gradient of ``hidden`` in its own shape and, under a process group, this rank's part of it
    (verl's kernel leaves the sum to its callers: Megatron's sequence-parallel gather reduces it),
    of ``weight`` its own rows. ``original`` is verl's function (None: the one ``install()`` replaced): it
    runs where the user's choice (:func:`use_kernel`) and its probe let it; nopad's tiles serve every other
    call, on any device.
    """
    original = verl_original(KERNEL_MODULE, "linear_cross_entropy") if original is None else original
    if not isinstance(reduction, str) or reduction.lower() not in REDUCTIONS:
        raise input_error("reduction", None, f"one of {list(REDUCTIONS)} (verl's reductions)", repr(reduction))
    kernel = _choice["kernel"]
    if kernel == "verl" or (kernel == "auto" and _verl_serves(original, hidden, weight, labels, temperature)):
        return original(hidden, weight, labels, temperature, reduction, dist_process_group)
    if not isinstance(hidden, Tensor) or hidden.dim() < 2:
        raise input_error("hidden", None, "a (..., hidden) tensor", f"{getattr(hidden, 'shape', type(hidden))}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    group = dist_process_group
    log_probs, entropy = checked_head(
        flat, weight, labels.reshape(-1), _per_token(temperature), True, tp_group=group, reduce_hidden_grad=False
    )
    assert entropy is not None
    log_probs, entropy = log_probs.float(), entropy.float()
    if reduction.lower() == "sum":
        return log_probs.sum(), entropy
    if reduction.lower() == "mean":
        return log_probs.mean(), entropy
    return log_probs, entropy


def _verl_serves(original: Any, hidden: Any, weight: Any, labels: Any, temperature: Any) -> bool:
    """Whether verl's Triton kernel takes this call (what its asserts ask: CUDA, a float temperature,
    contiguous inputs, a hidden size that is a multiple of 128) and runs here (its probe)."""
    if not all(isinstance(x, Tensor) for x in (hidden, weight, labels)) or type(temperature) is not float:
        return False
    if hidden.device.type != "cuda" or hidden.shape[-1] % 128:
        return False
    if not (hidden.is_contiguous() and weight.is_contiguous()):
        return False
    return _verl_probe(original, str(hidden.device)) is None


@functools.cache
def _verl_probe(original: Any, device: str) -> str | None:
    """Why verl's kernel cannot serve on ``device`` (None: it runs and equals nopad's tiles on a small
    forward and backward, once per process and device: :func:`nopad.core._probe.probe`)."""
    g = torch.Generator().manual_seed(0)
    # small integers in bf16: every logit is exact, so the two must agree to rounding
    hidden, weight = (torch.randint(-2, 3, shape, generator=g).to(torch.bfloat16) for shape in ((16, 128), (256, 128)))
    labels = torch.randint(0, 256, (16,), generator=g)
    # a temperature of 2, not below 1: at 0.5 the bf16 gradients reach 8, where one rounding is 0.03,
    # beyond the 2e-2 a correct kernel is held to (its Triton code under the interpreter failed 3 seeds of 4)
    temperature = 2.0

    def verls(h: Tensor, w: Tensor, labels: Tensor) -> list[Tensor]:
        return list(original(h, w, labels, temperature, "none", None))

    def tiles(h: Tensor, w: Tensor, labels: Tensor) -> list[Tensor]:
        log_probs, entropy = checked_head(h, w, labels, temperature, True)
        assert entropy is not None
        return [log_probs, entropy]

    name, instead = "verl's linear_cross_entropy", "nopad's tiles serve it"
    return probe(name, verls, tiles, [hidden, weight], device, constants=[labels], tol=2e-2, instead=instead)
