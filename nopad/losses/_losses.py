"""verl-compatible PPO policy, value and SFT losses over nested model outputs.

The engine returns per-token outputs (log-probs, entropy, values) as jagged nested tensors over
the whole sequence; the rollout fields (old_log_probs, advantages, returns, ...) stay padded to
the response width R. ``no_padding_2_padding`` moves the response part of each output into that
(B, R) frame with one gather, and the losses below are plain masked tensor math on it.

Global normalisation (verl's ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size``): when a
mini batch is split into micro batches and data-parallel ranks, each micro-batch loss is divided
by the figures of the WHOLE mini batch (all ranks) and multiplied by ``dp_size`` to cancel the
gradient averaging of FSDP/DDP, so summing the micro-batch gradients gives the mini-batch gradient
however the batch was split. :func:`global_batch_info` computes the figures.

No host syncs: metrics are returned as detached 0-d tensors (call ``.item()`` or
a host read once per step to log them). Every function is a fixed number of tensor ops.

Bad input is refused before any work, on the host: every option is a real bool, one of its
documented strings or a finite number in range, and every tensor has the shape and dtype it must.
Each public function checks its arguments once, and what it calls trusts them (``ppo_loss`` checks
its config once, in :meth:`LossConfig.from_any`, and its figures once for all its aggregations).
Every mask is a 0/1 mask (:func:`nopad.core._errors.check_mask`): a mask of 2, 0.5 or -1 is refused,
never read as 1 nor as a weight (verl's masked sums would weight by it; weights have their own
input, ``rollout_is_weights``). Values that live on a device are never read for a check; where one
could still be wrong (a tensor figure below 1, a mask that is not 0/1, an output whose sequence
boundaries differ from the batch's but are a different tensor on a GPU) the loss turns NaN instead
of silently taking another value. On the CPU the same checks read host memory and refuse.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from nopad.batches._padding import no_padding_2_padding
from nopad.core._batch import check_choice, check_real, check_real_dtype, get_field
from nopad.core._errors import (
    check_flag,
    check_int,
    check_mask,
    check_optional_int,
    free_to_read,
    input_error,
    mask_error,
    mask_flag,
)
from nopad.core._layout import IndexPlan, jagged_values, nested_offsets, ragged_dim, to_host, wrap_jagged
from nopad.core._layout import is_nested as _is_nested

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: a bound that keeps the ratio finite in fp32
LOW_VAR_KL_CLAMP = 10.0


# ---- configuration --------------------------------------------------------------------------
@dataclass
class LossConfig:
    """The loss settings, with verl's ActorConfig / CriticConfig field names.

    ``clip_ratio_low`` / ``clip_ratio_high`` default to ``clip_ratio``; ``clip_ratio_c`` is the
    dual-clip bound for negative advantages (must be > 1). ``loss_scale_factor`` is the divisor of
    ``seq-mean-token-sum-norm`` (default: the padded response width).

    Checked on construction and again by :meth:`from_any` (a field may be set afterwards), once per
    loss call:
    ``use_kl_loss`` a real bool; ``loss_agg_mode`` / ``kl_loss_type`` one of their names; every
    ratio, coefficient and factor a finite number: clip ratios >= 0 (the low one <= 1, so that
    1 - low stays a ratio), ``clip_ratio_c`` > 1, ``entropy_coeff`` / ``kl_loss_coef`` /
    ``cliprange_value`` >= 0, ``loss_scale_factor`` > 0.
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    kl_loss_coef: float = 0.001
    cliprange_value: float = 0.5
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> LossConfig:
        """Refuse any field outside its documented values (see the class docstring); returns self."""
        _check_agg_mode(self.loss_agg_mode, "config.loss_agg_mode")
        _check_kl_kind(self.kl_loss_type, "config.kl_loss_type")
        _check_clip(self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c, "config.")
        check_flag(self.use_kl_loss, "config.use_kl_loss")
        for name in ("entropy_coeff", "kl_loss_coef", "cliprange_value"):
            check_real(getattr(self, name), f"config.{name}", low=0)
        _check_scale(self.loss_scale_factor, "config.loss_scale_factor")
        return self

    def clip_bounds(self) -> tuple[float, float]:
        """(low, high): the clip ratios in use, each defaulting to ``clip_ratio``."""
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return float(low), float(high)

    @classmethod
    def from_any(cls, config: Any) -> LossConfig:
        """A LossConfig, a mapping (dict, omegaconf DictConfig), or an object with these attributes
        (verl's ActorConfig / CriticConfig); None for the defaults.

        Keys that are not fields are left alone (verl's configs carry many), except one that nearly
        spells a field (``clip_ratio_hgih``, ``Loss_Agg_Mode``): it is refused, since its value would
        be ignored silently. A list, a string or a number is not a config.
        """
        if isinstance(config, cls):
            return config.validate()
        if config is None:
            return cls()
        keys = _config_keys(config) or []
        fields = [field.name for field in dataclasses.fields(cls)]
        for key in keys:
            near = _near_miss(key, (*fields, "policy_loss"))
            if near is not None:
                raise input_error(f"config key {key!r}", None, f"{near!r} (a near-miss would be ignored)", repr(key))
        policy = _read(config, "policy_loss")
        if policy is not None and (isinstance(policy, (str, bytes, numbers.Number)) or _config_keys(policy) is None):
            raise input_error("config.policy_loss", None, "a config with loss_mode ('vanilla')", repr(policy))
        loss_mode = _read(policy, "loss_mode")
        if loss_mode not in (None, "vanilla"):
            raise input_error(
                "config.policy_loss.loss_mode", None, "'vanilla' (the PPO loss nopad implements)", repr(loss_mode)
            )
        values = {name: _read(config, name) for name in fields}
        return cls(**{name: value for name, value in values.items() if value is not None})


def _config_keys(config: Any) -> list[str] | None:
    """The keys (or attribute names) of a config: a mapping's keys, an object's ``vars``; refuses
    what cannot be a config (a string, a sequence, a number). None for an object without ``vars``."""
    if _is_mapping(config):
        return [str(k) for k in config.keys()]
    if isinstance(config, (str, bytes, Sequence, numbers.Number)) or isinstance(config, Tensor):
        expected = "a LossConfig, a dict or a config object with its fields (verl's ActorConfig)"
        raise input_error("config", None, expected, f"{type(config).__name__} {config!r:.60}")
    try:
        return [str(k) for k in vars(config)]
    except TypeError:
        return None


def _is_mapping(config: Any) -> bool:
    return isinstance(config, Mapping) or (hasattr(config, "keys") and hasattr(config, "get"))


def _read(config: Any, key: str) -> Any:
    """config[key] for a mapping (dict, omegaconf DictConfig), else the attribute; None if absent."""
    if config is None:
        return None
    if _is_mapping(config):
        return config.get(key, None)
    return getattr(config, key, None)


def _near_miss(key: str, known: Sequence[str]) -> str | None:
    """The field ``key`` nearly spells (case, separators, one or two letters off), else None."""
    if key in known or key.startswith("_"):
        return None
    plain = key.lower().replace("-", "_")
    for name in known:
        if plain == name or difflib.SequenceMatcher(None, plain, name).ratio() >= 0.9:
            return name
    return None


def global_batch_info(response_mask: Tensor, dp_group=None) -> dict[str, int]:
    """dp_size, batch_num_tokens and global_batch_size of a mini batch, summed over ``dp_group``.

    Call it once per mini batch, before splitting it into micro batches, and put the three figures
    into every micro batch (``data.set_non_tensor(key, value)``). ``global_batch_size`` counts the
    rows with at least one loss token: fully masked rows are excluded from sequence means.
    One host sync, plus one all_reduce when torch.distributed is initialised. ``response_mask`` is a
    0/1 mask, checked in the same read (this rank's; another rank checks its own).
    """
    only_01 = mask_flag(response_mask, "response_mask")
    if response_mask.dim() != 2:
        raise input_error("response_mask", None, "shape (batch, response_len)", f"{tuple(response_mask.shape)}")
    mask = response_mask.bool()
    figures = torch.stack([mask.sum(), mask.any(-1).sum()])
    dp_size = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        dp_size = torch.distributed.get_world_size(dp_group)
        torch.distributed.all_reduce(figures, group=dp_group)
    num_tokens, num_seqs, *ok = to_host(figures[0], figures[1], *([only_01] if only_01 is not None else []))
    if ok and not ok[0]:
        raise mask_error(response_mask, "response_mask")
    return {"dp_size": dp_size, "batch_num_tokens": num_tokens, "global_batch_size": num_seqs}


# ---- aggregation ----------------------------------------------------------------------------
def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """(B, R) per-token losses -> scalar, over the tokens where ``loss_mask`` is set.

    token-mean:              sum / N_tokens
    token-sum:               sum
    seq-mean-token-sum:      sum_rows(row sum) / N_seqs
    seq-mean-token-mean:     sum_rows(row mean) / N_seqs
    seq-mean-token-sum-norm: sum_rows(row sum) / N_seqs / loss_scale_factor (default R)

    As in verl's agg_loss with global batch info (newer releases; older ones divided the norm
    mode by loss_scale_factor only). ``token-sum`` is nopad's addition: the plain global sum.

    N_tokens is ``batch_num_tokens`` and N_seqs ``global_batch_size`` when given (the global mini
    batch), else this micro batch's own counts; rows without a loss token are never counted in
    N_seqs. Every mode is multiplied by ``dp_size``. Values under a zero mask never reach the
    result, not even NaN or inf. No sync.

    The figures are ints >= 1 (or None); a figure given as a 0-d tensor is not read (a sync): one
    below 1 makes the loss NaN rather than a sum. ``loss_scale_factor`` is a finite number > 0.
    ``loss_mask`` is a 0/1 mask (:func:`nopad.core._errors.check_mask`): on the CPU a 2, 0.5 or -1 is
    refused; on a device it is not read, and such a mask makes the loss NaN.
    """
    _check_agg_mode(loss_agg_mode, "loss_agg_mode")
    check_real_dtype(loss_mat, "loss_mat")
    _check_same_shape(loss_mask, "loss_mask", loss_mat, "loss_mat")
    only_01 = check_mask(loss_mask, "loss_mask")
    figures = _checked_figures(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    return _poison_unless(only_01, _aggregate(loss_mat, loss_mask.bool(), loss_agg_mode, **figures))


def _checked_figures(
    loss_agg_mode: str, dp_size: Any, batch_num_tokens: Any, global_batch_size: Any, loss_scale_factor: Any
) -> dict[str, Any]:
    """THE check of the global figures (once per loss call, for every aggregation it makes)."""
    dp_size = check_int(dp_size, "dp_size", low=1)
    batch_num_tokens = _check_figure(batch_num_tokens, "batch_num_tokens")
    global_batch_size = _check_figure(global_batch_size, "global_batch_size")
    _check_scale(loss_scale_factor, "loss_scale_factor")
    needs = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
    given = batch_num_tokens if loss_agg_mode == "token-mean" else global_batch_size
    if dp_size > 1 and loss_agg_mode != "token-sum" and given is None:
        raise input_error(
            needs,
            None,
            f"the global mini-batch figure when dp_size={dp_size} with {loss_agg_mode!r} "
            "(see nopad.losses.global_batch_info)",
            "None",
        )
    return {
        "dp_size": dp_size,
        "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size,
        "loss_scale_factor": loss_scale_factor,
    }


def _aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    loss_agg_mode: str,
    dp_size: int,
    batch_num_tokens: int | Tensor | None,
    global_batch_size: int | Tensor | None,
    loss_scale_factor: float | None,
) -> Tensor:
    """:func:`agg_loss` of checked arguments and a bool ``mask``."""
    row_sums = torch.where(mask, loss_mat, 0.0).sum(-1)
    if loss_agg_mode == "token-mean":
        return row_sums.sum() / _count(batch_num_tokens, mask.sum()) * dp_size
    if loss_agg_mode == "token-sum":
        return row_sums.sum() * dp_size
    row_tokens = mask.sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        row_sums = row_sums / row_tokens.clamp(min=1)
    loss = row_sums.sum() / _count(global_batch_size, (row_tokens > 0).sum()) * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else mask.shape[-1])
    return loss


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` where the bool ``mask`` is set; 0 for an empty mask. No sync."""
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


# ---- the loss formulas ----------------------------------------------------------------------
def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with dual clip (verl's ``vanilla`` policy loss). All tensors (B, R).

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)); per token
    loss = max(-A * ratio, -A * clamp(ratio, 1 - low, 1 + high)), and for A < 0 additionally
    min(that, -A * clip_ratio_c); times ``rollout_is_weights`` when given; then :func:`agg_loss`.
    Metrics (means over this micro batch's masked tokens, detached): actor/pg_clipfrac,
    actor/ppo_kl, actor/pg_clipfrac_lower. Inputs under a zero mask must be finite here (their
    gradient is 0 * d(...)); :func:`ppo_loss` zeroes the rollout's padding before calling this.
    ``response_mask`` is a 0/1 mask (see :func:`agg_loss`).
    """
    low, high = _check_clip(clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    _check_mask(response_mask, "response_mask")
    for name, x in (
        ("log_prob", log_prob),
        ("old_log_prob", old_log_prob),
        ("advantages", advantages),
        ("rollout_is_weights", rollout_is_weights),
    ):
        if x is None and name == "rollout_is_weights":  # the one optional tensor
            continue
        given: Any = x  # a None here is refused by the checks, naming the field
        _check_same_shape(given, name, response_mask, "response_mask")
        check_real_dtype(given, name, floating=True)
    only_01 = check_mask(response_mask, "response_mask")
    figures = _checked_figures(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    _check_agg_mode(loss_agg_mode, "loss_agg_mode")
    loss, metrics = _policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask.bool(),
        loss_agg_mode,
        (low, high, clip_ratio_c),
        rollout_is_weights,
        figures,
    )
    return _poison_unless(only_01, loss), {k: _poison_unless(only_01, v) for k, v in metrics.items()}


def _policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    clip: tuple[float, float, float],
    rollout_is_weights: Tensor | None,
    figures: dict[str, Any],
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`compute_policy_loss` of checked arguments, a bool mask and the (low, high, c) clip bounds."""
    low, high, clip_ratio_c = clip
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, **figures)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": _masked_mean((clipped > unclipped).float(), response_mask),
            "actor/ppo_kl": _masked_mean(-log_ratio, response_mask),
            "actor/pg_clipfrac_lower": _masked_mean(((clip_loss > dual_bound) & negative).float(), response_mask),
        }
    return loss, metrics


def kl_penalty(
    logprob: Tensor, ref_logprob: Tensor, kl_penalty: str | None = None, *, kind: str | None = None
) -> Tensor:
    """Per-token KL(pi || ref) estimate (Schulman's k1/k2/k3), same shape as the inputs.

    The estimator is the third argument, by position or by verl's keyword ``kl_penalty=``
    (``kind=`` is nopad's older name for it and still works; giving both is an error).
    k1 / kl: d = logprob - ref_logprob;  abs: |d|;  k2 / mse: d^2 / 2;
    k3 / low_var_kl: exp(-d) + d - 1 with -d clamped to [-20, 20] and the result to [-10, 10].
    A trailing ``+`` (``k3+``, ``k1+``, ...) keeps the named estimator's VALUE with k2's GRADIENT
    (straight-through), the gradient that is unbiased for KL.
    """
    if kl_penalty is not None and kind is not None:
        raise input_error(
            "kl_penalty/kind",
            None,
            "one estimator name (kind= is the older name of kl_penalty=)",
            f"both {kl_penalty!r} and {kind!r}",
        )
    kind = kl_penalty if kl_penalty is not None else kind
    if kind is None:
        raise input_error("kl_penalty", None, f"one of {list(KL_KINDS)}", "None")
    _check_kl_kind(kind, "kind")
    check_real_dtype(logprob, "logprob", floating=True)
    _check_same_shape(ref_logprob, "ref_logprob", logprob, "logprob")
    check_real_dtype(ref_logprob, "ref_logprob", floating=True)
    return _kl(logprob, ref_logprob, kind)


def _kl(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """:func:`kl_penalty` of checked arguments."""
    value = _kl_value(logprob, ref_logprob, kind.removesuffix("+"))
    if not kind.endswith("+") or kind in ("k2+", "mse+"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def _kl_value(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    diff = logprob - ref_logprob
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    neg = torch.clamp(-diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(neg) - neg - 1, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss 0.5 * agg(max((v - R)^2, (clip(v, V - c, V + c) - R)^2)), and its clip fraction.

    All tensors (B, R); ``values`` are the rollout's old value estimates. The clip fraction is the
    masked mean, over this micro batch, of tokens where the clipped term is the larger (detached).
    ``response_mask`` is a 0/1 mask (see :func:`agg_loss`).
    """
    _check_mask(response_mask, "response_mask")
    cliprange_value = check_real(cliprange_value, "cliprange_value", low=0)
    for name, x in (("vpreds", vpreds), ("returns", returns), ("values", values)):
        _check_same_shape(x, name, response_mask, "response_mask")
        check_real_dtype(x, name, floating=True)
    _check_agg_mode(loss_agg_mode, "loss_agg_mode")
    only_01 = check_mask(response_mask, "response_mask")
    figures = _checked_figures(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    loss, clipfrac = _value_loss(vpreds, returns, values, response_mask.bool(), cliprange_value, loss_agg_mode, figures)
    return _poison_unless(only_01, loss), _poison_unless(only_01, clipfrac)


def _value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    figures: dict[str, Any],
) -> tuple[Tensor, Tensor]:
    """:func:`compute_value_loss` of checked arguments and a bool mask."""
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns).square()
    clipped = (vpred_clipped - returns).square()
    loss = 0.5 * _aggregate(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode, **figures)
    with torch.no_grad():
        clipfrac = _masked_mean((clipped > unclipped).float(), response_mask)
    return loss, clipfrac


# ---- the verl-style loss functions over nested outputs --------------------------------------
def ppo_loss(config: Any, model_output: Mapping[str, Tensor], data: TensorDict, dp_group=None):
    """PPO actor loss of one micro batch: policy loss - entropy_coeff * entropy + kl_loss_coef * KL.

    ``model_output``: "log_probs" and optionally "entropy", nested (B, j) over whole sequences
    (position t holds the output for token t + 1), flat (total,), or already (B, R).
    ``data``: the micro batch as ``left_right_2_no_padding`` returns it, with response_mask,
    old_log_probs, advantages, optionally rollout_is_weights and (for the KL loss) ref_log_prob,
    each padded (B, R) or nested (B, j_r) as verl keeps them, and the non-tensor figures dp_size,
    batch_num_tokens, global_batch_size. ``config`` may be a :class:`LossConfig`, a dict or verl's
    ``ActorConfig``. ``dp_group`` is accepted for verl compatibility and unused. Returns
    ``(loss, metrics)`` with verl's metric names: actor/pg_loss, actor/pg_clipfrac, actor/ppo_kl,
    actor/pg_clipfrac_lower, actor/entropy_loss, and kl_loss, kl_coef (no prefix, as verl).

    A nested output must belong to this micro batch: the same sequence boundaries as
    ``data["input_ids"]``. The engines return outputs that share the batch's offsets tensor, and
    that identity is the whole check (no sync). Offsets that are another tensor are compared by
    value: on the CPU at once (a host read of CPU memory, never a device sync), with a ValueError
    naming both; on a device without reading them, the comparison turning the loss NaN when they
    differ. The metadata figures read as :func:`nopad.core._batch.get_field` unwraps them.

    ``response_mask`` must be 0/1 and mark no padding (a 1 where ``data``'s padded attention_mask has
    none in its response columns, when it carries one): on the CPU a ValueError naming the row; on a
    device not read (no sync), the loss and metrics turning NaN instead. :func:`value_loss` and the
    padded :func:`sft_loss` check it alike.
    """
    cfg = LossConfig.from_any(config)  # the config's one check in this call
    _check_inputs(model_output, data)
    response_mask, only_01 = _response_mask(data)
    figures = _figures(data, cfg, cfg.loss_agg_mode)  # checked once for the three aggregations below
    log_prob = _response_slice(model_output, "log_probs", data, response_mask)
    low, high = cfg.clip_bounds()
    pg_loss, metrics = _policy_loss(
        _field(data, "old_log_probs", response_mask),
        log_prob,
        _field(data, "advantages", response_mask),
        response_mask,
        cfg.loss_agg_mode,
        (low, high, float(cfg.clip_ratio_c)),
        _optional_field(data, "rollout_is_weights", response_mask),
        figures,
    )
    metrics["actor/pg_loss"] = pg_loss.detach()
    loss = pg_loss
    if model_output.get("entropy", None) is not None:
        entropy = _response_slice(model_output, "entropy", data, response_mask)
        entropy_loss = _aggregate(entropy, response_mask, cfg.loss_agg_mode, **figures)
        loss = loss - cfg.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = entropy_loss.detach()
    if cfg.use_kl_loss:
        kld = _kl(log_prob, _field(data, "ref_log_prob", response_mask), cfg.kl_loss_type)
        kl_loss = _aggregate(kld, response_mask, cfg.loss_agg_mode, **figures)
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()  # verl's ppo_loss names these two without the actor/ prefix
        metrics["kl_coef"] = kl_loss.new_tensor(cfg.kl_loss_coef)
    if only_01 is not None:  # a device mask that is not 0/1: NaN, never a plausible number
        loss, metrics = _poison_unless(only_01, loss), {k: _poison_unless(only_01, v) for k, v in metrics.items()}
    return loss, metrics


def value_loss(config: Any, model_output: Mapping[str, Tensor], data: TensorDict, dp_group=None):
    """Critic loss of one micro batch from nested ``model_output["values"]`` (see :func:`ppo_loss`).

    ``data`` carries padded (B, R) response_mask, values (the rollout's) and returns.
    Metrics: critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean (detached tensors).
    """
    cfg = LossConfig.from_any(config)
    _check_inputs(model_output, data)
    response_mask, only_01 = _response_mask(data)
    vpreds = _response_slice(model_output, "values", data, response_mask)
    vf_loss, clipfrac = _value_loss(
        vpreds,
        _field(data, "returns", response_mask),
        _field(data, "values", response_mask),
        response_mask,
        float(cfg.cliprange_value),
        cfg.loss_agg_mode,
        _figures(data, cfg, cfg.loss_agg_mode),
    )
    metrics = {
        "critic/vf_loss": vf_loss.detach(),
        "critic/vf_clipfrac": clipfrac,
        "critic/vpred_mean": _masked_mean(vpreds.detach(), response_mask),
    }
    if only_01 is not None:
        vf_loss, metrics = _poison_unless(only_01, vf_loss), {k: _poison_unless(only_01, v) for k, v in metrics.items()}
    return vf_loss, metrics


# The two conventions of an SFT mask, named in every message that refuses one given in the other.
PER_TOKEN_WORDS = "per-token mask (1 where the token is learned; shifted by one inside)"
LOSS_MASK_WORDS = f"data['loss_mask'], a {PER_TOKEN_WORDS}"
LABEL_ALIGNED_WORDS = (
    "label-aligned mask (as packed files store it: 1 where the NEXT token is learned, so 0 at each "
    "sequence's last token; used as it is)"
)
TOKEN_MASK_WORDS = f"data['token_mask'], a {LABEL_ALIGNED_WORDS}"
# packed_to_nested marks the label-aligned token_mask it returns with this attribute
# (nopad/packing/_collate.py: LABEL_ALIGNED_ATTR); such a mask given as loss_mask is refused.
LABEL_ALIGNED_ATTR = "_nopad_label_aligned"


def sft_loss(config: Any, model_output: Mapping[str, Tensor], data: TensorDict, dp_group=None):
    """Negative log-likelihood, token-mean over the global batch (verl's SFT loss).

    ``model_output["log_probs"]`` nested (B, j) holds at position t the log-prob of token t + 1 of
    the same sequence (what the engines return). Which tokens count comes from ONE of two masks,
    each under its own name, so the two conventions cannot be mixed up:

    - ``data["loss_mask"]`` nested (B, j), per token (verl's): 1 where token t is learned. It is
      shifted by one WITHIN each sequence (a sequence's first token has no prediction, its last
      position predicts nothing).
    - ``data["token_mask"]`` nested (B, j), label-aligned (a packed file's, through
      :func:`nopad.packing.packed_to_nested`; ``OutputArgs.label_mask``'s convention): 1 where the
      label of position t, token t + 1, is learned. Used as it is, never shifted again. Its slot at
      each sequence's last token belongs to no label and must be 0: a 1 there is a per-token mask
      given under this name, refused (on the CPU a ValueError naming the sequence and both
      conventions; on a device not read, the loss turns NaN).

    Both given is refused (which one was meant cannot be told). Padded layout (neither is nested):
    ``data["response_mask"]`` (B, R) and log-probs nested over whole sequences (sliced like
    :func:`ppo_loss`) or (B, R). ``batch_num_tokens`` should count the tokens that have a
    prediction. Returns ``(loss, {})``. The log-probs must have the mask's sequence boundaries
    (checked as :func:`ppo_loss` checks them against ``input_ids``).
    """
    cfg = LossConfig.from_any(config)
    _check_inputs(model_output, data)
    figures = _figures(data, cfg, "token-mean")
    figures["global_batch_size"] = None  # token-mean: the sequence count plays no part
    log_probs = _output(model_output, "log_probs")
    loss_mask, token_mask = data.get("loss_mask", None), data.get("token_mask", None)
    if _is_nested(loss_mask) and token_mask is not None:
        raise input_error("data", None, f"one mask: {LOSS_MASK_WORDS} or {TOKEN_MASK_WORDS}", "both")
    if getattr(loss_mask, LABEL_ALIGNED_ATTR, False):
        raise input_error(
            "data['loss_mask']",
            None,
            f"a {PER_TOKEN_WORDS}",
            f"the label-aligned token_mask of packed_to_nested, which would be shifted twice: give it as "
            f"{TOKEN_MASK_WORDS}",
        )
    if token_mask is not None and not _is_nested(token_mask) and _is_nested(log_probs):
        raise input_error(
            "data['token_mask']",
            None,
            f"a nested (B, j) mask like the log-probs: {TOKEN_MASK_WORDS} (packed_to_nested(batch) returns it)",
            f"a dense tensor of shape {tuple(getattr(token_mask, 'shape', ()))}",
        )
    if _is_nested(log_probs) and (_is_nested(loss_mask) or _is_nested(token_mask)):
        label_aligned = _is_nested(token_mask)
        mask_field = "data['token_mask']" if label_aligned else "data['loss_mask']"
        given = token_mask if label_aligned else loss_mask
        field = "model_output['log_probs']"
        check_real_dtype(log_probs, field, floating=True)
        same = _same_boundaries(log_probs, field, given, mask_field)
        only_01 = check_mask(jagged_values(given), mask_field)
        mask = _label_aligned(given) if label_aligned else _shifted(given)
        if label_aligned:
            only_01 = _and_flags(only_01, _token_mask_flag(given, mask))
        if log_probs.values().shape[0] != mask.shape[0]:
            raise input_error(
                field, None, f"{mask.shape[0]} tokens like {mask_field}", f"{log_probs.values().shape[0]}"
            )
        values = _poison_unless(same, log_probs.values())
        loss = _aggregate(-values.unsqueeze(0), mask.unsqueeze(0), "token-mean", **figures)
        return _poison_unless(only_01, loss), {}
    response_mask, only_01 = _response_mask(data)
    log_prob = _response_slice(model_output, "log_probs", data, response_mask)
    return _poison_unless(only_01, _aggregate(-log_prob, response_mask, "token-mean", **figures)), {}


def _label_aligned(token_mask: Tensor) -> Tensor:
    """A label-aligned nested mask as the flat bool mask of positions whose label counts: as it is."""
    return token_mask.values().bool()


def _token_mask_flag(token_mask: Tensor, mask: Tensor) -> Tensor | None:
    """The label-aligned mask is 0 at every sequence's last token: checked now on the CPU (ValueError
    naming the sequence and both conventions), returned as a 0-d device flag otherwise."""
    at_last = mask & IndexPlan.from_nested(token_mask).last_token_mask.to(mask.device)
    if not free_to_read(mask):
        return at_last.any().logical_not_()
    if bool(at_last.any()):  # host memory: a read, no device sync
        first = at_last.nonzero()[0]
        row = int(torch.searchsorted(nested_offsets(token_mask).to(mask.device), first, right=True)[0]) - 1
        raise input_error(
            "data['token_mask']",
            row,
            f"a {LABEL_ALIGNED_WORDS}",
            f"1 at its last token: a per-token mask? Give that as {LOSS_MASK_WORDS}",
        )
    return None


def _and_flags(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    return a & b.to(a.device)


def _shifted(loss_mask: Tensor) -> Tensor:
    """Nested (B, j) 0/1 mask -> flat (total,) bool mask of the positions whose NEXT token is learned:
    position t gets loss_mask[t + 1] of its sequence and each sequence's last position 0, so no label
    crosses a sequence boundary. No sync."""
    return IndexPlan.from_nested(loss_mask).next_token_labels(loss_mask.values().bool(), False)


# ---- helpers --------------------------------------------------------------------------------
def _check_inputs(model_output: Any, data: Any) -> None:
    if not isinstance(model_output, Mapping):
        raise input_error(
            "model_output", None, "a dict of tensors (log_probs, entropy, values)", type(model_output).__name__
        )
    if not isinstance(data, (TensorDict, Mapping)):
        raise input_error("data", None, "the micro batch as a TensorDict (or a dict)", type(data).__name__)


def _output(model_output: Mapping[str, Tensor], key: str) -> Tensor:
    x = model_output.get(key, None)
    if x is None:
        raise input_error("model_output", None, f"a {key!r} entry", f"keys {list(model_output.keys())}")
    return x


def _same_boundaries(x: Tensor, field: str, reference: Any, ref_field: str) -> Tensor | None:
    """Check nested ``x`` has the sequence boundaries of nested ``reference`` without a device sync.

    The same offsets tensor (what the engines return): nothing more to check. Another tensor of
    another shape, or on the CPU with other values: ValueError naming both. Another tensor on a
    device: returns the 0-d device tensor "the offsets are equal" for :func:`_poison_unless`.
    """
    if not _is_nested(reference):
        return None
    offsets, ref = nested_offsets(x), nested_offsets(reference)
    if offsets is ref:
        return None
    if offsets.shape != ref.shape:
        raise input_error(field, None, f"{ref.shape[0] - 1} sequences like {ref_field}", f"{offsets.shape[0] - 1}")
    if offsets.device.type == "cpu" and ref.device.type == "cpu":
        if not torch.equal(offsets.to(torch.int64), ref.to(torch.int64)):
            raise input_error(
                field,
                None,
                f"the sequence boundaries of {ref_field} (an output of this micro batch), offsets {ref.tolist()}",
                f"offsets {offsets.tolist()}",
            )
        return None
    return (offsets.to(ref.device, torch.int64) == ref.to(torch.int64)).all()


def _poison_unless(same: Tensor | None, x: Tensor) -> Tensor:
    """``x``, or NaN everywhere when the device-side check ``same`` fails (no host read)."""
    if same is None:
        return x
    return torch.where(same.to(x.device), x, torch.full((), float("nan"), dtype=x.dtype, device=x.device))


def _figures(data: TensorDict, cfg: LossConfig, loss_agg_mode: str) -> dict[str, Any]:
    """The global-batch figures a micro batch carries (verl's config.global_batch_info), checked once."""
    return _checked_figures(
        loss_agg_mode,
        get_field(data, "dp_size", 1),
        get_field(data, "batch_num_tokens"),
        get_field(data, "global_batch_size"),
        cfg.loss_scale_factor,
    )


def _response_mask(data: TensorDict) -> tuple[Tensor, Tensor | None]:
    """The micro batch's (B, R) response mask as bools, checked to be a 0/1 mask that marks no padding
    (:func:`_marks_no_padding`): on the CPU now; on a device as the returned 0-d flag, which the loss
    folds in (NaN when it is not): no sync."""
    mask = data.get("response_mask", None)
    if _is_nested(mask):  # verl also keeps rollout fields nested (B, j_r); they are padded to R here
        width = check_optional_int(get_field(data, "max_response_len"), "data['max_response_len']", low=0)
        mask = IndexPlan.from_nested(mask, width=width).unnest(mask, width)
    if not isinstance(mask, Tensor) or _is_nested(mask) or mask.dim() != 2:
        actual = "missing" if mask is None else f"{type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}"
        raise input_error("data['response_mask']", None, "a padded (batch, response_len) tensor", actual)
    picked = mask.bool()
    return picked, _and_flags(check_mask(mask, "data['response_mask']"), _marks_no_padding(data, picked))


def _marks_no_padding(data: TensorDict, picked: Tensor) -> Tensor | None:
    """No 1 of the (B, R) response mask where the batch's padded (B, S) attention_mask has padding in
    its last R columns (the responses of a left/right padded batch): a 1 there would count a padded
    slot's output (0) as a token. Three (B, R) ops; read at once on the CPU (ValueError naming the
    row), else the 0-d device flag "no padding marked" (no sync). None where ``data`` has no such
    attention_mask to tell padding by."""
    attention = data.get("attention_mask", None)
    if not isinstance(attention, Tensor) or _is_nested(attention) or attention.dim() != 2:
        return None
    (B, R), S = picked.shape, attention.shape[1]
    if attention.shape[0] != B or S < R:
        return None
    on_padding = picked & (attention[:, S - R :] == 0).to(picked.device)
    if not free_to_read(on_padding):
        return on_padding.any().logical_not_()
    if bool(on_padding.any()):
        row = int(on_padding.any(1).nonzero()[0])
        got = f"a 1 at response position {int(on_padding[row].nonzero()[0])}, where attention_mask has padding"
        raise input_error("data['response_mask']", row, "1s on response tokens only (not on padding)", got)
    return None


def _field(data: TensorDict, key: str, response_mask: Tensor) -> Tensor:
    x = _optional_field(data, key, response_mask)
    if x is None:
        raise input_error(f"data[{key!r}]", None, f"a padded {tuple(response_mask.shape)} tensor", "missing")
    return x


def _optional_field(data: TensorDict, key: str, response_mask: Tensor) -> Tensor | None:
    x = data.get(key, None)
    if x is None:
        return None
    if _is_nested(x):  # a nested (B, j_r) rollout field: padded to the (B, R) frame with one gather
        if x.size(0) != response_mask.shape[0]:
            raise input_error(
                f"data[{key!r}]", None, f"{response_mask.shape[0]} rows like response_mask", f"{x.size(0)}"
            )
        x = IndexPlan.from_nested(x, width=response_mask.shape[1]).unnest(x, response_mask.shape[1])
    _check_same_shape(x, f"data[{key!r}]", response_mask, "response_mask")
    check_real_dtype(x, f"data[{key!r}]", floating=True)
    # whatever the rollout left in its padding (NaN included) must reach neither loss nor gradient
    return torch.where(response_mask, x, 0.0)


def _response_slice(model_output: Mapping[str, Tensor], key: str, data: TensorDict, response_mask: Tensor) -> Tensor:
    """model_output[key] -> padded (B, R): the response part of a nested/flat whole-sequence output."""
    x = _output(model_output, key)
    B, R = response_mask.shape
    field = f"model_output[{key!r}]"
    check_real_dtype(x, field, floating=True)
    if _is_nested(x):
        if x.size(0) != B:
            raise input_error(field, None, f"{B} sequences like response_mask", f"{x.size(0)}")
        indices = get_field(data, "indices")
        total = jagged_values(x).shape[0]
        if isinstance(indices, Tensor) and total != indices.shape[0]:
            raise input_error(field, None, f"{indices.shape[0]} tokens (the batch's total)", f"{total}")
        ids = data.get("input_ids", None)
        same = _same_boundaries(x, field, ids, "data['input_ids']")
        if _is_nested(ids) and nested_offsets(x) is not nested_offsets(ids):
            # checked equal (or flagged, on a device): on the batch's own offsets, the way back finds its
            # plan and does not compare them again (a second compare would also be a device sync)
            x = wrap_jagged(jagged_values(x), nested_offsets(ids), ragged_dim(x))
        return _poison_unless(same, no_padding_2_padding(x, data, max_response_len=R))
    if x.dim() == 1:
        return no_padding_2_padding(x, data, max_response_len=R)
    _check_same_shape(x, field, response_mask, "response_mask")
    return x


def _check_figure(value: Any, field: str) -> int | Tensor | None:
    """A global figure: None, an int >= 1, or a 0-d real tensor (not read: see :func:`_count`)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        check_real_dtype(value, field)
        if value.dim() != 0 or _is_nested(value):
            raise input_error(field, None, "an int >= 1 or a 0-d tensor", f"a tensor of shape {tuple(value.shape)}")
        return value
    return check_int(value, field, low=1)


def _count(given: int | Tensor | None, local: Tensor) -> Tensor | int | float:
    if given is None:
        return local.clamp(min=1)
    if isinstance(given, Tensor):  # not read on the host: a count below 1 (or NaN) gives a NaN loss, not a sum
        return torch.where(given >= 1, given, torch.full((), float("nan"), device=given.device))
    return given


def _check_scale(value: Any, field: str) -> None:
    if value is not None:
        check_real(value, field, low=0, low_open=True)


def _check_mask(mask: Any, field: str) -> None:
    if not isinstance(mask, Tensor) or _is_nested(mask):
        actual = "a nested tensor" if _is_nested(mask) else type(mask).__name__
        raise input_error(field, None, "a padded (dense) tensor of 0/1 per token", actual)
    if mask.dtype.is_complex:
        raise input_error(field, None, "a bool, int or float mask", f"dtype {mask.dtype}")


def _check_same_shape(x: Tensor, name: str, ref: Tensor, ref_name: str) -> None:
    if not isinstance(ref, Tensor):
        raise input_error(ref_name, None, "a tensor", type(ref).__name__)
    if not isinstance(x, Tensor) or _is_nested(x) or tuple(x.shape) != tuple(ref.shape):
        actual = f"shape {tuple(x.shape)}" if isinstance(x, Tensor) and not _is_nested(x) else type(x).__name__
        if _is_nested(x):
            actual = "a nested tensor"
        raise input_error(name, None, f"shape {tuple(ref.shape)} like {ref_name}", actual)


def _check_agg_mode(mode: str, field: str) -> None:
    check_choice(mode, field, AGG_MODES)


def _check_kl_kind(kind: str, field: str) -> None:
    if not isinstance(kind, str) or kind.removesuffix("+") not in KL_KINDS:
        raise input_error(field, None, f"one of {list(KL_KINDS)}, optionally with a trailing '+'", f"{kind!r}")


def _check_clip(clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c, prefix: str = "") -> tuple[float, float]:
    """Finite clip ratios: low in [0, 1] and high >= 0 (each defaulting to clip_ratio), c > 1."""
    low_field = "clip_ratio" if clip_ratio_low is None else "clip_ratio_low"
    high_field = "clip_ratio" if clip_ratio_high is None else "clip_ratio_high"
    low = check_real(clip_ratio if clip_ratio_low is None else clip_ratio_low, prefix + low_field, low=0, high=1)
    high = check_real(clip_ratio if clip_ratio_high is None else clip_ratio_high, prefix + high_field, low=0)
    if clip_ratio_low is not None and clip_ratio_high is not None and clip_ratio is not None:
        check_real(clip_ratio, prefix + "clip_ratio", low=0)  # unused then, but a NaN there is still a typo
    real = isinstance(clip_ratio_c, numbers.Real) and not isinstance(clip_ratio_c, bool)
    if not real or not 1.0 < clip_ratio_c < math.inf:
        raise input_error(prefix + "clip_ratio_c", None, "a finite dual-clip bound > 1", f"{clip_ratio_c!r}")
    return low, high
