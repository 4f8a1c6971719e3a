"""THE way nopad comes to trust an optional kernel (Cut Cross-Entropy, flash-linear-attention,
causal-conv1d, mamba-ssm, verl's Triton head): once per process and device, a small case runs
through the kernel and through nopad's own form, forward and backward, and the kernel is used only
if it runs and the two agree. An install that fails here (a Triton it does not know, a missing
CUDA build) or computes something else is never used; the caller serves the call itself.

The callers keep the verdict (``functools.cache`` on their (kernel, device) probe), so the syncs of
reading the results back happen once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def probe(
    name: str,
    kernel: Callable[..., Sequence[Tensor]],
    reference: Callable[..., Sequence[Tensor]],
    inputs: Sequence[Tensor],
    device: str | torch.device,
    *,
    constants: Sequence[Tensor] = (),
    tol: float,
    instead: str,
) -> str | None:
    """Why ``kernel`` cannot serve on ``device`` (also warned, naming ``instead``, what serves then),
    or None when it runs and agrees with ``reference``.

    Each of the two is called with copies on ``device`` of ``inputs`` (requiring grad), then of
    ``constants`` (labels, scales: no grad), and returns its outputs; a weighted sum of every output
    is backpropagated, and the outputs and the gradients of the inputs (zeros where one got none: a
    kernel that drops a gradient differs) must agree to ``tol`` (relative and absolute). Autograd on,
    autocast off, whatever the caller's context (the first call may come inside ``no_grad`` or
    ``inference_mode``, for old log-probs): every tensor the two see is copied inside it, so none
    is an inference tensor.
    """
    device = torch.device(device)
    results: list[list[Tensor]] = []
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            for run in (kernel, reference):
                given = [x.to(device, copy=True).requires_grad_() for x in inputs]
                outputs = list(run(*given, *(c.to(device, copy=True) for c in constants)))
                loss = sum(
                    (out.float() * torch.linspace(-1.0, 1.0, out.numel(), device=device).view_as(out)).sum()
                    for out in outputs
                )
                loss.backward()  # type: ignore[union-attr]
                grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in given]
                results.append([x.detach().float().cpu() for x in (*outputs, *grads)])
    except Exception as error:  # noqa: BLE001 - whatever the install raises, nopad's own form serves
        failure: str | None = f"{name} failed its probe here ({type(error).__name__}: {error})"
    else:
        close = all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(*results))
        failure = None if close else f"{name} failed its probe here (its results differ from nopad's own)"
    if failure is not None:
        warnings.warn(f"nopad: {failure}; {instead}", RuntimeWarning, stacklevel=4)
    return failure
