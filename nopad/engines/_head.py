"""The output head without (T, V) logits: per-token log-probs and entropy straight from hidden states.

Shapes: hidden (T, H), weight (V, H), bias (V,) or None, labels (T,), k (T, 1) per-token factors.

The logits of one token are ``x = hidden @ weight.T + bias`` (V,), and what the softmax sees is

    z = k * x                          without soft-capping, k = scale / temperature
    z = k * tanh(x * pre)              with soft-capping at c: pre = scale / c, k = c / temperature

Both are computed tile by tile, (rows, cols) tokens by vocabulary entries, into buffers allocated
once: memory is bounded by the tile whatever T and V. The forward keeps an online log-sum-exp per
token (the running max, the sum of exp and, for the entropy, the sum of exp times the shifted
logit), so one pass over the vocabulary gives both; it saves only (T,) statistics. The backward
recomputes each tile's logits from the saved hidden states and writes the gradients of hidden,
weight and bias directly (``addmm_`` into preallocated outputs). With p = softmax(z),
log p = z - lse and H = lse - sum(p z):

    d log p[label] / dz = onehot - p
    d H / dz            = -p (log p + H)

so a tile's gradient for per-token output gradients g_lp and g_H is
``p * (a * log p + c)`` with per-token a = -g_H k, c = -(g_lp + g_H H) k (times the
soft-capping derivative), and the label's one-hot part is added once per token outside the tiles.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nopad._errors import input_error

# Tile sizes (tokens x vocabulary entries) by device type. CPU: measured on this project's 2-core
# CPU (docs/results.md, "The output head"): 1,024 x 16,384 (a 64 MiB float32 tile) was the fastest
# with 2 threads; smaller tiles run many more short parallel regions, which lose whole time slices
# to spin-waiting when the machine is shared, and larger ones lost a little matmul efficiency.
# CUDA: whole-vocabulary rows, few kernel launches (not measured: no GPU was lent then).
DEFAULT_TILE = {"cpu": (1024, 16384), "cuda": (2048, 1 << 30)}


def default_tile(device: torch.device) -> tuple[int, int]:
    """(rows, cols) of a head tile on ``device``'s type (the CUDA choice for other accelerators)."""
    return DEFAULT_TILE.get(device.type, DEFAULT_TILE["cuda"])


def _ranges(total: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, total)) for start in range(0, total, size)]


class ChunkedHead(torch.autograd.Function):
    """(log-probs (T,), entropy (T,) or None) of softmax(z) over the vocabulary, z as the module says.

    ``apply(hidden, weight, bias, labels, k, pre, with_entropy, rows, cols)``: ``k`` (T, 1) > 0,
    ``pre`` a float with soft-capping (else None), (rows, cols) the tile.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, k, pre, with_entropy, rows, cols):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        T, V = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        rows, cols = min(rows, max(T, 1)), min(cols, V)
        tiles = _Tiles(hidden, weight, bias, rows, cols, acc, extra=1 if with_entropy else 0)
        # per token: running max of z, sum of exp(z - max), sum of exp(z - max) * (z - max)
        stats = torch.empty(3, T, dtype=acc, device=hidden.device)
        for r0, r1 in _ranges(T, rows):
            kr = k[r0:r1]
            run_max, run_sum, run_dot = stats[0, r0:r1], stats[1, r0:r1], stats[2, r0:r1]
            for first, (v0, v1) in enumerate(_ranges(V, cols)):
                x = tiles.logits(r0, r1, v0, v1)
                if pre is not None:
                    x.mul_(pre).tanh_()
                tile_max = x.amax(-1).mul_(kr.view(-1))  # k > 0: the max of z is k times the max of x
                new_max = tile_max if first == 0 else torch.maximum(run_max, tile_max)
                shifted = torch.addcmul(new_max.neg().unsqueeze(-1), x, kr, out=x)  # z - max
                exp = torch.exp(shifted, out=tiles.extra(0)) if with_entropy else shifted.exp_()
                tile_sum = exp.sum(-1)
                tile_dot = shifted.mul_(exp).sum(-1) if with_entropy else None
                if first == 0:
                    run_max.copy_(new_max), run_sum.copy_(tile_sum)
                    if tile_dot is not None:
                        run_dot.copy_(tile_dot)
                    continue
                # rescale what was summed against the old max: exp(z - new) = exp(z - old) * exp(old - new)
                shift = run_max - new_max
                alpha = shift.exp()
                if tile_dot is not None:
                    run_dot.add_(shift * run_sum).mul_(alpha).add_(tile_dot)
                run_sum.mul_(alpha).add_(tile_sum)
                run_max.copy_(new_max)
        log_sum = stats[1].log()
        lse = stats[0] + log_sum
        log_probs = _label_z(hidden, weight, bias, labels, k, pre, acc) - lse
        entropy = log_sum - stats[2] / stats[1] if with_entropy else None
        ctx.save_for_backward(hidden, weight, bias, labels, k, lse, entropy)
        ctx.pre, ctx.tile = pre, (rows, cols)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):  # type: ignore[override]
        hidden, weight, bias, labels, k, lse, entropy = ctx.saved_tensors
        pre, (rows, cols) = ctx.pre, ctx.tile
        need = ctx.needs_input_grad[:3]
        T, V = hidden.shape[0], weight.shape[0]
        acc = lse.dtype
        with_h = entropy is not None and grad_entropy is not None
        if (grad_log_probs is None and not with_h) or not any(need):
            return (None,) * 9
        g_lp = grad_log_probs.to(acc) if grad_log_probs is not None else torch.zeros_like(lse)
        dzdx = k.view(-1) * (1.0 if pre is None else pre)  # dz/dx, less soft-capping's (1 - t^2)
        # a tile's gradient w.r.t. x is p * (a * log p + c) [* (1 - t^2)], per token a and c:
        c_coef = (g_lp + grad_entropy.to(acc) * entropy if with_h else g_lp).mul(dzdx).neg_().unsqueeze(-1)
        a_coef = grad_entropy.to(acc).mul(dzdx).neg_().unsqueeze(-1) if with_h else None
        grads = _Grads(hidden, weight, bias, need, acc)
        tiles = _Tiles(hidden, weight, bias, rows, cols, acc, extra=int(with_h) + int(pre is not None))
        neg_lse = lse.neg().unsqueeze(-1)
        one = torch.ones((), dtype=acc, device=hidden.device)
        for r0, r1 in _ranges(T, rows):
            kr, nl, cr = k[r0:r1], neg_lse[r0:r1], c_coef[r0:r1]
            ar = a_coef[r0:r1] if a_coef is not None else None
            for v0, v1 in _ranges(V, cols):
                x = tiles.logits(r0, r1, v0, v1)
                if pre is not None:
                    x.mul_(pre).tanh_()  # t, kept for d tanh at the end: log p goes to its own buffer
                log_p = torch.addcmul(nl, x, kr, out=x if pre is None else tiles.extra(0))
                if ar is not None:
                    p = torch.exp(log_p, out=tiles.extra(int(pre is not None)))
                    grad = torch.addcmul(cr, log_p, ar, out=log_p).mul_(p)
                else:
                    grad = log_p.exp_().mul_(cr)
                if pre is not None:
                    grad.mul_(torch.addcmul(one, x, x, value=-1, out=x))  # d tanh = 1 - t^2
                grads.add_tile(grad, r0, r1, v0, v1)
        # the label's one-hot part, once per token: d log p[label] / dx[label] = dz/dx [* (1 - t^2)]
        onehot = g_lp * dzdx
        if pre is not None:
            t_label = (_label_x(hidden, weight, bias, labels, acc) * pre).tanh_()
            onehot = onehot * (1 - t_label * t_label)
        grads.add_rows(onehot, labels)
        return (*grads.result(), None, None, None, None, None, None)


class _Tiles:
    """The tile buffers of one pass, allocated once: ``logits`` and ``extra`` (rows x cols) scratch."""

    def __init__(self, hidden, weight, bias, rows: int, cols: int, acc: torch.dtype, extra: int):
        self.hidden, self.weight, self.bias = hidden, weight, bias
        size = rows * cols
        self._logits = hidden.new_empty(size, dtype=acc)
        self._extra = [hidden.new_empty(size, dtype=acc) for _ in range(extra)]
        # low-precision inputs: the matmul writes (and rounds) in their dtype, as the model's lm_head does
        self._low = hidden.new_empty(size) if hidden.dtype != acc else None
        self.shape = (0, 0)

    def logits(self, r0: int, r1: int, v0: int, v1: int) -> Tensor:
        """(r1 - r0, v1 - v0) linear logits ``hidden @ weight.T + bias`` of the tile, in the accumulation dtype."""
        self.shape = (r1 - r0, v1 - v0)
        out = _view(self._logits, self.shape)
        target = out if self._low is None else _view(self._low, self.shape)
        h, w = self.hidden[r0:r1], self.weight[v0:v1]
        if self.bias is None:
            torch.mm(h, w.t(), out=target)
        else:
            torch.addmm(self.bias[v0:v1], h, w.t(), out=target)
        return out if self._low is None else out.copy_(target)

    def extra(self, i: int) -> Tensor:
        return _view(self._extra[i], self.shape)


def _view(flat: Tensor, shape: tuple[int, int]) -> Tensor:
    """A contiguous view of the front of a flat buffer (a short last tile stays contiguous)."""
    return flat[: shape[0] * shape[1]].view(shape)


class _Grads:
    """The gradients of hidden, weight and bias, written tile by tile (in the accumulation dtype when
    the inputs are of lower precision, rounded once at the end)."""

    def __init__(self, hidden, weight, bias, need: tuple[bool, ...], acc: torch.dtype):
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.low = hidden.dtype != acc
        self.acc = acc
        zeros = functools.partial(torch.zeros, dtype=acc, device=hidden.device)
        self.h = zeros(hidden.shape) if need[0] else None
        self.w = zeros(weight.shape) if need[1] else None
        self.b = zeros(weight.shape[:1]) if need[2] and bias is not None else None

    def add_tile(self, grad: Tensor, r0: int, r1: int, v0: int, v1: int) -> None:
        """grad_hidden[r] += grad @ w, grad_weight[v] += grad.T @ h, grad_bias[v] += grad summed over tokens."""
        h, w = self.hidden[r0:r1], self.weight[v0:v1]
        if self.low:
            g = grad.to(self.hidden.dtype)
            if self.h is not None:
                self.h[r0:r1].add_(g @ w)
            if self.w is not None:
                self.w[v0:v1].add_(g.t() @ h)
        else:
            if self.h is not None:
                self.h[r0:r1].addmm_(grad, w)
            if self.w is not None:
                self.w[v0:v1].addmm_(grad.t(), h)
        if self.b is not None:
            self.b[v0:v1].add_(grad.sum(0))

    def add_rows(self, coef: Tensor, labels: Tensor) -> None:
        """The one-hot part: ``coef`` (T,) at each token's label."""
        coef = coef.unsqueeze(-1)
        if self.h is not None:
            self.h.add_(coef * self.weight.index_select(0, labels).to(self.acc))
        if self.w is not None:
            self.w.index_add_(0, labels, coef * self.hidden.to(self.acc))
        if self.b is not None:
            self.b.index_add_(0, labels, coef.view(-1))

    def result(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return cast(self.h, self.hidden), cast(self.w, self.weight), cast(self.b, self.bias)


def _label_x(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, acc: torch.dtype) -> Tensor:
    """(T,) linear logits at the labels: a row-wise dot with the labels' weight rows in ``acc``,
    rounded to the input dtype as the tile matmul rounds."""
    rows = weight.index_select(0, labels)
    x = torch.bmm(hidden.to(acc).unsqueeze(1), rows.to(acc).unsqueeze(2)).view(-1)
    if bias is not None:
        x = x + bias.index_select(0, labels).to(acc)
    return x.to(hidden.dtype).to(acc)


def _label_z(hidden, weight, bias, labels, k, pre, acc) -> Tensor:
    """(T,) z at the labels."""
    x = _label_x(hidden, weight, bias, labels, acc)
    return (x if pre is None else (x * pre).tanh_()) * k.view(-1)


# ---- a model's output layer ------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSpec:
    """A causal LM's output layer and what its forward does to that layer's output.

    ``layer`` is the ``torch.nn.Linear`` whose forward the chunked head stands in for; the logits
    the model returns are ``softcap * tanh(scale * x / softcap)`` (or ``scale * x`` without
    soft-capping) of that layer's output ``x``.
    """

    layer: torch.nn.Linear
    scale: float = 1.0
    softcap: float | None = None

    def expected(self, x: Tensor) -> Tensor:
        """What the model's forward should make of a stand-in output ``x`` of the layer."""
        x = x * self.scale
        return x if self.softcap is None else torch.tanh(x / self.softcap) * self.softcap

    @property
    def plain(self) -> bool:
        return self.scale == 1.0 and self.softcap is None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _configs(model: torch.nn.Module) -> list[Any]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    return [config] if text is config else [config, text]


def _config_value(configs: list[Any], name: str) -> float | None:
    for config in configs:
        value = _number(getattr(config, name, None))
        if value is not None:
            return value
    return None


def head_spec(model: torch.nn.Module) -> HeadSpec | str:
    """The model's :class:`HeadSpec`, or why the chunked head cannot stand in for its output layer.

    The output layer is ``model.get_output_embeddings()`` (a HF model) or ``model.lm_head``; it must be
    a plain ``torch.nn.Linear`` (a bias is fine; a subclass with its own forward, e.g. a LoRA or a
    quantised layer, is not). What the forward does after the layer is read from where
    transformers' models keep it: ``final_logit_softcapping`` (Gemma 2 and 3) in the config, a
    ``logit_scale`` attribute of the model (Cohere), ``logits_scaling`` (Granite, a divisor) and
    ``lm_head_multiplier`` (Falcon-H1) in the config. The first forward checks that reading (see
    :func:`check_post_processing`); anything else a forward does to the logits is refused there.
    """
    get = getattr(model, "get_output_embeddings", None)
    try:
        layer = get() if callable(get) else getattr(model, "lm_head", None)
    except (AttributeError, NotImplementedError):
        layer = getattr(model, "lm_head", None)
    if layer is None:
        return f"{type(model).__name__} has no output layer (no get_output_embeddings(), no lm_head)"
    if not isinstance(layer, torch.nn.Linear) or type(layer).forward is not torch.nn.Linear.forward:
        return f"its output layer is a {type(layer).__name__}, not a plain torch.nn.Linear"
    configs = _configs(model)
    softcap = _config_value(configs, "final_logit_softcapping")
    scale = 1.0
    model_scale = _number(getattr(model, "logit_scale", None))
    if model_scale is not None:
        scale *= model_scale
    divisor = _config_value(configs, "logits_scaling")
    if divisor is not None:
        scale /= divisor
    multiplier = _config_value(configs, "lm_head_multiplier")
    if multiplier is not None:
        scale *= multiplier
    if not math.isfinite(scale) or scale <= 0 or (softcap is not None and not (math.isfinite(softcap) and softcap > 0)):
        return f"its logits are scaled by {scale} and soft-capped at {softcap}: expected a finite scale > 0"
    return HeadSpec(layer, scale, softcap or None)


def head_factors(
    temperature: Tensor | float, rows: int, spec_scale: float, softcap: float | None, like: Tensor
) -> Tensor:
    """(rows, 1) per-token k = scale / t, or softcap / t with soft-capping, in the accumulation dtype."""
    acc = torch.promote_types(like.dtype, torch.float32)
    numerator = softcap if softcap is not None else spec_scale
    if isinstance(temperature, Tensor):
        return (numerator / temperature[:rows].to(device=like.device, dtype=acc)).unsqueeze(-1)
    return torch.full((1, 1), numerator / float(temperature), dtype=acc, device=like.device).expand(rows, 1)


# ---- the kernels: a fused one where it is installed and serves the call, the tiles everywhere ----
# In the order "auto" tries them. cut_cross_entropy (Apple's Cut Cross-Entropy, Triton, CUDA) computes
# the label's logit and the log-sum-exp on chip and never writes logits; it gives log-probs only, so a
# call that asks for entropy, or whose temperature it cannot fold into its inputs, takes the tiles.
HEAD_KERNELS = ("cut_cross_entropy", "tiles")


def _load_cut_cross_entropy() -> Any:
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy


_LOADERS = {"cut_cross_entropy": _load_cut_cross_entropy}


@functools.cache
def _kernel_function(kernel: str) -> Any:
    """The installed kernel's entry point, or None when it is missing or cannot load here."""
    try:
        return _LOADERS[kernel]()
    except Exception:  # noqa: BLE001 - not installed, or installed without what it needs (Triton, CUDA)
        return None


def kernel_installed(kernel: str) -> bool:
    return kernel == "tiles" or _kernel_function(kernel) is not None


@dataclass(frozen=True)
class HeadNeeds:
    """What a call asks of a head kernel."""

    entropy: bool
    softcap: bool
    bias: bool
    per_token_temperature: bool
    temperature_is_one: bool


def _on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _head_refusal(kernel: str, device: torch.device, needs: HeadNeeds) -> str | None:
    """Why ``kernel`` cannot serve this call, or None."""
    if kernel == "tiles":
        return None
    if not kernel_installed(kernel):
        return f"{kernel} is not installed (or cannot load here)"
    if not _on_cuda(device):
        return f"{kernel} runs on CUDA only"
    if needs.entropy:
        return f"{kernel} gives log-probs only, not the entropy"
    if needs.softcap and not needs.temperature_is_one:
        return f"{kernel} caps the logits before a temperature could divide them"
    if needs.bias and "bias" not in inspect.signature(_kernel_function(kernel)).parameters:
        return f"this {kernel} takes no bias (its PyPI release 25.1.1 has none)"
    if needs.bias and needs.per_token_temperature:
        return f"{kernel} takes one bias: a per-token temperature cannot scale it"
    return _probe_failure(kernel, str(device))


@functools.cache
def _probe_failure(kernel: str, device: str) -> str | None:
    """Why the installed ``kernel`` failed its probe on ``device``, or None. Once per process and
    device, a small forward and backward must run and equal the tiles (its results are read back:
    host syncs, once). An install that does not run here (a Triton it does not know) or computes
    something else is never used."""
    results = []
    failure: str | None = None
    try:
        # The first call may come inside no_grad or inference_mode (old log-probs): the probe needs autograd.
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(torch.device(device).type, enabled=False):
            g = torch.Generator().manual_seed(0)
            # Small integers: every logit is exact in any matmul precision, so the two must agree closely.
            hidden, weight = (torch.randint(-2, 3, shape, generator=g).float() for shape in ((16, 64), (128, 64)))
            labels, k = torch.randint(0, 128, (16,), generator=g), torch.full((16, 1), 0.25)
            for fused in (True, False):
                h, w = (x.to(device).requires_grad_() for x in (hidden, weight))
                args = (h, w, None, labels.to(device), k.to(device))
                lp = _fused_log_probs(*args, None) if fused else ChunkedHead.apply(*args, None, False, 16, 128)[0]
                (lp * torch.arange(1.0, 17.0, device=device)).sum().backward()
                grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in (h, w)]  # none: differs
                results.append([x.detach().cpu() for x in (lp, *grads)])
    except Exception as error:  # noqa: BLE001 - whatever the install raises, the tiles serve instead
        failure = f"{kernel} failed its probe here ({type(error).__name__}: {error})"
    else:
        close = all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(*results))
        failure = None if close else f"{kernel} failed its probe here (its results differ from the tiles')"
    if failure is not None:
        warnings.warn(f"nopad: {failure}; the head runs the tiles", RuntimeWarning, stacklevel=2)
    return failure


def select_head_kernel(requested: str, device: torch.device, needs: HeadNeeds) -> str:
    """The kernel that runs a call: the first of :data:`HEAD_KERNELS` that serves it ("auto"), or the
    one requested, which must serve it (else a ValueError saying why)."""
    if requested == "auto":
        return next(k for k in HEAD_KERNELS if _head_refusal(k, device, needs) is None)
    if requested not in HEAD_KERNELS:
        raise input_error("kernel", None, f"'auto' or one of {list(HEAD_KERNELS)}", repr(requested))
    why = _head_refusal(requested, device, needs)
    if why is not None:
        raise input_error("kernel", None, f"a head kernel that serves this call ({why})", repr(requested))
    return requested


def _fused_log_probs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, k: Tensor, softcap: float | None
) -> Tensor:
    """(T,) float32 log-probs from cut_cross_entropy, exact: ``filter_eps=None`` turns off its
    gradient filtering (which skips blocks of small gradient), in its 25.1.1 release and since.

    z = k x (k = scale / t per token) is the logits of the rows ``k * hidden`` and the bias ``k * bias``
    (one k when there is a bias); with soft-capping (t = 1), k = scale and the kernel caps.
    """
    factors = k.to(hidden.dtype)
    extra = {} if bias is None else {"bias": bias * factors[0, 0]}
    loss = _kernel_function("cut_cross_entropy")(
        hidden * factors, weight, labels, softcap=softcap, reduction="none", filter_eps=None, impl="cce", **extra
    )
    return -loss.float()


def run_head(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    temperature: Tensor | float,
    with_entropy: bool,
    *,
    scale: float = 1.0,
    softcap: float | None = None,
    tile: tuple[int, int] | None = None,
    kernel: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """(T,) log-probs and entropy of checked arguments (the temperature per token or a float)."""
    per_token = isinstance(temperature, Tensor)
    needs = HeadNeeds(
        entropy=with_entropy,
        softcap=softcap is not None,
        bias=bias is not None,
        per_token_temperature=per_token,
        temperature_is_one=not per_token and float(temperature) == 1.0,
    )
    chosen = select_head_kernel(kernel, hidden.device, needs)
    if chosen == "cut_cross_entropy" and hidden.shape[0]:  # no tokens: nothing to launch (the tiles give empty results)
        k = head_factors(temperature, hidden.shape[0], scale, None, hidden)
        return _fused_log_probs(hidden, weight, bias, labels, k, softcap), None
    rows, cols = tile or default_tile(hidden.device)
    k = head_factors(temperature, hidden.shape[0], scale, softcap, hidden)
    pre = None if softcap is None else scale / softcap
    return ChunkedHead.apply(hidden, weight, bias, labels, k, pre, with_entropy, rows, cols)


# ---- running a model's forward through the head ---------------------------------------------


@dataclass
class HeadOutput:
    """A forward's per-token results instead of logits: log-probs (1, L) and entropy (1, L) or None."""

    log_probs: Tensor
    entropy: Tensor | None = None


# model -> why the chunked head does not serve it (learnt on a forward); absent: not known to fail
_REFUSED: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
# model -> its post-processing was checked against its HeadSpec once (a host sync) and matched
_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def refusal(model: torch.nn.Module) -> tuple[HeadSpec | None, str | None]:
    """(the model's spec, None) when the chunked head may serve it, else (None, why not)."""
    spec = head_spec(model)
    if isinstance(spec, str):
        return None, spec
    reason = _REFUSED.get(model)
    return (None, reason) if reason is not None else (spec, None)


class _Call:
    """One forward through the head: what the stand-in needs and what it leaves behind."""

    def __init__(
        self,
        spec: HeadSpec,
        labels: Tensor,
        temperature: Tensor | float,
        real: int,
        with_entropy: bool,
        tile: tuple[int, int] | None,
    ):
        self.spec, self.labels, self.temperature, self.real = spec, labels, temperature, real
        self.with_entropy, self.tile = with_entropy, tile
        self.calls = 0
        self.stand_in: Tensor | None = None
        self.declined: str | None = None
        self.transient = False

    def forward(self, hidden: Tensor) -> Tensor:
        """The output layer's forward, standing in: the head on this row, a (1, L, 3) stand-in returned."""
        layer = self.spec.layer
        self.calls += 1
        length = self.labels.shape[0]
        weight, bias = layer.weight, layer.bias
        if self.calls > 1:
            self.declined = "its forward calls the output layer more than once"
        elif type(weight).__name__ == "DTensor" or type(bias).__name__ == "DTensor":
            self.declined = "its output layer's weight is a DTensor inside the forward (tensor parallel)"
        elif hidden.dim() != 3 or hidden.shape[:2] != (1, length):
            self.declined = f"its output layer got hidden states {tuple(hidden.shape)}, not (1, {length}, hidden)"
        elif hidden.dtype != weight.dtype or torch.is_autocast_enabled(hidden.device.type):
            self.transient = True  # a condition of this call (autocast), not of the model: not remembered
            self.declined = f"its output layer mixes dtypes ({hidden.dtype} hidden, {weight.dtype} weight, or autocast)"
        if self.declined is not None:  # the real layer; a probe returned by an earlier call forces a rerun
            return torch.nn.Linear.forward(layer, hidden)
        real = self.real
        log_probs, entropy = run_head(
            hidden[0, :real],
            weight,
            bias,
            self.labels[:real],
            self.temperature,
            self.with_entropy,
            scale=self.spec.scale,
            softcap=self.spec.softcap,
            tile=self.tile,
        )
        pad = length - real
        if pad:
            log_probs = torch.nn.functional.pad(log_probs, (0, pad))
            entropy = None if entropy is None else torch.nn.functional.pad(entropy, (0, pad))
        # What the model's forward receives instead of (1, L, V) logits: (1, L, 3) = log-prob, entropy
        # and a probe. The results are read back from this tensor, so the gradient reaches it: hooks
        # on the layer's output (FSDP's, when the layer is sharded on its own) fire in the backward.
        # What the forward makes of the probe (values across the range logits take) shows what it does
        # to its output layer's result.
        probe = torch.linspace(-24.0, 24.0, length, device=hidden.device, dtype=log_probs.dtype)
        entropy = log_probs.new_zeros(()).expand(length) if entropy is None else entropy
        self.stand_in = torch.stack([log_probs, entropy, probe], -1).unsqueeze(0)
        return self.stand_in

    def result(self) -> HeadOutput:
        """The per-token results, as new tensors (not views) read from the stand-in output."""
        assert self.stand_in is not None
        entropy = self.stand_in[..., 1].clone() if self.with_entropy else None
        return HeadOutput(self.stand_in[..., 0].clone(), entropy)

    def verdict(self, model: torch.nn.Module, output: Any) -> str | None:
        """None when the forward made of the probe exactly what the spec says; else why not."""
        if self.declined is not None:
            return self.declined
        if self.calls == 0 or self.stand_in is None:
            return "its forward did not call its output layer"
        logits = getattr(output, "logits", output)
        spec = self.spec
        if logits is self.stand_in and spec.plain:
            return None
        if not isinstance(logits, Tensor) or logits.shape != self.stand_in.shape:
            return "its forward returns something other than its output layer's result as logits"
        if _CHECKED.get(model):
            return None
        probe = self.stand_in[..., 2].detach()  # one host sync, on a model's first forward only
        if not torch.allclose(logits[..., 2].detach().to(probe.dtype), spec.expected(probe), rtol=1e-3, atol=1e-3):
            said = "unchanged" if spec.plain else f"scaled by {spec.scale:g}, soft-capped at {spec.softcap}"
            return (
                f"its forward changes its output layer's result in a way nopad does not know "
                f"(expected {said} from its config; use head='logits')"
            )
        _CHECKED[model] = True
        return None


@contextmanager
def head_forward(
    model: torch.nn.Module,
    labels: Tensor,
    temperature: Tensor | float,
    real: int,
    *,
    with_entropy: bool,
    required: bool,
    tile: tuple[int, int] | None = None,
) -> Iterator[torch.nn.Module]:
    """Within the block, ``model(...)`` returns a :class:`HeadOutput` computed by the chunked head
    from the hidden states its output layer receives, never (1, L, V) logits.

    ``labels`` (L,) and ``temperature`` are the row's; the head runs on the first ``real`` tokens
    (the rest, the row's pad, get 0). The model's own forward runs (its body, its kwargs, inside
    any FSDP hooks, so a sharded weight is whole while the head uses it); only its output layer's
    forward is replaced. When the forward turns out not to be served (it does something to the
    logits that :func:`head_spec` did not read, calls the layer twice, has a DTensor weight, ...),
    ``required`` raises ValueError naming why; otherwise the forward is run again with the real
    layer and its logits are returned, and the model is remembered as not served.
    """
    spec, reason = refusal(model)
    if spec is None:
        if required:
            raise input_error("head", None, "a model the chunked head can serve (or head='logits')", str(reason))
        yield model
        return
    served = spec
    original = model.forward
    own = model.__dict__.get("forward")

    def forward(*args: Any, **kwargs: Any) -> Any:
        call = _Call(served, labels, temperature, real, with_entropy, tile)
        layer = served.layer
        layer_own = layer.__dict__.get("forward")
        layer.forward = call.forward  # type: ignore[method-assign,assignment]
        try:
            output = original(*args, **kwargs)
        finally:
            _restore(layer, layer_own)
        why = call.verdict(model, output)
        if why is None:
            return call.result()
        if not call.transient:
            _REFUSED[model] = why
        if required:
            raise input_error("head", None, "a model the chunked head can serve (or head='logits')", why)
        # the probe reached the output only if the stand-in ran: then the logits must be computed again
        return output if call.stand_in is None else original(*args, **kwargs)

    model.forward = forward  # type: ignore[method-assign]
    try:
        yield model
    finally:
        _restore(model, own)


def _restore(module: torch.nn.Module, own: Any) -> None:
    """Put back the instance's own ``forward`` (or none, so the class's is used again)."""
    if own is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = own  # type: ignore[method-assign]
