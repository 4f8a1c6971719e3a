"""HF causal-LM adapter for FSDP-style engines: one packed row per micro-batch, log-probs back nested.

Data flow (B sequences, T real tokens, V vocab, W the Ulysses SP size, T_pad >= T the padded row)::

    nested micro-batch (B, j)  --prepare_model_inputs-->  model kwargs: input_ids (1, T_pad / W),
                                                          position_ids (1, T_pad / W) or (C, 1, T_pad / W),
                                                          use_cache=False, no attention_mask
                                                          [+ cu_seq_lens_q/k, max_length_q/k]
    logits (1, T_pad / W, V)   --prepare_model_outputs->  log_probs / entropy nested (B, j)

transformers (5.x) treats a row as packed only when there is no attention_mask AND no cache, and
then finds the boundaries where position ids restart. ``use_cache`` left at its default silently
lets every sequence attend to the ones before it; :func:`check_isolation` catches that.

Needs the ``hf`` extra (transformers) only for Ulysses (:func:`nopad.ulysses.enable_ulysses`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
from tensordict import TensorDict
from torch import Tensor

from nopad._batch import get_field
from nopad.layout import IndexPlan, _fail, is_nested, nested_offsets, ragged_dim
from nopad.ulysses import SP_GROUP_KWARG, ULYSSES_PREFIX, gather_seq, padded_length, slice_for_rank

PAD_TOKEN_ID = 0


@dataclass
class OutputArgs:
    """What :func:`prepare_model_outputs` needs besides the logits; built by :func:`prepare_model_inputs`.

    labels / temperature are this rank's slice (L,) of the padded row; label_mask (T_pad,) is False
    at the last token of every sequence and at the pad; ``plan`` is the micro-batch's index plan;
    ``padded_total`` = T_pad; ``sp_group`` / ``sp_size`` as given.
    """

    plan: IndexPlan
    labels: Tensor
    temperature: Tensor | float
    label_mask: Tensor
    padded_total: int
    sp_group: Any = None
    sp_size: int = 1


def _checked_nested(micro_batch) -> tuple[Tensor, Tensor]:
    input_ids, position_ids = get_field(micro_batch, "input_ids"), get_field(micro_batch, "position_ids")
    for key, x in (("input_ids", input_ids), ("position_ids", position_ids)):
        if not is_nested(x):
            raise _fail(
                key,
                None,
                "a jagged nested tensor (the output of left_right_2_no_padding)",
                "nothing" if x is None else f"a dense tensor of shape {tuple(x.shape)}",
            )
    if input_ids.dim() != 2 or ragged_dim(input_ids) != 1:
        raise _fail(
            "input_ids",
            None,
            "nested (batch, j) ragged on dim 1",
            f"{input_ids.dim()} dims, ragged dim {ragged_dim(input_ids)}",
        )
    total = input_ids.values().shape[0]
    expected_ragged = 1 if position_ids.dim() == 2 else 2
    pos_ragged = ragged_dim(position_ids)
    pos_total = position_ids.values().shape[pos_ragged - 1]
    if pos_ragged != expected_ragged or position_ids.dim() not in (2, 3) or pos_total != total:
        raise _fail(
            "position_ids",
            None,
            f"nested (batch, j) or (batch, C, j) with {total} tokens like input_ids",
            f"{position_ids.dim()} dims, ragged dim {pos_ragged}, {pos_total} tokens",
        )
    ids_offsets, pos_offsets = nested_offsets(input_ids), nested_offsets(position_ids)
    # left_right_2_no_padding shares one offsets tensor; comparing values (a sync) only when they differ.
    if pos_offsets is not ids_offsets and not torch.equal(pos_offsets, ids_offsets):
        raise _fail(
            "position_ids",
            None,
            "the same sequence boundaries as input_ids",
            f"offsets {pos_offsets.tolist()} vs {ids_offsets.tolist()}",
        )
    return input_ids, position_ids


def _token_temperature(temperature, plan: IndexPlan, device) -> Tensor | float:
    """A Python float stays a float (no (T,) tensor); a (B,) or 0-d tensor expands per token."""
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, Tensor):
        if temperature.dim() == 0:
            temperature = temperature.reshape(1).expand(plan.batch_size)
        if temperature.shape != (plan.batch_size,):
            raise _fail(
                "temperature",
                None,
                f"a float, a 0-d tensor or a ({plan.batch_size},) per-sample tensor",
                f"shape {tuple(temperature.shape)}",
            )
        if temperature.device.type == "cpu" and bool((temperature <= 0).any()):
            row = int((temperature <= 0).nonzero()[0])
            raise _fail("temperature", row, "a value > 0", f"{float(temperature[row])}")
        return temperature.to(device=device, dtype=torch.float32)[plan.row_ids.to(device)]
    temperature = float(temperature)
    if temperature <= 0:
        raise _fail("temperature", None, "a value > 0", f"{temperature}")
    return temperature


def _pad_last(x: Tensor, pad: int, value: Tensor | float) -> Tensor:
    if pad == 0:
        return x
    if isinstance(value, Tensor):
        return torch.cat([x, value.expand(*x.shape[:-1], pad).to(x.dtype)], dim=-1)
    return torch.nn.functional.pad(x, (0, pad), value=value)


def prepare_model_inputs(
    micro_batch,
    *,
    temperature: float | Tensor | None = None,
    attn_implementation: str | None = None,
    pad_to_multiple: int = 1,
    sp_group: Any = None,
    sp_size: int | None = None,
    sp_rank: int | None = None,
    pad_token_id: int = PAD_TOKEN_ID,
) -> tuple[dict, OutputArgs]:
    """Nested micro-batch -> (model kwargs for one packed row, :class:`OutputArgs`). No host sync.

    ``micro_batch`` (TensorDict or dict) holds nested ``input_ids`` (B, j) and ``position_ids``
    (B, j) or (B, C, j). mrope ids go to the model as (4, 1, T): 3-row ids get each token's
    position in its own sequence prepended as row 0, where Qwen2/3-VL look for packed boundaries
    (an mrope model given 1-row ids sees no boundaries at all: :func:`check_isolation` shows it).
    ``temperature``: a float or a (B,) tensor; when None, the micro-batch's ``temperature`` entry,
    else 1.0 (a CPU tensor is checked > 0).
    ``attn_implementation`` (the model's ``config._attn_implementation``): when it names a flash
    kernel, or under Ulysses, the kwargs also carry ``cu_seq_lens_q/k`` (int32, ending at T_pad)
    and ``max_length_q/k`` (ints; a sync only if the nested tensors lost their cached max length).
    ``pad_to_multiple`` pads the row to a bucket multiple; ``sp_size > 1`` pads to a multiple of it
    too and keeps rank ``sp_rank``'s slice. Pad tokens are ``pad_token_id`` with position ids
    0, 1, ... so transformers sees them as one more sequence, attended by no real token.
    """
    input_ids, position_ids = _checked_nested(micro_batch)
    sp_size, sp_rank = _sp_size_rank(sp_group, sp_size, sp_rank)
    if pad_to_multiple < 1:
        raise _fail("pad_to_multiple", None, "an int >= 1", f"{pad_to_multiple}")
    if sp_size > 1 and attn_implementation is not None and not attn_implementation.startswith(ULYSSES_PREFIX):
        raise _fail(
            "attn_implementation",
            None,
            f"a Ulysses wrapper ('{ULYSSES_PREFIX}*', see enable_ulysses) for sp_size {sp_size}",
            repr(attn_implementation),
        )
    plan = IndexPlan.from_nested(input_ids)
    total = plan.total
    if total == 0:
        raise _fail("input_ids", None, "at least one token in the micro-batch", "0 tokens")
    padded_total = padded_length(total, sp_size, pad_to_multiple)
    pad = padded_total - total
    device = input_ids.device

    ids, positions = input_ids.values(), position_ids.values()  # (T,), (T,) or (C, T)
    if positions.dim() == 2 and positions.shape[0] == 3:
        # Qwen2/3-VL find packed boundaries only in row 0 of 4-row position ids: prepend the text positions.
        positions = torch.cat([plan.position_ids.to(device=device, dtype=positions.dtype).unsqueeze(0), positions])
    labels = torch.roll(ids, shifts=-1)
    # The last token of each sequence has no next token of its own: its label belongs to no one.
    # (An empty row's "last token" wraps onto the previous row's, which is already excluded.)
    label_mask = _pad_last(~plan.last_token_mask.to(device), pad, False)
    if temperature is None:
        temperature = get_field(micro_batch, "temperature")
    temps = _token_temperature(temperature, plan, device)

    ids, labels = _pad_last(ids, pad, pad_token_id), _pad_last(labels, pad, pad_token_id)
    positions = _pad_last(positions, pad, torch.arange(pad, device=device, dtype=positions.dtype))
    if isinstance(temps, Tensor):
        temps = _pad_last(temps, pad, 1.0)
    if sp_size > 1:
        ids, labels, positions = (slice_for_rank(t, sp_size, sp_rank) for t in (ids, labels, positions))
        temps = slice_for_rank(temps, sp_size, sp_rank) if isinstance(temps, Tensor) else temps

    model_inputs: dict[str, Any] = {
        "input_ids": ids.unsqueeze(0),
        "position_ids": positions.unsqueeze(-2),  # (1, L) or (C, 1, L)
        "use_cache": False,
    }
    if sp_size > 1 or (attn_implementation is not None and "flash" in attn_implementation):
        cu_seqlens = plan.cu_seqlens.to(device)
        if pad:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), padded_total)])
        max_length = max(plan.max_seqlen, pad)
        model_inputs.update(
            cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_length, max_length_k=max_length
        )
    if sp_size > 1:
        model_inputs[SP_GROUP_KWARG] = sp_group
    args = OutputArgs(
        plan=plan,
        labels=labels,
        temperature=temps,
        label_mask=label_mask,
        padded_total=padded_total,
        sp_group=sp_group,
        sp_size=sp_size,
    )
    return model_inputs, args


def _sp_size_rank(group, sp_size: int | None, sp_rank: int | None) -> tuple[int, int]:
    if group is not None:
        import torch.distributed as dist

        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (sp_size is not None and sp_size != size) or (sp_rank is not None and sp_rank != rank):
            raise _fail("sp_size/sp_rank", None, f"the group's size {size} and rank {rank}", f"{sp_size}/{sp_rank}")
        return size, rank
    sp_size, sp_rank = sp_size or 1, sp_rank or 0
    if sp_size > 1:
        raise _fail("sp_group", None, f"a process group for sp_size {sp_size}", "None")
    return sp_size, sp_rank


# ---- log-probs and entropy ------------------------------------------------------------------


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


def token_log_probs(
    logits: Tensor, labels: Tensor, temperature: Tensor | float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(L, V) logits, (L,) labels, float or (L,) temperature -> (L,) log-probs and optional (L,) entropy.

    Float32 results. One extra (L, V) buffer in the forward (see :class:`_TokenLogProbs`).
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise _fail("logits", None, f"(tokens, vocab) matching labels {tuple(labels.shape)}", f"{tuple(logits.shape)}")
    dtype = torch.promote_types(logits.dtype, torch.float32)  # fp64 logits keep fp64 temperatures
    if isinstance(temperature, Tensor):
        inv_temp = temperature.to(device=logits.device, dtype=dtype).reciprocal().unsqueeze(-1)
    else:
        inv_temp = torch.full((1, 1), 1.0 / float(temperature), device=logits.device, dtype=dtype)
        inv_temp = inv_temp.expand(logits.shape[0], 1)
    return _TokenLogProbs.apply(logits, labels, inv_temp, with_entropy)


def prepare_model_outputs(
    logits: Any,
    output_args: OutputArgs,
    micro_batch=None,
    *,
    calculate_entropy: bool = False,
) -> dict[str, Tensor]:
    """Model output -> {"log_probs": nested (B, j), "entropy": nested (B, j) if asked}. No host sync.

    ``logits``: (1, L, V) or an object with ``.logits``. Log-probs are of the rolled labels at the
    given temperature; the last token of each sequence gets 0 (its label belongs to no sequence).
    Under Ulysses the per-rank results are all-gathered over ``sp_group``; the pad is stripped.
    ``micro_batch`` is accepted for verl's signature and not needed.
    """
    logits = getattr(logits, "logits", logits)
    args = output_args
    local = args.labels.shape[0]
    if logits.dim() != 3 or logits.shape[:2] != (1, local):
        raise _fail("logits", None, f"(1, {local}, vocab) for this rank's packed row", f"{tuple(logits.shape)}")
    log_probs, entropy = token_log_probs(logits[0], args.labels, args.temperature, calculate_entropy)
    if args.sp_size > 1:
        log_probs = gather_seq(log_probs, args.sp_group, dim=0)
        entropy = gather_seq(entropy, args.sp_group, dim=0) if entropy is not None else None
    total = args.plan.total
    log_probs = torch.where(args.label_mask[:total], log_probs[:total], log_probs.new_zeros(()))
    out = {"log_probs": args.plan.to_nested(log_probs)}
    if entropy is not None:
        out["entropy"] = args.plan.to_nested(entropy[:total])
    return out


# ---- convenience ----------------------------------------------------------------------------


def _attn_implementation(model: torch.nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


@overload
def packed_logprobs(
    model: torch.nn.Module,
    micro_batch,
    temperature: float | Tensor = ...,
    *,
    calculate_entropy: Literal[False] = ...,
    **input_kwargs,
) -> Tensor: ...


@overload
def packed_logprobs(
    model: torch.nn.Module,
    micro_batch,
    temperature: float | Tensor = ...,
    *,
    calculate_entropy: Literal[True],
    **input_kwargs,
) -> dict[str, Tensor]: ...


def packed_logprobs(
    model: torch.nn.Module,
    micro_batch,
    temperature: float | Tensor = 1.0,
    *,
    calculate_entropy: bool = False,
    **input_kwargs,
) -> Tensor | dict[str, Tensor]:
    """Nested micro-batch -> nested (B, j) log-probs from ONE packed forward of ``model``.

    ``input_kwargs`` go to :func:`prepare_model_inputs` (pad_to_multiple, sp_group, ...). With
    ``calculate_entropy`` returns the dict of :func:`prepare_model_outputs` instead.
    """
    inputs, args = prepare_model_inputs(
        micro_batch, temperature=temperature, attn_implementation=_attn_implementation(model), **input_kwargs
    )
    out = prepare_model_outputs(model(**inputs), args, micro_batch, calculate_entropy=calculate_entropy)
    return out if calculate_entropy else out["log_probs"]


def padded_logprobs(model: torch.nn.Module, padded: TensorDict, temperature: float | Tensor = 1.0) -> Tensor:
    """The reference: a padded forward (attention_mask, left-padded prompts) -> (B, R) response log-probs.

    ``padded`` holds input_ids (B, S), attention_mask (B, S), response_mask (B, R), position_ids
    (B, S) or (B, C, S). Entries where response_mask is 0 are 0. Materialises (B, R, V) log-softmax:
    a reference, not a hot path.
    """
    input_ids, attention_mask, response_mask = padded["input_ids"], padded["attention_mask"], padded["response_mask"]
    position_ids = padded["position_ids"]
    if position_ids.dim() == 3:
        position_ids = position_ids.transpose(0, 1)  # (C, B, S), as mrope models take it
    R = response_mask.shape[1]
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits
    scaled = logits[:, -R - 1 : -1].float()
    if isinstance(temperature, Tensor):
        scaled = scaled / temperature.to(scaled).view(-1, 1, 1)
    else:
        scaled = scaled / float(temperature)
    log_probs = scaled.log_softmax(-1).gather(-1, input_ids[:, -R:].unsqueeze(-1)).squeeze(-1)
    return torch.where(response_mask.bool(), log_probs, log_probs.new_zeros(()))


from nopad.leak import IsolationReport, check_isolation, probe_batch  # noqa: E402  (the probe is part of the adapter)

__all__ = [
    "IsolationReport",
    "OutputArgs",
    "check_isolation",
    "packed_logprobs",
    "padded_logprobs",
    "prepare_model_inputs",
    "prepare_model_outputs",
    "probe_batch",
    "token_log_probs",
]
