"""Log-probs and entropy of the next token: from logits (:func:`token_log_probs`) or straight from the
hidden states and the output layer's weight (:func:`head_log_probs`, the chunked head), and the
choice of the fused kernel that serves a call (Cut Cross-Entropy, probed once) or the tiles.

The chunked head never holds the (T, V) logits.

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
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nopad.batches._padding import no_padding_2_padding
from nopad.core._batch import check_choice, check_real, check_real_dtype, parameters_of
from nopad.core._errors import check_flag, check_int, check_mask, free_to_read, input_error
from nopad.core._layout import is_nested, jagged_values, nested_offsets, response_gather
from nopad.core._probe import probe
from nopad.core._torch_internals import wrap_jagged

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


@dataclass(frozen=True)
class HeadOptions:
    """What :class:`ChunkedHead` computes besides its tensors (one object, so the autograd Function
    takes few arguments and its backward returns a short tuple).

    Args:
        pre: ``scale / softcap`` with soft-capping (z = k * tanh(x * pre)), else None (z = k * x).
        with_entropy: the entropy too (one more tile buffer in each pass).
        rows: tokens per tile.
        cols: vocabulary entries per tile.
        shard: this rank's part of a vocabulary-parallel layer, or None (the whole vocabulary here).
    """

    pre: float | None
    with_entropy: bool
    rows: int
    cols: int
    shard: VocabShard | None = None

    def fitted(self, tokens: int, vocab: int) -> HeadOptions:
        """The tile no larger than the (tokens, vocab) logits (at least one row): its buffers are
        allocated at the tile's size."""
        return replace(self, rows=min(self.rows, max(tokens, 1)), cols=min(self.cols, vocab))


class ChunkedHead(torch.autograd.Function):
    """(log-probs (T,), entropy (T,) or None) of softmax(z) over the vocabulary, z as the module says.

    ``apply(hidden, weight, bias, labels, k, options)``: hidden (T, H) (this rank's (T / tp, H) under a
    sequence-parallel shard), weight (V, H) (this rank's rows under a shard), bias (V,) or None,
    labels (T,), ``k`` (T, 1) > 0, ``options`` a :class:`HeadOptions`. Gradients go to hidden, weight
    and bias.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, k, options):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        local_hidden, shard = hidden, options.shard
        if shard is not None and shard.sequence_parallel:
            hidden = shard.gather_rows(hidden)  # (T / tp, H) -> (T, H), as the column-parallel layer gathers
        V = weight.shape[0]
        options = options.fitted(hidden.shape[0], V)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        stats = _softmax_stats(hidden, weight, bias, k, options, acc)
        index, owned = _local_labels(labels, V, shard)
        label_z = _label_z(hidden, weight, bias, index, k, options.pre, acc)
        if shard is not None:
            label_z = shard.combine(stats, torch.where(owned, label_z, 0.0), options.with_entropy)
        log_sum = stats[1].log()
        lse = stats[0] + log_sum
        log_probs = label_z - lse
        entropy = log_sum - stats[2] / stats[1] if options.with_entropy else None
        ctx.save_for_backward(local_hidden, weight, bias, labels, k, lse, entropy)
        ctx.options = options
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):  # type: ignore[override]
        hidden, weight, bias, labels, k, lse, entropy = ctx.saved_tensors
        options: HeadOptions = ctx.options
        pre, shard = options.pre, options.shard
        need = ctx.needs_input_grad[:3]  # hidden, weight, bias
        acc = lse.dtype
        with_h = entropy is not None and grad_entropy is not None
        if (grad_log_probs is None and not with_h) or not any(need):
            return None, None, None, None, None, None
        if shard is not None and shard.sequence_parallel:
            hidden = shard.gather_rows(hidden)  # gathered again rather than kept: (T, H) between the passes
        g_lp = grad_log_probs.to(acc) if grad_log_probs is not None else torch.zeros_like(lse)
        dzdx = k.view(-1) * (1.0 if pre is None else pre)  # dz/dx, less soft-capping's (1 - t^2)
        # a tile's gradient w.r.t. x is p * (a * log p + c) [* (1 - t^2)], per token a and c:
        c_coef = (g_lp + grad_entropy.to(acc) * entropy if with_h else g_lp).mul(dzdx).neg_().unsqueeze(-1)
        a_coef = grad_entropy.to(acc).mul(dzdx).neg_().unsqueeze(-1) if with_h else None
        grads = _Grads(hidden, weight, bias, need, acc)
        _add_tile_grads(grads, k, lse, c_coef, a_coef, options)
        _add_label_grads(grads, labels, g_lp * dzdx, options)
        if shard is not None and grads.h is not None:
            grads.h = shard.reduce_hidden_grad(grads.h)
        return (*grads.result(), None, None, None)  # labels, k and options take no gradient


def _softmax_stats(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, k: Tensor, options: HeadOptions, acc: torch.dtype
) -> Tensor:
    """(3, T) per token: the max of z, the sum of exp(z - max) and (with the entropy) the sum of
    exp(z - max) * (z - max), over the vocabulary, tile by tile (an online log-sum-exp: one pass).

    Args:
        hidden: (T, H) the whole sequence's hidden states.
        weight: (V, H) and bias (V,) or None: the output layer (this rank's rows under a shard).
        k: (T, 1) > 0 per-token factors of z.
        options: the fitted tile, ``pre`` and whether the entropy is wanted.
        acc: the accumulation dtype.
    """
    T, V = hidden.shape[0], weight.shape[0]
    rows, cols, pre, with_entropy = options.rows, options.cols, options.pre, options.with_entropy
    tiles = _Tiles(hidden, weight, bias, rows, cols, acc, extra=1 if with_entropy else 0)
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
    return stats


def _add_tile_grads(
    grads: _Grads, k: Tensor, lse: Tensor, c_coef: Tensor, a_coef: Tensor | None, options: HeadOptions
) -> None:
    """Every tile's gradient w.r.t. x, ``p * (a * log p + c)`` [* (1 - t^2) with soft-capping], into
    ``grads``, the tiles' logits recomputed from the saved inputs (never kept between the passes).

    Args:
        grads: the gradients being written, and the hidden (T, H), weight (V, H) and bias they are of.
        k: (T, 1) per-token factors of z.
        lse: (T,) log-sum-exp of z, from the forward.
        c_coef: (T, 1) per-token c.
        a_coef: (T, 1) per-token a, or None without an entropy gradient (then a = 0).
        options: the fitted tile and ``pre``.
    """
    hidden, pre, acc = grads.hidden, options.pre, lse.dtype
    T, V, rows, cols = hidden.shape[0], grads.weight.shape[0], options.rows, options.cols
    extra = int(a_coef is not None) + int(pre is not None)
    tiles = _Tiles(hidden, grads.weight, grads.bias, rows, cols, acc, extra=extra)
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


def _add_label_grads(grads: _Grads, labels: Tensor, onehot: Tensor, options: HeadOptions) -> None:
    """The label's one-hot part of the gradient, once per token (outside the tiles):
    d log p[label] / dx[label] = dz/dx [* (1 - t^2)]; under a vocabulary shard, on the rank that
    holds the label's row only.

    Args:
        grads: the gradients being written.
        labels: (T,) vocabulary ids.
        onehot: (T,) the log-prob's gradient times dz/dx (less soft-capping's derivative).
        options: ``pre`` and the shard.
    """
    index, owned = _local_labels(labels, grads.weight.shape[0], options.shard)
    if options.pre is not None:
        x = _label_x(grads.hidden, grads.weight, grads.bias, index, grads.acc)
        t_label = (x * options.pre).tanh_()
        onehot = onehot * (1 - t_label * t_label)
    if owned is not None:
        onehot = torch.where(owned, onehot, 0.0)
    grads.add_rows(onehot, index)


def _local_labels(labels: Tensor, vocab: int, shard: VocabShard | None) -> tuple[Tensor, Tensor | None]:
    """(T,) rows of ``weight`` holding each label, and (T,) where this rank holds it (None: every label,
    one rank). A label another rank holds reads row 0 here, and its results are masked out."""
    if shard is None:
        return labels, None
    local = labels - shard.rank * vocab
    owned = (local >= 0) & (local < vocab)
    return torch.where(owned, local, 0), owned


def _all_gather_rows(out: Tensor, local: Tensor, group: Any) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, local, group=group)


def _reduce_scatter_rows(out: Tensor, full: Tensor, group: Any) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, full, group=group)


@dataclass(frozen=True)
class VocabShard:
    """This rank's part of a vocabulary-parallel output layer (Megatron's ColumnParallelLinear).

    The rank holds rows ``[rank * V_local, (rank + 1) * V_local)`` of the (V, H) weight (and bias),
    in the rank order of ``group``. With ``sequence_parallel`` each rank's hidden states are its
    contiguous (T / tp, H) part of the sequence, gathered in the forward (and again in the backward)
    as the layer gathers them. ``reduce_grad``: the gradient of hidden is summed over the ranks (all-reduce;
    reduce-scatter back to the rank's part under sequence parallelism), as Megatron's column-parallel
    layer hands it to the layers before it; False leaves each rank its own part of that sum.
    """

    group: Any
    rank: int
    size: int
    sequence_parallel: bool = False
    reduce_grad: bool = True

    def gather_rows(self, local: Tensor) -> Tensor:
        """(T / tp, *) -> (T, *) in rank order."""
        out = local.new_empty((local.shape[0] * self.size, *local.shape[1:]))
        _all_gather_rows(out, local.contiguous(), group=self.group)
        return out

    def combine(self, stats: Tensor, label_z: Tensor, with_entropy: bool) -> Tensor:
        """Every rank's (3, T) running max, sum of exp and sum of exp times the shifted logit, and (T,)
        label logit (0 where another rank holds the label), combined in place over the vocabulary
        shards with two all-reduces of O(T) floats; returns the label logit."""
        run_max, run_sum, run_dot = stats
        top = run_max.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        shift = run_max - top
        alpha = shift.exp()  # exp(z - top) = exp(z - own max) * exp(own max - top)
        if with_entropy:
            run_dot.add_(shift * run_sum).mul_(alpha)
        run_sum.mul_(alpha)
        run_max.copy_(top)
        summed = torch.stack([run_sum, run_dot, label_z] if with_entropy else [run_sum, label_z])
        dist.all_reduce(summed, group=self.group)
        run_sum.copy_(summed[0])
        if with_entropy:
            run_dot.copy_(summed[1])
        return summed[-1]

    def reduce_hidden_grad(self, grad: Tensor) -> Tensor:
        """(T, H) this rank's part of the gradient of hidden -> what the layers before the head get."""
        if not self.reduce_grad:
            return grad
        if self.sequence_parallel:
            out = grad.new_empty((grad.shape[0] // self.size, *grad.shape[1:]))
            _reduce_scatter_rows(out, grad.contiguous(), group=self.group)
            return out
        dist.all_reduce(grad, group=self.group)
        return grad


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


def head_factors(
    temperature: Tensor | float, rows: int, spec_scale: float, softcap: float | None, like: Tensor
) -> Tensor:
    """(rows, 1) per-token k = scale / t, or softcap / t with soft-capping, in the accumulation dtype."""
    acc = torch.promote_types(like.dtype, torch.float32)
    numerator = softcap if softcap is not None else spec_scale
    if isinstance(temperature, Tensor):
        return (numerator / temperature[:rows].to(device=like.device, dtype=acc)).unsqueeze(-1)
    return torch.full((1, 1), numerator / float(temperature), dtype=acc, device=like.device).expand(rows, 1)


# ---- the fused kernel, where it serves a call ------------------------------------------------------------

# ---- the kernels: a fused one where it is installed and serves the call, the tiles everywhere ----
# In the order "auto" tries them. cut_cross_entropy (Apple's Cut Cross-Entropy, Triton, CUDA) computes
# the label's logit and the log-sum-exp on chip and never writes logits; it gives log-probs only, so a
# call that asks for entropy, or whose temperature it cannot fold into its inputs, takes the tiles.
HEAD_KERNELS = ("cut_cross_entropy", "tiles")
# the dtypes each fused kernel's backward takes (Cut Cross-Entropy's asserts bf16 or fp16, 25.1.1 and since)
BACKWARD_DTYPES = {"cut_cross_entropy": (torch.bfloat16, torch.float16)}


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


# a fact of the installation: under torch.compile read once at trace time, not traced (dynamo would
# trace the lazy import, and break its graph where the package is missing)
@torch.compiler.assume_constant_result
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
    vocab_parallel: bool = False
    dtype: torch.dtype = torch.bfloat16  # of hidden and weight
    grad: bool = False  # a backward may follow: autograd on and an input that requires grad


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
    if needs.vocab_parallel:
        return f"{kernel} has no vocabulary-parallel form (tp_group)"
    if needs.entropy:
        return f"{kernel} gives log-probs only, not the entropy"
    if needs.softcap and not needs.temperature_is_one:
        return f"{kernel} caps the logits before a temperature could divide them"
    if needs.bias and "bias" not in parameters_of(_kernel_function(kernel)):
        return f"this {kernel} takes no bias (its PyPI release 25.1.1 has none)"
    if needs.bias and needs.per_token_temperature:
        return f"{kernel} takes one bias: a per-token temperature cannot scale it"
    dtype = str(needs.dtype).removeprefix("torch.")
    if needs.dtype == torch.float64:
        return f"{kernel} computes in float32 at most, not {dtype}"
    if needs.grad and needs.dtype not in BACKWARD_DTYPES[kernel]:
        takes = " or ".join(str(d).removeprefix("torch.") for d in BACKWARD_DTYPES[kernel])
        return f"{kernel}'s backward takes {takes} only, not {dtype}"
    return _probe_failure(kernel, str(device))


@functools.cache
def _probe_failure(kernel: str, device: str) -> str | None:
    """Why the installed ``kernel`` failed its probe on ``device``, or None (:func:`nopad.core._probe.probe`:
    once per process and device, its results read back). In bf16: its backward takes bf16 or fp16 only."""
    g = torch.Generator().manual_seed(0)
    # Small integers: every logit is exact in any matmul precision, so the log-probs must agree
    # closely; the gradients are bf16 on both sides, a rounding apart.
    hidden, weight = (torch.randint(-2, 3, shape, generator=g).to(torch.bfloat16) for shape in ((16, 64), (128, 64)))
    labels, k = torch.randint(0, 128, (16,), generator=g), torch.full((16, 1), 0.25)

    def fused(h: Tensor, w: Tensor, labels: Tensor, k: Tensor) -> list[Tensor]:
        return [_fused_log_probs(h, w, None, labels, k, None)]

    def tiles(h: Tensor, w: Tensor, labels: Tensor, k: Tensor) -> list[Tensor]:
        return [ChunkedHead.apply(h, w, None, labels, k, HeadOptions(None, False, 16, 128))[0]]

    instead = "the head runs the tiles"
    return probe(kernel, fused, tiles, [hidden, weight], device, constants=[labels, k], tol=2e-2, instead=instead)


def head_kernel_refusal(kernel: str, device: torch.device) -> str | None:
    """Why ``kernel`` cannot serve a plain call on ``device`` (log-probs at temperature 1: no entropy,
    bias or soft-capping), or None. Probes an installed kernel on CUDA (once per process and device)."""
    plain = HeadNeeds(entropy=False, softcap=False, bias=False, per_token_temperature=False, temperature_is_one=True)
    return _head_refusal(kernel, device, plain)


def select_head_kernel(requested: str, device: torch.device, needs: HeadNeeds) -> str:
    """The kernel that runs a call: the first of :data:`HEAD_KERNELS` that serves it ("auto"), or the
    one requested (a name checked at the public edge), which must serve it (else a ValueError saying why)."""
    if requested == "auto":
        return next(k for k in HEAD_KERNELS if _head_refusal(k, device, needs) is None)
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
    shard: VocabShard | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(T,) log-probs and entropy of checked arguments (the temperature per token or a float).

    No tokens: no head runs (no kernel, no tile, no collective: every rank of a shard has the same
    tokens); the empty results still hang on hidden, weight and bias, so a backward gives them zero
    gradients as a head that ran would, and an engine that reduces gradients sees the same on every rank.
    """
    tokens = labels.shape[0]
    if tokens == 0:
        return _no_tokens(hidden, weight, bias, with_entropy)
    per_token = isinstance(temperature, Tensor)
    needs = HeadNeeds(
        entropy=with_entropy,
        softcap=softcap is not None,
        bias=bias is not None,
        per_token_temperature=per_token,
        temperature_is_one=not per_token and float(temperature) == 1.0,
        vocab_parallel=shard is not None,
        dtype=hidden.dtype,
        grad=torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias)),
    )
    chosen = select_head_kernel(kernel, hidden.device, needs)
    if chosen == "cut_cross_entropy":
        k = head_factors(temperature, tokens, scale, None, hidden)
        return _fused_log_probs(hidden, weight, bias, labels, k, softcap), None
    rows, cols = tile or default_tile(hidden.device)
    k = head_factors(temperature, tokens, scale, softcap, hidden)
    pre = None if softcap is None else scale / softcap
    return ChunkedHead.apply(hidden, weight, bias, labels, k, HeadOptions(pre, with_entropy, rows, cols, shard))


def _no_tokens(hidden: Tensor, weight: Tensor, bias: Tensor | None, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Empty (0,) results of a call with no tokens, joined to the inputs' graph by an empty sum."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    anchor = sum((x[:0].sum() for x in (hidden, weight, bias) if x is not None), hidden.new_zeros((), dtype=acc))
    empty = hidden.new_zeros(0, dtype=acc) + anchor.to(acc)
    return empty, (empty.clone() if with_entropy else None)


# ---- from logits, and the checked public entries ------------------------------------------------------


def check_temperature(value: Any, field: str = "temperature") -> float:
    """A Python (or numpy) temperature: a finite number > 0, not a bool or a string. No sync."""
    return check_real(value, field, low=0, low_open=True)


def checked_temperature(value: Any, rows: int, token_rows: Tensor | None = None) -> Tensor | float:
    """THE temperature check: a float stays a float (:func:`check_temperature`); a 0-d or (rows,) tensor
    -> (rows,) by :func:`temperature_tensor`, or float32 per token given ``token_rows`` (T,). No sync."""
    if not isinstance(value, Tensor):
        return check_temperature(value)
    per_row = temperature_tensor(value, rows, "temperature")
    return per_row if token_rows is None else per_row.to(token_rows.device, torch.float32).index_select(0, token_rows)


def temperature_tensor(temperature: Tensor, rows: int, field: str) -> Tensor:
    """(rows,) per-row temperatures from a 0-d or (rows,) tensor of real numbers, checked.

    On the CPU every value is checked at once (a read of CPU memory, no device sync): a row that is
    not a finite value > 0 is a ValueError naming it. A device tensor is not read (that would be a
    host sync): such a row becomes NaN, so every log-prob and entropy of that sequence is NaN
    instead of a plausible number (an inf temperature would give a uniform distribution, a
    negative one the reversed one).
    """
    check_real_dtype(temperature, field)
    if temperature.dim() == 0:
        temperature = temperature.reshape(1).expand(rows)
    if temperature.shape != (rows,) or temperature.is_nested:
        shape = "nested" if temperature.is_nested else f"shape {tuple(temperature.shape)}"
        raise input_error(field, None, f"a float, a 0-d tensor or a ({rows},) per-sample tensor", shape)
    valid = torch.isfinite(temperature) & (temperature > 0)
    if temperature.device.type != "cpu":
        return torch.where(valid, temperature, float("nan"))
    if not bool(valid.all()):
        row = int((~valid).nonzero()[0])
        raise input_error(field, row, "a finite number > 0", f"{temperature[row].item()!r}")
    return temperature


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits / t)[label] and the entropy of softmax(logits / t), per token.

    Forward and (log-prob only) backward allocate ONE (L, V) float32 buffer each; the backward of
    the entropy needs a second. The input logits are saved, not copied.
    """

    @staticmethod
    def forward(ctx, logits, labels, inv_temp, with_entropy):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        inv_temp = inv_temp.to(dtype)
        buf = logits.to(dtype) * inv_temp  # the one (L, V) buffer: scaled logits
        row_max = buf.amax(-1, keepdim=True)
        buf.sub_(row_max).exp_()
        sum_exp = buf.sum(-1, keepdim=True)
        lse = (row_max + sum_exp.log()).squeeze(-1)
        log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(dtype) * inv_temp.squeeze(-1) - lse
        entropy = None
        if with_entropy:
            # sum_v p_v * s_v in place (p is recomputed in backward): a row-wise reduction whose result
            # does not depend on how many rows there are, unlike a batched matmul.
            expected = buf.div_(sum_exp).mul_(logits).sum(-1) * inv_temp.squeeze(-1)
            entropy = lse - expected
        ctx.save_for_backward(logits, labels, inv_temp, lse, entropy if with_entropy else lse)
        ctx.with_entropy = with_entropy
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, labels, inv_temp, lse, entropy = ctx.saved_tensors
        g_lp = grad_log_probs if grad_log_probs is not None else torch.zeros_like(lse)
        buf = logits.to(inv_temp.dtype) * inv_temp
        if ctx.with_entropy and grad_entropy is not None:
            # d entropy / d s_v = -p_v (log p_v + H); log p = s - lse.
            buf.sub_(lse.unsqueeze(-1))
            probs = buf.exp()
            buf.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1)).add_(g_lp.unsqueeze(-1)).mul_(probs)
        else:
            buf.sub_(lse.unsqueeze(-1)).exp_().mul_(g_lp.unsqueeze(-1))
        buf.neg_().scatter_add_(-1, labels.unsqueeze(-1), g_lp.unsqueeze(-1)).mul_(inv_temp)
        return buf.to(logits.dtype), None, None, None


def _check_rows_and_labels(x: Tensor, field: str, shape: str, labels: Tensor, parts: int = 1) -> None:
    """``x`` a floating (tokens / parts, *) 2-D tensor and ``labels`` (tokens,) integer token ids (one dtype check)."""
    check_real_dtype(x, field, floating=True)
    dtype = getattr(labels, "dtype", None)
    if dtype is None or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        got = f"dtype {dtype}" if dtype is not None else type(labels).__name__
        raise input_error("labels", None, "token ids (an integer tensor)", got)
    if x.dim() != 2 or labels.dim() != 1 or labels.shape[0] != x.shape[0] * parts:
        what = f"{shape} matching labels {tuple(labels.shape)}"
        if parts > 1:
            what += f" ({parts} ranks' parts of the sequence: {labels.shape[0] / parts:g} tokens each)"
        raise input_error(field, None, what, f"{tuple(x.shape)}")


def check_label_range(labels: Tensor, vocab: int) -> None:
    """Labels are ids in [0, vocab): read where that is free (host memory), one reduction; on a device
    they are not read (the gather then fails on its own, or, under TP, no rank owns the label)."""
    if free_to_read(labels) and labels.numel():
        low, high = torch.aminmax(labels)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise input_error("labels", None, f"token ids in [0, vocab={vocab}) (a pad id past it?)", f"{int(bad)}")


def token_log_probs(
    logits: Tensor, labels: Tensor, temperature: Tensor | float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(L, V) logits, (L,) labels, float or (L,) temperature -> (L,) log-probs and optional (L,) entropy.

    Float32 results. One extra (L, V) buffer in the forward (see :class:`_TokenLogProbs`).
    Floating logits, integer labels in [0, V) (read on the CPU, where that is free; on a device
    gather refuses one outside the vocab), a temperature as :func:`prepare_model_inputs` takes it (per token here).
    """
    _check_rows_and_labels(logits, "logits", "(tokens, vocab)", labels)
    check_label_range(labels, logits.shape[1])
    with_entropy = check_flag(with_entropy, "with_entropy")
    return logits_log_probs(logits, labels, checked_temperature(temperature, logits.shape[0]), with_entropy)


def logits_log_probs(
    logits: Tensor, labels: Tensor, temperature: Tensor | float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """:func:`token_log_probs` of arguments already checked (by :func:`prepare_model_inputs`)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)  # fp64 logits keep fp64 temperatures
    if isinstance(temperature, Tensor):
        inv_temp = temperature.to(device=logits.device, dtype=dtype).reciprocal().unsqueeze(-1)
    else:
        inv_temp = torch.full((1, 1), 1.0 / float(temperature), device=logits.device, dtype=dtype)
        inv_temp = inv_temp.expand(logits.shape[0], 1)
    return _TokenLogProbs.apply(logits, labels, inv_temp, with_entropy)


def head_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: Tensor | float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    *,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    kernel: str = "auto",
    tp_group: Any = None,
    sequence_parallel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(T, H) hidden states, (V, H) output weight, (T,) labels -> (T,) log-probs and optional (T,) entropy.

    Equal to :func:`token_log_probs` of the logits ``softcap * tanh(logit_scale * (hidden @ weight.T
    + bias) / softcap)`` (``logit_scale * (hidden @ weight.T + bias)`` without ``softcap``), without
    ever holding them: the head works in tiles of ``chunk_size`` tokens by a slice of the
    vocabulary, keeps an online log-sum-exp per token, and its backward recomputes each tile and
    writes the gradients of ``hidden``, ``weight`` and ``bias`` directly. Memory: a few tiles,
    whatever T and V. Float32 results (float64 for float64 inputs); no host sync.
    ``temperature``: a float or a per-token (T,) tensor, as :func:`token_log_probs` takes it.
    ``chunk_size``: tokens per tile (default by device: 1,024 tokens by 16,384 vocabulary entries on
    a CPU, 2,048 tokens by the whole vocabulary on CUDA; see docs/results.md). A tied embedding is
    just the weight passed here: its gradient accumulates into the same parameter. The work is a
    loop over tiles: its op count grows with T / chunk_size (the head's one exception to a fixed
    number of ops per call), never with the number of sequences.

    ``kernel``: "auto" runs cut_cross_entropy's fused kernel (Apple's Cut Cross-Entropy, where it is
    installed, on CUDA: the label's logit and the log-sum-exp on chip) for a call it serves, log-probs
    without entropy and a temperature it can fold in, in bf16 or fp16 (float32 without a backward: its
    backward takes half precision only), and the tiles above for every other call;
    "tiles" or "cut_cross_entropy" forces one (a forced kernel that cannot serve the call raises
    ValueError saying why). Nothing extra needs installing: the tiles are the reference and the fallback.

    ``tp_group``: a vocabulary-parallel head (Megatron's ColumnParallelLinear output layer). Each rank of
    the group holds ``weight`` (V / tp, H), rows ``[rank * V / tp, (rank + 1) * V / tp)`` of the whole
    (and ``bias`` (V / tp,)); ``labels`` are global token ids, the same on every rank, and so are the
    results. Per tile each rank keeps its own running max, sum of exponentials, label logit and
    entropy term; two all-reduces of O(T) floats combine them. No rank ever holds (T, V / tp) logits;
    memory stays a few tiles. The gradient of ``weight`` (and ``bias``) is the rank's own rows; the
    gradient of ``hidden`` is summed over the ranks, as the column-parallel layer hands it back.
    ``sequence_parallel``: ``hidden`` is this rank's (T / tp, H) contiguous part of the sequence
    (Megatron's sequence parallelism), gathered in the forward and the backward, its gradient
    reduce-scattered back to the part; ``labels`` and a per-token ``temperature`` stay (T,). Every rank
    must call with the same tokens (collectives); the tiles serve every such call.
    """
    return checked_head(
        hidden,
        weight,
        labels,
        temperature,
        with_entropy,
        chunk_size,
        bias=bias,
        logit_scale=logit_scale,
        softcap=softcap,
        kernel=kernel,
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
    )


def checked_head(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: Tensor | float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    *,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    kernel: str = "auto",
    tp_group: Any = None,
    sequence_parallel: bool = False,
    reduce_hidden_grad: bool = True,
    per_row: tuple[int, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`head_log_probs`, every argument checked here; ``reduce_hidden_grad=False`` leaves each rank
    of a ``tp_group`` its own part of the gradient of hidden (what verl's kernel returns: its callers sum it);
    ``per_row`` (B, each token's row): a temperature tensor is per row, checked as such, read per token."""
    shard = None
    if sequence_parallel is not False:
        sequence_parallel = check_flag(sequence_parallel, "sequence_parallel")
    if tp_group is not None:
        shard = _vocab_shard(tp_group, sequence_parallel, reduce_hidden_grad)
    elif sequence_parallel:
        raise input_error("sequence_parallel", None, "a tp_group to gather the sequence over", "no tp_group")
    parts = shard.size if shard is not None and shard.sequence_parallel else 1
    _check_rows_and_labels(hidden, "hidden", "(tokens, hidden)", labels, parts)
    check_real_dtype(weight, "weight", floating=True)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.dtype != hidden.dtype:
        rows = "vocab" if shard is None else f"vocab / {shard.size}"
        raise input_error(
            "weight",
            None,
            f"({rows}, {hidden.shape[1]}) of dtype {hidden.dtype} like hidden",
            f"{tuple(weight.shape)} of dtype {weight.dtype}",
        )
    check_label_range(labels, weight.shape[0] * (1 if shard is None else shard.size))
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise input_error(
            "bias", None, f"({weight.shape[0]},) of dtype {weight.dtype}", f"{tuple(bias.shape)} of dtype {bias.dtype}"
        )
    with_entropy = check_flag(with_entropy, "with_entropy")
    logit_scale = check_real(logit_scale, "logit_scale", low=0, low_open=True)
    if softcap is not None:
        softcap = check_real(softcap, "softcap", low=0, low_open=True)
    temperature = checked_temperature(temperature, *(per_row or (labels.shape[0],)))
    tile = None
    if chunk_size is not None:
        tile = (check_int(chunk_size, "chunk_size", low=1), default_tile(hidden.device)[1])
    return run_head(
        hidden,
        weight,
        bias,
        labels,
        temperature,
        with_entropy,
        scale=logit_scale,
        softcap=softcap,
        tile=tile,
        kernel=check_choice(kernel, "kernel", ("auto", *HEAD_KERNELS)),
        shard=shard,
    )


def _vocab_shard(group: Any, sequence_parallel: bool, reduce_grad: bool = True) -> VocabShard | None:
    """The :class:`VocabShard` of this rank in ``group`` (a ProcessGroup); None for a group of one."""
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise input_error("tp_group", None, "a torch.distributed ProcessGroup or None", type(group).__name__)
    size = dist.get_world_size(group)
    if size == 1:
        return None
    return VocabShard(group, dist.get_rank(group), size, sequence_parallel, reduce_grad)


# ---- the tokens a loss reads ----------------------------------------------------------------------

TOKENS = ("all", "response")
FILL = 0.0  # the log-prob and entropy at a position the head did not score (as at a sequence's last token)


class ScoredTokens:
    """The positions of a row of ``total`` per-token outputs that a caller reads: the head runs on
    those rows only (one gather), and its results go back to their positions with :data:`FILL`
    everywhere else (one scatter), so the row keeps its shape.

    ``index`` (n,) int64 positions; n, the number of rows the head runs on, is known on the host.
    ``valid`` (n,) bool or None: False where a row of a bounded gather (one per response slot of a
    padded (B, R) frame) stands for no position; its result is dropped and it gets no gradient.
    ``read`` (n,) or None: the positions whose hidden states score each row, where they are not
    ``index`` itself (the shared-prefix layout: a response's first token is scored from its group's
    one prompt, so several rows read one position; each row's label and result stay at ``index``).
    """

    def __init__(self, index: Tensor, valid: Tensor | None, total: int, kind: str, read: Tensor | None = None) -> None:
        self.index, self.valid, self.total, self.kind, self.read = index, valid, total, kind, read

    @property
    def count(self) -> int:
        return self.index.shape[0]

    def rows(self, x: Tensor) -> Tensor:
        """(total, *) -> (n, *) the scored rows."""
        return x.index_select(0, self.index.to(x.device))

    def hidden_rows(self, hidden: Tensor) -> Tensor:
        """(total, H) hidden states -> (n, H) those that score the rows (at ``read``, else ``index``)."""
        return self.rows(hidden) if self.read is None else hidden.index_select(0, self.read.to(hidden.device))

    def place(self, values: Tensor, length: int | None = None) -> Tensor:
        """(n,) results -> (length or total,) with :data:`FILL` elsewhere; autograd flows to ``values``."""
        length = self.total if length is None else length
        index = self.index.to(values.device)
        if self.valid is not None:
            index = torch.where(self.valid.to(values.device), index, length)  # a slot past the end, cut off
        out = values.new_full((length + 1,), FILL)
        return out.index_copy(0, index, values)[:length]

    def mask(self, length: int | None = None) -> Tensor:
        """(length or total,) bool: True at the scored positions."""
        index = self.index if self.valid is None else torch.where(self.valid, self.index, self.total)
        length = self.total if length is None else length
        out = torch.zeros(max(length, self.total) + 1, dtype=torch.bool, device=index.device)
        return out.index_fill_(0, index, True)[:length]

    def shifted(self, start: int, length: int) -> ScoredTokens:
        """The same positions in a slice ``[start, start + length)`` of the row (a Ulysses rank's):
        n rows still, those outside the slice not valid."""
        local = self.index - start
        inside = (local >= 0) & (local < length)
        valid = inside if self.valid is None else inside & self.valid
        return ScoredTokens(torch.where(inside, local, 0), valid, length, self.kind)

    def __repr__(self) -> str:
        return f"ScoredTokens({self.kind}, rows={self.count}, total={self.total})"


def scored_tokens(tokens: str, score_mask: Tensor | None, micro_batch: Any, input_ids: Tensor) -> ScoredTokens | None:
    """Which positions of the micro-batch's packed row (the outputs of nested ``input_ids``) to score;
    None: every one. ``tokens`` and ``score_mask`` checked here, at the edge.

    "all" (the default of every entry): every position, so nothing a caller reads changes. "response":
    the positions :func:`no_padding_2_padding` reads for this micro-batch (position t - 1 for
    response token t), taken from the way back of a batch that :func:`left_right_2_no_padding`
    converted (exactly its n response positions), else from the micro-batch's response fields as
    that function reads them (a bounded gather: one row per slot of the (B, R) response frame); no
    host sync either way. ``score_mask`` (with tokens "all"): a 0/1 mask, flat (T,) or nested (B, j)
    on input_ids' rows, True where a position's output (the log-prob of the NEXT token) is read: a
    packed file's label-aligned ``token_mask`` as it is, or a per-token SFT ``loss_mask`` moved to
    the positions that predict its tokens, ``IndexPlan.from_nested(loss_mask).next_token_labels(
    loss_mask.values())``; its count costs one host sync (``nonzero``), on the CPU too (a read of
    host memory there).
    """
    tokens = check_choice(tokens, "tokens", TOKENS)
    offsets = nested_offsets(input_ids)
    total = jagged_values(input_ids).shape[0]
    if score_mask is not None:
        if tokens != "all":
            raise input_error("tokens", None, "'all' with a score_mask (the mask says which tokens)", repr(tokens))
        return _masked(score_mask, offsets, total)
    if tokens == "all":
        return None
    return _response_positions(micro_batch, offsets, total, jagged_values(input_ids).device)


def _fields(micro_batch: Any) -> Any:
    return micro_batch.keys() if hasattr(micro_batch, "keys") else ()


def _response_positions(micro_batch: Any, offsets: Tensor, total: int, device: torch.device) -> ScoredTokens:
    keys = _fields(micro_batch)
    way = response_gather(offsets)
    own_lengths = any(k in keys and is_nested(micro_batch.get(k)) for k in ("responses", "prompts"))
    if way is not None and not own_lengths:  # exactly the positions the way back reads
        return ScoredTokens(way.source, None, total, "response")
    # what no_padding_2_padding reads, by its own derivation: positions numbered from 1, 0 where none
    numbered = wrap_jagged(torch.arange(1, total + 1, device=device), offsets)
    read = no_padding_2_padding(numbered, micro_batch).flatten()
    return ScoredTokens((read - 1).clamp_(min=0), read > 0, total, "response")


def _masked(score_mask: Any, offsets: Tensor, total: int) -> ScoredTokens:
    """The positions of a 0/1 mask (flat (T,) or nested on the row's offsets). One ``nonzero``."""
    field = "score_mask"
    if is_nested(score_mask):
        theirs = nested_offsets(score_mask)
        values = jagged_values(score_mask)
        if theirs is not offsets and (
            theirs.shape != offsets.shape
            or values.shape[0] != total
            or (free_to_read(theirs, offsets) and not torch.equal(theirs.to(offsets), offsets))
        ):
            raise input_error(field, None, f"input_ids' {offsets.shape[0] - 1} rows of {total} tokens", "other rows")
        score_mask = values
    if not isinstance(score_mask, Tensor) or score_mask.shape != (total,):
        got = f"shape {tuple(score_mask.shape)}" if isinstance(score_mask, Tensor) else type(score_mask).__name__
        raise input_error(field, None, f"a ({total},) or nested (batch, j) 0/1 mask of the row's positions", got)
    check_mask(score_mask, field)
    index = score_mask.bool().nonzero().view(-1)
    return ScoredTokens(index, None, total, "mask")
