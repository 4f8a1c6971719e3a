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

Needs the ``hf`` extra (transformers) only for Ulysses (:func:`nopad.parallel.enable_ulysses`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import torch
from tensordict import TensorDict
from torch import Tensor

from nopad.core._batch import check_choice, check_real_dtype, check_transformers_model, get_field
from nopad.core._errors import check_flag, check_int, check_integer_tensor, check_optional_int, input_error
from nopad.core._layout import (
    IndexPlan,
    bucket_length,
    check_nested,
    jagged_values,
    nested_offsets,
    position_ids_of,
    ragged_dim,
)
from nopad.core._torch_internals import wrap_jagged
from nopad.engines._head import head_forward
from nopad.engines._prefixes import (
    PLAN_KWARG,
    on_rows,
    shared_prefix_inputs,
    shared_prefix_logprobs,
    switched_to_shared_attention,
)
from nopad.modeling._attention import KERNELS, packed_attention, reads_boundaries
from nopad.modeling._logprobs import (
    TOKENS,
    ScoredTokens,
    check_label_range,
    checked_temperature,
    default_tile,
    logits_log_probs,
    scored_tokens,
)
from nopad.parallel._ulysses import SP_GROUP_KWARG, ULYSSES_PREFIX, gather_seq, padded_length, slice_for_rank

PAD_TOKEN_ID = 0
HEADS = ("auto", "chunked", "logits")


@dataclass
class OutputArgs:
    """What :func:`prepare_model_outputs` needs besides the logits; built by :func:`prepare_model_inputs`.

    labels / temperature are this rank's slice (L,) of the padded row; label_mask (T_pad,) is False
    at the last token of every sequence and at the pad; ``plan`` is the micro-batch's index plan;
    ``padded_total`` = T_pad; ``sp_group`` / ``sp_size`` / ``sp_rank`` as given. ``micro_batch`` and
    its nested ``input_ids`` say which tokens a loss reads (:meth:`scored`); ``model_input_ids`` is
    the (1, L) tensor handed to the model, by which a forward shows it is this micro-batch's.
    ``shared``: with ``share_prefixes``, the shared-prefix plan of the row (then L = T, the packed
    row's tokens; ``labels`` are the packed tokens themselves, scored at the response tokens' own
    positions from the states before them, and only ``tokens="response"`` is served).
    """

    plan: IndexPlan
    labels: Tensor
    temperature: Tensor | float
    label_mask: Tensor
    padded_total: int
    sp_group: Any = None
    sp_size: int = 1
    sp_rank: int = 0
    micro_batch: Any = None
    input_ids: Tensor | None = None
    model_input_ids: Tensor | None = None
    shared: Any = None
    _scored: list = field(default_factory=list, repr=False)  # (choice, its object, what it gave), found by identity

    @property
    def real_tokens(self) -> int:
        """How many of this rank's ``L`` tokens are real (the rest are the row's pad at its end)."""
        local = self.labels.shape[0]
        return max(0, min(local, self.plan.total - self.sp_rank * local))

    def scored(self, tokens: str, score_mask: Tensor | None) -> ScoredTokens | None:
        """The positions of the row (its T real tokens) to score, or None for all (see
        :func:`nopad.modeling._logprobs.scored_tokens`); worked out once per choice, so the head and the
        outputs of one forward share them. Under shared prefixes, the responses only (made with the row)."""
        if self.shared is not None and (tokens != "response" or score_mask is not None):
            name, got = ("tokens", repr(tokens)) if tokens != "response" else ("score_mask", "a mask")
            expected = "'response' and no score_mask for inputs prepared with share_prefixes (responses are scored)"
            raise input_error(name, None, expected, got)
        for choice, given, found in self._scored:
            if given is score_mask and isinstance(tokens, str) and choice == tokens:
                return found
        found = None if self.input_ids is None else scored_tokens(tokens, score_mask, self.micro_batch, self.input_ids)
        self._scored.append((tokens, score_mask, found))
        return found

    def local_scored(self, scored: ScoredTokens | None) -> ScoredTokens | None:
        """``scored`` on this rank's L slots of the padded row (None: every real slot); one object per choice."""
        if scored is None or self.sp_size == 1:
            return scored
        for choice, given, found in self._scored:
            if choice == "local" and given is scored:
                return found
        local = self.labels.shape[0]
        found = scored.shifted(self.sp_rank * local, local)
        self._scored.append(("local", scored, found))
        return found


def _checked_nested(micro_batch) -> tuple[Tensor, Tensor]:
    input_ids, position_ids = get_field(micro_batch, "input_ids"), get_field(micro_batch, "position_ids")
    input_ids = check_nested(input_ids, "input_ids", ragged_dim=None)  # the output of left_right_2_no_padding
    check_integer_tensor(jagged_values(input_ids), "input_ids")  # float ids would be cut to other tokens
    position_ids = check_nested(position_ids, "position_ids", ragged_dim=None)
    if input_ids.dim() != 2 or ragged_dim(input_ids) != 1:
        raise input_error(
            "input_ids",
            None,
            "nested (batch, j) ragged on dim 1",
            f"{input_ids.dim()} dims, ragged dim {ragged_dim(input_ids)}",
        )
    total = jagged_values(input_ids).shape[0]
    expected_ragged = 1 if position_ids.dim() == 2 else 2
    pos_ragged = ragged_dim(position_ids)
    pos_total = jagged_values(position_ids).shape[pos_ragged - 1]
    if pos_ragged != expected_ragged or position_ids.dim() not in (2, 3) or pos_total != total:
        raise input_error(
            "position_ids",
            None,
            f"nested (batch, j) or (batch, C, j) with {total} tokens like input_ids",
            f"{position_ids.dim()} dims, ragged dim {pos_ragged}, {pos_total} tokens",
        )
    ids_offsets, pos_offsets = nested_offsets(input_ids), nested_offsets(position_ids)
    # left_right_2_no_padding shares one offsets tensor; comparing values (a sync) only when they differ.
    if pos_offsets is not ids_offsets and not torch.equal(pos_offsets, ids_offsets):
        raise input_error(
            "position_ids",
            None,
            "the same sequence boundaries as input_ids",
            f"offsets {pos_offsets.tolist()} vs {ids_offsets.tolist()}",
        )
    return input_ids, position_ids


def _token_temperature(temperature, plan: IndexPlan, device) -> Tensor | float:
    """A Python float stays a float (no (T,) tensor); a (B,) or 0-d tensor expands per token."""
    rows = plan.row_ids.to(device) if isinstance(temperature, Tensor) else None  # (T,) made only when read
    return checked_temperature(1.0 if temperature is None else temperature, plan.batch_size, rows)


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
    bucket: int | None = None,
    sp_group: Any = None,
    sp_size: int | None = None,
    sp_rank: int | None = None,
    pad_token_id: int = PAD_TOKEN_ID,
    share_prefixes: bool = False,
) -> tuple[dict, OutputArgs]:
    """Nested micro-batch -> (model kwargs for one packed row, :class:`OutputArgs`). No host sync.

    ``micro_batch`` (TensorDict or dict) holds nested ``input_ids`` (B, j) and ``position_ids``
    (B, j) or (B, C, j). mrope ids go to the model as (4, 1, T): 3-row ids get each token's
    position in its own sequence prepended as row 0, where Qwen2/3-VL look for packed boundaries
    (an mrope model given 1-row ids sees no boundaries at all: :func:`check_isolation` shows it).
    ``temperature``: a float or a (B,) tensor; when None, the micro-batch's ``temperature`` entry,
    else 1.0. A float and a CPU tensor must be finite and > 0 (ValueError naming the row); a
    device tensor is not read, a bad row gives NaN log-probs instead (see :func:`temperature_tensor`).
    ``attn_implementation`` (the model's ``config._attn_implementation``): when it reads packed
    boundaries (flash-attn's, ``nopad_varlen``), or under Ulysses, the kwargs also carry
    ``cu_seq_lens_q/k`` (int32, ending at T_pad) and ``max_length_q/k`` (ints; a sync only if the
    nested tensors lost their cached max length).
    ``pad_to_multiple`` pads the row to a bucket multiple; ``sp_size > 1`` pads to a multiple of it
    too and keeps rank ``sp_rank``'s slice. Pad tokens are ``pad_token_id`` with position ids
    0, 1, ... so transformers sees them as one more sequence, attended by no real token.
    ``bucket`` (opt-in: a forward then sees few row lengths) first rounds the T
    tokens up to the next multiple of ``max(bucket, 2**(floor(log2 T) - 5))``: under ``bucket``
    tokens of padding on rows under 64 buckets, under 1/32 of the row on longer ones (see
    :func:`nopad.core._layout.bucket_length`). The bucket's pad is that same dummy sequence, its
    outputs dropped before anything reads them.

    ``share_prefixes=True`` lays the row out with each group's shared prompt once (GRPO's n samples
    of a prompt; groups found from the tokens, as ``packed_logprobs(..., share_prefixes=True)``
    finds them): the kwargs are ``input_ids`` (1, T) the rows packed in the plan's order,
    ``position_ids`` (1, T) each token's position in its own row, the plan under
    ``shared_prefixes`` and ``use_cache=False``, and :func:`prepare_model_outputs` (and
    :func:`chunked_head`) given ``tokens="response"`` returns what the plain layout gives at the
    response positions (0 elsewhere). The model must run that forward with its attention switched to
    ``nopad_shared`` (any other attention silently mixes the rows of a group): run it inside
    ``chunked_head(model, output_args, head, tokens="response")``, which switches it for the block
    (``head="logits"`` to keep the model's logits); nopad has no other public switch. Refused by name:
    ``sp_size > 1`` (one unsplit row), ``pad_to_multiple > 1`` or a ``bucket`` (the row is not padded), 3-row
    (mrope) position ids, a micro-batch with no response fields; position ids that do not count
    each row from 0 give NaN results. ``attn_implementation`` is not read.
    """
    input_ids, position_ids = _checked_nested(micro_batch)
    share_prefixes = check_flag(share_prefixes, "share_prefixes")
    if share_prefixes and (sp_group is not None or sp_size not in (None, 1)):
        got = f"sp_size {sp_size}" if sp_group is None else "an sp_group"
        raise input_error("sp_size", None, "1 with share_prefixes (one unsplit row, no Ulysses)", got)
    sp_size, sp_rank = _sp_size_rank(sp_group, sp_size, sp_rank)
    pad_to_multiple, pad_token_id = _checked_row_options(attn_implementation, pad_to_multiple, pad_token_id, sp_size)
    if share_prefixes:
        if temperature is None:
            temperature = get_field(micro_batch, "temperature", 1.0)
        return _shared_prefix_inputs(micro_batch, input_ids, position_ids, temperature, pad_to_multiple, bucket)
    plan = _row_plan(input_ids)
    bucketed = plan.total if bucket is None else bucket_length(plan.total, check_int(bucket, "bucket", low=1))
    padded_total = padded_length(bucketed, sp_size, pad_to_multiple)
    pad = padded_total - plan.total
    ids = jagged_values(input_ids)  # (T,)
    device = ids.device  # the values' (the nested tensor's own device costs a Python dispatch)
    positions = _model_positions(plan, jagged_values(position_ids), device)
    labels, label_mask = _next_token_labels(plan, ids, pad_token_id, pad, device)
    if temperature is None:
        temperature = get_field(micro_batch, "temperature")
    temps = _token_temperature(temperature, plan, device)
    ids, labels, positions, temps = _rank_row(ids, labels, positions, temps, pad, pad_token_id, sp_size, sp_rank)
    model_inputs = _model_kwargs(ids, positions, plan, padded_total, attn_implementation, sp_group, sp_size)
    args = OutputArgs(
        plan=plan,
        labels=labels,
        temperature=temps,
        label_mask=label_mask,
        padded_total=padded_total,
        sp_group=sp_group,
        sp_size=sp_size,
        sp_rank=sp_rank,
        micro_batch=micro_batch,
        input_ids=input_ids,
        model_input_ids=model_inputs["input_ids"],
    )
    return model_inputs, args


def _shared_prefix_inputs(
    micro_batch: Any,
    input_ids: Tensor,
    position_ids: Tensor,
    temperature: float | Tensor,
    pad_to_multiple: int,
    bucket: int | None,
) -> tuple[dict, OutputArgs]:
    """:func:`prepare_model_inputs` with ``share_prefixes=True`` (no sequence parallelism, checked
    there): one unpadded row of 1-row position ids."""
    if pad_to_multiple > 1:
        expected = "1 with share_prefixes (the row is not padded)"
        raise input_error("pad_to_multiple", None, expected, str(pad_to_multiple))
    if bucket is not None:
        raise input_error("bucket", None, "None with share_prefixes (the row is not padded)", repr(bucket))
    _check_one_row_positions(position_ids)
    plan = _row_plan(input_ids)
    kwargs, scored, temps = shared_prefix_inputs(micro_batch, input_ids, temperature)
    packed = kwargs["input_ids"]
    args = OutputArgs(
        plan=plan,
        labels=packed[0],
        temperature=temps,
        label_mask=torch.ones_like(packed[0], dtype=torch.bool),
        padded_total=packed.shape[1],
        micro_batch=micro_batch,
        input_ids=input_ids,
        model_input_ids=packed,
        shared=kwargs[PLAN_KWARG],
        _scored=[("response", None, scored)],
    )
    return kwargs, args


def _check_one_row_positions(position_ids: Tensor) -> None:
    if position_ids.dim() != 2:
        raise input_error("position_ids", None, "1-row (batch, j) ids with share_prefixes", "multi-row (mrope) ids")


def _checked_row_options(
    attn_implementation: Any, pad_to_multiple: Any, pad_token_id: Any, sp_size: int
) -> tuple[int, int]:
    """``pad_to_multiple`` (>= 1) and ``pad_token_id`` (>= 0) checked; ``attn_implementation`` None or
    a name, and a Ulysses wrapper's under sequence parallelism (any other attention would see only
    this rank's slice of the row)."""
    pad_to_multiple = check_int(pad_to_multiple, "pad_to_multiple", low=1)
    pad_token_id = check_int(pad_token_id, "pad_token_id", low=0)
    if attn_implementation is not None and not isinstance(attn_implementation, str):
        raise input_error("attn_implementation", None, "None or a name (str)", repr(attn_implementation))
    if sp_size > 1 and attn_implementation is not None and not attn_implementation.startswith(ULYSSES_PREFIX):
        raise input_error(
            "attn_implementation",
            None,
            f"a Ulysses wrapper ('{ULYSSES_PREFIX}*', see enable_ulysses) for sp_size {sp_size}",
            repr(attn_implementation),
        )
    return pad_to_multiple, pad_token_id


def _row_plan(input_ids: Tensor) -> IndexPlan:
    """The index plan of nested (B, j) ``input_ids``, which must hold a token: a row of none gives the
    model nothing to run."""
    plan = IndexPlan.from_nested(input_ids)
    if plan.total == 0:
        raise input_error("input_ids", None, "at least one token in the micro-batch", "0 tokens")
    return plan


def _model_positions(plan: IndexPlan, positions: Tensor, device: torch.device) -> Tensor:
    """(T,) or (C, T) position ids -> as the model reads them: 3-row mrope ids become (4, T).

    Qwen2/3-VL find packed boundaries only in row 0 of 4-row position ids, so each token's position in
    its own sequence (the text positions) is prepended."""
    if positions.dim() == 2 and positions.shape[0] == 3:
        positions = torch.cat([plan.position_ids.to(device=device, dtype=positions.dtype).unsqueeze(0), positions])
    return positions


def _next_token_labels(
    plan: IndexPlan, ids: Tensor, pad_token_id: int, pad: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """(T,) each token's next token, and (T + pad,) where a label is real.

    The last token of each sequence has no next token of its own: its label slot holds the pad id and
    the mask is False there, and at the row's pad. (An empty row's "last token" wraps onto the
    previous row's, which is already excluded.)"""
    labels = plan.next_token_labels(ids, pad_token_id)
    label_mask = _pad_last(~plan.last_token_mask.to(device), pad, False)
    return labels, label_mask


def _rank_row(
    ids: Tensor,
    labels: Tensor,
    positions: Tensor,
    temps: Tensor | float,
    pad: int,
    pad_token_id: int,
    sp_size: int,
    sp_rank: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor | float]:
    """The row padded by ``pad`` tokens, then this rank's slice of it (L = T_pad / sp_size).

    Args:
        ids: (T,) token ids; the pad is ``pad_token_id``.
        labels: (T,) next-token labels; the pad is ``pad_token_id``.
        positions: (T,) or (C, T) position ids; the pad's are 0, 1, ..., so transformers sees one more
            sequence, attended by no real token.
        temps: (T,) per-token temperatures (the pad's are 1.0), or a float, which stays as it is.

    Returns:
        ids (L,), labels (L,), positions (L,) or (C, L), temps (L,) or the float.
    """
    ids, labels = _pad_last(ids, pad, pad_token_id), _pad_last(labels, pad, pad_token_id)
    positions = _pad_last(positions, pad, torch.arange(pad, device=ids.device, dtype=positions.dtype))
    if isinstance(temps, Tensor):
        temps = _pad_last(temps, pad, 1.0)
    if sp_size > 1:
        ids, labels, positions = (slice_for_rank(t, sp_size, sp_rank) for t in (ids, labels, positions))
        temps = slice_for_rank(temps, sp_size, sp_rank) if isinstance(temps, Tensor) else temps
    return ids, labels, positions, temps


def _model_kwargs(
    ids: Tensor,
    positions: Tensor,
    plan: IndexPlan,
    padded_total: int,
    attn_implementation: str | None,
    sp_group: Any,
    sp_size: int,
) -> dict[str, Any]:
    """The model's kwargs for this rank's (L,) slice of the packed row: no attention mask and no
    cache (transformers then finds the boundaries where position ids restart), plus the boundaries
    themselves (ending at T_pad: the pad is one more sequence) where the attention reads them or
    Ulysses gathers the row, and the sequence-parallel group."""
    model_inputs: dict[str, Any] = {
        "input_ids": ids.unsqueeze(0),
        "position_ids": positions.unsqueeze(-2),  # (1, L) or (C, 1, L)
        "use_cache": False,
    }
    if sp_size > 1 or reads_boundaries(attn_implementation):
        pad = padded_total - plan.total
        cu_seqlens = plan.cu_seqlens.to(ids.device)
        if pad:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), padded_total)])
        max_length = max(plan.max_seqlen, pad)
        model_inputs.update(
            cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_length, max_length_k=max_length
        )
    if sp_size > 1:
        model_inputs[SP_GROUP_KWARG] = sp_group
    return model_inputs


def _sp_size_rank(group, sp_size: int | None, sp_rank: int | None) -> tuple[int, int]:
    if group is not None:
        import torch.distributed as dist

        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (sp_size is not None and sp_size != size) or (sp_rank is not None and sp_rank != rank):
            raise input_error(
                "sp_size/sp_rank", None, f"the group's size {size} and rank {rank}", f"{sp_size}/{sp_rank}"
            )
        return size, rank
    sp_size = 1 if sp_size is None else check_int(sp_size, "sp_size", low=1)
    sp_rank = 0 if sp_rank is None else check_int(sp_rank, "sp_rank", low=0, high=sp_size - 1)
    if sp_size > 1:
        raise input_error("sp_group", None, f"a process group for sp_size {sp_size}", "None")
    return sp_size, sp_rank


# ---- log-probs and entropy ------------------------------------------------------------------


@contextmanager
def chunked_head(
    model: torch.nn.Module,
    output_args: OutputArgs,
    head: str = "auto",
    *,
    calculate_entropy: bool = False,
    chunk_size: int | None = None,
    tokens: str = "all",
    score_mask: Tensor | None = None,
) -> Iterator[torch.nn.Module]:
    """Within the block, ``model(**model_inputs)`` returns per-token log-probs instead of logits.

    The model's own forward runs (inside FSDP's hooks when sharded: the weight is whole while the
    head uses it); only its output layer is replaced, by :func:`head_log_probs` on the hidden states
    of the tokens a loss reads, so no (L, V) logits exist. The forward then returns an object with
    ``log_probs`` (1, L) and ``entropy`` (1, L) (when ``calculate_entropy``), which
    :func:`prepare_model_outputs` takes like logits. ``head``: "chunked" requires it (ValueError
    naming why a model is not served), "auto" uses it wherever it serves the model and returns the
    model's logits otherwise, "logits" changes nothing.

    ``tokens`` / ``score_mask``: which positions the head scores (pass the same to
    :func:`prepare_model_outputs`). "all" (the default) scores every token: nothing a caller reads
    changes. "response" scores the positions :func:`no_padding_2_padding` reads for an RL micro-batch
    (position t - 1 for response token t), so ``no_padding_2_padding`` and the PPO losses read the
    same values as with "all"; a ``score_mask`` scores the positions it marks (for an SFT loss: a
    packed file's label-aligned ``token_mask``, or a per-token ``loss_mask`` moved to the positions
    that predict its tokens, ``IndexPlan.next_token_labels`` of it).
    The head runs on those rows only (one gather; no host sync for "response", one for a mask: its
    count); every other position holds 0 with a zero gradient, and a micro-batch with no scored token
    runs no head. The model's own layers still run on every token.

    ``output_args`` must be those :func:`prepare_model_inputs` made for the kwargs the model is called
    with: ``input_ids`` of another micro-batch are refused (compared on the host where free; on a
    device, another tensor than the one prepared is compared there and the results become NaN if it
    differs, without a sync).

    Served: an output layer that is a plain ``torch.nn.Linear`` (bias or not, tied or not), with
    soft-capping (Gemma 2/3's ``final_logit_softcapping``) or a scaled head (Cohere's
    ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's ``lm_head_multiplier``) read from
    the model. The forward hands the model a (1, L, 3) stand-in for the logits and checks what the
    model makes of it: anything it does to the logits beyond what was read is refused, never
    ignored (checked on the first forward, one host sync when the model post-processes its logits).

    For inputs prepared with ``share_prefixes=True`` the block also switches the model's attention to
    ``nopad_shared`` (and back on leaving it), which the shared-prefix row needs; with
    ``head="logits"`` that is all it does. Only ``tokens="response"`` is served there, and a model
    whose layers are checkpointed is refused under autograd (their backward would recompute them
    after the block, under the attention switched back).
    """
    args = _checked_output_args(output_args)
    head = check_choice(head, "head", HEADS)
    calculate_entropy = check_flag(calculate_entropy, "calculate_entropy")
    chunk_size = check_optional_int(chunk_size, "chunk_size", low=1)
    scored = args.scored(tokens, score_mask)
    switched = nullcontext() if args.shared is None else switched_to_shared_attention(model)
    with switched, _chunked_head(model, args, head, calculate_entropy, chunk_size, scored) as served:
        yield served


@contextmanager
def _chunked_head(
    model: torch.nn.Module,
    args: OutputArgs,
    head: str,
    calculate_entropy: bool,
    chunk_size: int | None,
    scored: ScoredTokens | None,
) -> Iterator[torch.nn.Module]:
    """:func:`chunked_head` of checked arguments."""
    if head == "logits":
        yield model
        return
    tile = None
    if chunk_size is not None:
        tile = (chunk_size, default_tile(args.labels.device)[1])
    with head_forward(
        model,
        args.labels,
        args.temperature,
        args.real_tokens,
        with_entropy=calculate_entropy,
        required=head == "chunked",
        tile=tile,
        scored=args.local_scored(scored),
        input_ids=args.model_input_ids,
    ) as served:
        yield served


def _checked_output_args(output_args: Any) -> OutputArgs:
    if not isinstance(output_args, OutputArgs):
        raise input_error("output_args", None, "the OutputArgs of prepare_model_inputs", type(output_args).__name__)
    return output_args


def prepare_model_outputs(
    logits: Any,
    output_args: OutputArgs,
    micro_batch=None,
    *,
    calculate_entropy: bool = False,
    tokens: str = "all",
    score_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Model output -> {"log_probs": nested (B, j), "entropy": nested (B, j) if asked}. No host sync.

    ``logits``: (1, L, V), an object with ``.logits``, or an object with per-token ``.log_probs``
    (1, L) and ``.entropy`` (1, L) for this rank's labels (what a forward under
    :func:`chunked_head` returns, or verl's fused-kernel output). Log-probs are of the rolled labels
    at the given temperature; the last token of each sequence gets 0 (its label belongs to no
    sequence). Under Ulysses the per-rank results are all-gathered over ``sp_group``; the pad is
    stripped. ``micro_batch`` is accepted for verl's signature (the one ``prepare_model_inputs``
    was given says which tokens a loss reads).

    ``tokens`` / ``score_mask`` as :func:`chunked_head` takes them (the same for both): log-probs and
    entropy are exact at the scored positions and 0 elsewhere (and from logits, computed at those
    rows only). The result keeps the nested (B, j) shape, so :func:`no_padding_2_padding` and the
    losses read it as before. A head output that scored fewer positions than asked is refused.
    For ``output_args`` of ``prepare_model_inputs(..., share_prefixes=True)``, ``logits`` are over
    the shared row (1, T, V) and only ``tokens="response"`` is served: each response token's
    log-prob (and entropy) is read from the logits of the position before it in its own row, and
    comes back nested on the micro-batch's rows as the plain layout gives it.
    """
    args = _checked_output_args(output_args)
    calculate_entropy = check_flag(calculate_entropy, "calculate_entropy")
    return _outputs(logits, args, calculate_entropy, args.scored(tokens, score_mask))


def _outputs(logits: Any, args: OutputArgs, calculate_entropy: bool, scored: ScoredTokens | None) -> dict[str, Tensor]:
    """:func:`prepare_model_outputs` of checked arguments."""
    local = args.labels.shape[0]
    if getattr(logits, "log_probs", None) is not None:
        theirs = getattr(logits, "scored", None)
        if theirs is not None and theirs is not args.local_scored(scored):
            asked = "every token" if scored is None else f"{scored.kind} tokens"
            raise input_error(
                "tokens",
                None,
                f"the tokens the head scored ({theirs.kind}): pass the same tokens / score_mask to chunked_head",
                asked,
            )
        log_probs, entropy = _per_token(logits, local, calculate_entropy)
    else:
        logits = getattr(logits, "logits", logits)
        check_real_dtype(logits, "logits", floating=True)
        if logits.dim() != 3 or logits.shape[:2] != (1, local):
            raise input_error(
                "logits", None, f"(1, {local}, vocab) for this rank's packed row", f"{tuple(logits.shape)}"
            )
        log_probs, entropy = _from_logits(logits[0], args, calculate_entropy, args.local_scored(scored))
    if args.shared is not None:
        return _shared_outputs(log_probs, entropy, args, scored)
    if args.sp_size > 1:
        log_probs = gather_seq(log_probs, args.sp_group, dim=0)
        entropy = gather_seq(entropy, args.sp_group, dim=0) if entropy is not None else None
    total = args.plan.total
    keep = args.label_mask[:total]
    log_probs, entropy = log_probs[:total], None if entropy is None else entropy[:total]
    if scored is not None:  # the fill, wherever the values came from (a head may score a superset)
        read = scored.mask().to(keep.device)
        keep = keep & read
        entropy = None if entropy is None else torch.where(read, entropy, entropy.new_zeros(()))
    log_probs = torch.where(keep, log_probs, log_probs.new_zeros(()))
    out = {"log_probs": args.plan.to_nested(log_probs)}
    if entropy is not None:
        out["entropy"] = args.plan.to_nested(entropy)
    return out


def _shared_outputs(
    log_probs: Tensor, entropy: Tensor | None, args: OutputArgs, scored: ScoredTokens | None
) -> dict[str, Tensor]:
    """(T,) values over the shared-prefix row, at the response tokens' own positions -> nested (B, j)
    on the rows, NaN unless each row's position ids count from 0 (as ``packed_logprobs`` gives them)."""
    assert scored is not None and args.input_ids is not None  # made with the row
    position_ids = get_field(args.micro_batch, "position_ids")
    out = {"log_probs": on_rows(log_probs, scored, args.shared, args.input_ids)}
    if entropy is not None:
        out["entropy"] = on_rows(entropy, scored, args.shared, args.input_ids)
    return {key: _counting_from_zero(value, position_ids) for key, value in out.items()}


def _from_logits(
    logits: Tensor, args: OutputArgs, calculate_entropy: bool, scored: ScoredTokens | None
) -> tuple[Tensor, Tensor | None]:
    """(L,) log-probs and entropy from this rank's (L, V) logits, at the scored rows only when they are fewer."""
    check_label_range(args.labels, logits.shape[-1])
    if scored is None or (scored.read is None and scored.count >= logits.shape[0]):
        return logits_log_probs(logits, args.labels, args.temperature, calculate_entropy)
    temperature = args.temperature
    if isinstance(temperature, Tensor):
        temperature = scored.rows(temperature)
    rows = scored.hidden_rows(logits)  # the logits of each scored row's read position
    log_probs, entropy = logits_log_probs(rows, scored.rows(args.labels), temperature, calculate_entropy)
    length = logits.shape[0]
    return scored.place(log_probs, length), None if entropy is None else scored.place(entropy, length)


def _per_token(output: Any, local: int, calculate_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """(L,) log-probs and entropy (when asked) from an output that carries them as (1, L)."""
    found = {"log_probs": output.log_probs, "entropy": getattr(output, "entropy", None) if calculate_entropy else None}
    for name, value in found.items():
        if value is None and name == "entropy" and calculate_entropy:
            raise input_error("entropy", None, "per-token entropy in the model output (calculate_entropy=True)", "none")
        if value is None:
            continue
        check_real_dtype(value, name, floating=True)
        if value.shape != (1, local):
            raise input_error(name, None, f"(1, {local}) for this rank's packed row", f"{tuple(value.shape)}")
    entropy = found["entropy"]
    return found["log_probs"][0], None if entropy is None else entropy[0]


# ---- a value head ---------------------------------------------------------------------------


def prepare_value_outputs(values: Any, output_args: OutputArgs, micro_batch=None) -> dict[str, Tensor]:
    """A critic's per-token output on the packed row -> {"values": nested (B, j)}, what
    :func:`nopad.losses.value_loss` takes as its ``model_output``. No host sync.

    ``values``: this rank's (1, L) or (1, L, 1) tensor, or a model output whose ``.logits`` is one
    (a ``...ForTokenClassification`` critic with ``num_labels=1``), from a forward on the kwargs of
    :func:`prepare_model_inputs`, whose :class:`OutputArgs` is ``output_args``. Position t holds the
    value of the sequence up to token t, as the model computed it (no shift: the value loss reads
    the values of the positions before each response token, as it reads log-probs). Under Ulysses
    the per-rank slices are all-gathered over ``sp_group`` (the gradient flows back to each rank's
    slice); the row's pad (``pad_to_multiple``, the SP multiple) is stripped. float32 (float64
    stays float64), on the batch's offsets. ``micro_batch`` is accepted for verl's signature.
    """
    if not isinstance(output_args, OutputArgs):
        raise input_error("output_args", None, "the OutputArgs of prepare_model_inputs", type(output_args).__name__)
    args = output_args
    if args.shared is not None:
        expected = "the OutputArgs of prepare_model_inputs without share_prefixes (a critic scores every row's tokens)"
        raise input_error("output_args", None, expected, "those of a shared-prefix row")
    values = getattr(values, "logits", values)
    if not isinstance(values, Tensor) or getattr(values, "is_nested", False):
        raise input_error("values", None, "a (1, L) or (1, L, 1) tensor of per-token values", type(values).__name__)
    check_real_dtype(values, "values", floating=True)
    local = args.labels.shape[0]
    if values.dim() == 3 and values.shape[-1] == 1:
        values = values[..., 0]
    if values.shape != (1, local):
        raise input_error(
            "values",
            None,
            f"(1, {local}) or (1, {local}, 1): one value per token of this rank's packed row",
            f"{tuple(values.shape)}",
        )
    flat = values[0] if values.dtype == torch.float64 else values[0].float()
    if args.sp_size > 1:
        flat = gather_seq(flat, args.sp_group, dim=0)
    return {"values": args.plan.to_nested(flat[: args.plan.total])}


# ---- convenience ----------------------------------------------------------------------------


def _attn_implementation(model: torch.nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


@overload
def packed_logprobs(
    model: torch.nn.Module,
    micro_batch,
    temperature: float | Tensor | None = ...,
    *,
    calculate_entropy: Literal[False] = ...,
    attention: str | None = ...,
    head: str = ...,
    chunk_size: int | None = ...,
    tokens: str = ...,
    score_mask: Tensor | None = ...,
    share_prefixes: bool = ...,
    **input_kwargs,
) -> Tensor: ...


@overload
def packed_logprobs(
    model: torch.nn.Module,
    micro_batch,
    temperature: float | Tensor | None = ...,
    *,
    calculate_entropy: Literal[True],
    attention: str | None = ...,
    head: str = ...,
    chunk_size: int | None = ...,
    tokens: str = ...,
    score_mask: Tensor | None = ...,
    share_prefixes: bool = ...,
    **input_kwargs,
) -> dict[str, Tensor]: ...


def packed_logprobs(
    model: torch.nn.Module,
    micro_batch,
    temperature: float | Tensor | None = None,
    *,
    calculate_entropy: bool = False,
    attention: str | None = "auto",
    head: str = "auto",
    chunk_size: int | None = None,
    tokens: str = "all",
    score_mask: Tensor | None = None,
    share_prefixes: bool = False,
    **input_kwargs,
) -> Tensor | dict[str, Tensor]:
    """Nested micro-batch -> nested (B, j) log-probs from ONE packed forward of ``model``.

    ``attention``: "auto" runs a CUDA model whose attention does not read packed boundaries (sdpa,
    eager) through ``nopad_varlen`` for this forward (HF's own packed sdpa builds a dense block
    mask and is slower than padding); a kernel name (:data:`nopad.modeling._attention.KERNELS`) forces that
    kernel on any device; None runs the model's attention implementation as it is, which must read
    packed boundaries itself (flash-attn's, ``nopad_varlen``; sdpa or eager is a ValueError, see
    :func:`nopad.modeling.packed_attention`). The model is restored after.
    ``head``: "auto" computes log-probs (and entropy) with the chunked head wherever it serves the
    model, never holding (L, V) logits (see :func:`chunked_head`); "chunked" requires it; "logits"
    takes the model's logits. ``chunk_size``: the head's tokens per tile. ``tokens`` / ``score_mask``:
    the positions scored, as :func:`chunked_head` takes them ("all" by default; "response": those that
    ``no_padding_2_padding`` reads, 0 elsewhere); the model's own layers run on every token.
    ``input_kwargs`` go to :func:`prepare_model_inputs` (pad_to_multiple, bucket, sp_group, ...). With
    ``calculate_entropy`` returns the dict of :func:`prepare_model_outputs` instead.
    ``temperature`` as :func:`prepare_model_inputs` takes it: when None, the micro-batch's
    ``temperature`` entry, else 1.0.

    ``share_prefixes=True`` computes each group's shared prompt once (GRPO's n samples of a prompt):
    rows whose prompt tokens are equal are found from the tokens themselves, the model runs once
    over each distinct prompt followed by its rows' responses (a response attends to its prompt and
    to its own earlier tokens, never to a sibling), and the chunked head scores each response token
    from the state before it in its own row. The results equal the plain call's (each row run alone)
    and have its shape; gradients reach the shared prompt once per row, as separate rows give them.
    It takes ``tokens="response"`` (only responses are scored: the prompts of all but one row of a
    group are never computed), 1-row position ids counting each row from 0, the model's own
    attention switched for the call ("auto"), the chunked head, no ``score_mask`` and no
    ``input_kwargs``. Layers that carry state along the sequence continue each response from its
    prompt's final state; one with no such form is a ValueError naming it before any forward.
    """
    calculate_entropy = check_flag(calculate_entropy, "calculate_entropy")
    if check_flag(share_prefixes, "share_prefixes"):
        out = _shared_prefix_call(
            model,
            micro_batch,
            temperature,
            calculate_entropy,
            attention,
            head,
            chunk_size,
            tokens,
            score_mask,
            input_kwargs,
        )
        return out if calculate_entropy else out["log_probs"]
    if attention is not None:
        check_choice(attention, "attention", ("auto", *KERNELS))
    head = check_choice(head, "head", HEADS)
    check_choice(tokens, "tokens", TOKENS)
    chunk_size = check_optional_int(chunk_size, "chunk_size", low=1)
    with packed_attention(model, attention):
        inputs, args = prepare_model_inputs(
            micro_batch, temperature=temperature, attn_implementation=_attn_implementation(model), **input_kwargs
        )
        scored = args.scored(tokens, score_mask)
        with _chunked_head(model, args, head, calculate_entropy, chunk_size, scored):
            output = model(**inputs)
        out = _outputs(output, args, calculate_entropy, scored)
    return out if calculate_entropy else out["log_probs"]


def _shared_prefix_call(
    model: torch.nn.Module,
    micro_batch: Any,
    temperature: float | Tensor | None,
    calculate_entropy: bool,
    attention: Any,
    head: Any,
    chunk_size: Any,
    tokens: Any,
    score_mask: Any,
    input_kwargs: dict,
) -> dict[str, Tensor]:
    """:func:`packed_logprobs` with ``share_prefixes=True``: what it takes checked here, at the edge."""
    check_transformers_model(model)
    if tokens != "response":
        raise input_error("tokens", None, "'response' with share_prefixes (only responses are scored)", repr(tokens))
    if score_mask is not None:
        raise input_error("score_mask", None, "None with share_prefixes (the responses are scored)", "a mask")
    if attention != "auto":
        raise input_error("attention", None, "'auto' with share_prefixes (nopad_shared for the call)", repr(attention))
    if check_choice(head, "head", HEADS) == "logits":
        raise input_error("head", None, "'auto' or 'chunked' with share_prefixes", "'logits'")
    if input_kwargs:
        raise input_error("input_kwargs", None, "none with share_prefixes (one unsplit row)", f"{sorted(input_kwargs)}")
    chunk_size = check_optional_int(chunk_size, "chunk_size", low=1)
    input_ids, position_ids = _checked_nested(micro_batch)
    _check_one_row_positions(position_ids)
    if temperature is None:
        temperature = get_field(micro_batch, "temperature", 1.0)
    out = shared_prefix_logprobs(model, micro_batch, input_ids, temperature, calculate_entropy, chunk_size)
    return {key: _counting_from_zero(value, position_ids) for key, value in out.items()}


def _counting_from_zero(nested: Tensor, position_ids: Tensor) -> Tensor:
    """Nested ``nested``, NaN unless every row's position ids count 0, 1, ... (the shared layout's
    own positions: a row whose ids start elsewhere would be computed at other positions). Compared
    where the ids are, no host sync."""
    given, offsets = jagged_values(position_ids), nested_offsets(nested)
    ok = (given == position_ids_of(offsets.to(given.device), given.shape[0]).to(given)).all()
    return wrap_jagged(torch.where(ok.to(offsets.device), jagged_values(nested), torch.nan), offsets)


def padded_logprobs(
    model: torch.nn.Module,
    padded: TensorDict,
    temperature: float | Tensor | None = None,
    *,
    rows_per_forward: int | None = None,
) -> Tensor:
    """The reference: a padded forward (attention_mask, left-padded prompts) -> (B, R) response log-probs.

    ``padded`` holds input_ids (B, S), attention_mask (B, S), response_mask (B, R), position_ids
    (B, S) or (B, C, S). Entries where response_mask is 0 are 0. Materialises (B, R, V) log-softmax:
    a reference, not a hot path. ``rows_per_forward`` splits the batch into forwards of that many
    rows (the result is the same), so a reference fits where the whole padded batch would not.
    ``temperature`` as :func:`prepare_model_inputs` takes it (None: ``padded``'s ``temperature``
    entry, else 1.0); checked on the host (a reference may sync), so a bad row is a ValueError
    naming it on any device.
    """
    if not isinstance(padded, Mapping):
        raise input_error("padded", None, "a TensorDict of the padded batch", type(padded).__name__)
    for key in ("input_ids", "attention_mask", "response_mask", "position_ids"):
        if key not in padded.keys():
            raise input_error(f"padded[{key!r}]", None, "a padded (batch, ...) tensor", "missing")
    check_integer_tensor(padded["input_ids"], "padded['input_ids']")
    batch = padded["input_ids"].shape[0]
    if batch == 0:
        raise input_error("padded", None, "at least one row", "an empty batch")
    rows_per_forward = check_optional_int(rows_per_forward, "rows_per_forward", low=1)
    if temperature is None:
        temperature = get_field(padded, "temperature", 1.0)
    # a tensor is read on the host (a bad row is named on any device); every use below moves it back
    temperature = checked_temperature(temperature.cpu() if isinstance(temperature, Tensor) else temperature, batch)
    check_transformers_model(model)  # after the batch's own checks: those name what is wrong with it first
    if rows_per_forward is not None and rows_per_forward < batch:
        temperatures = temperature if isinstance(temperature, Tensor) else None
        return torch.cat(
            [
                padded_logprobs(
                    model,
                    padded[i : i + rows_per_forward],
                    temperature if temperatures is None else temperatures[i : i + rows_per_forward],
                )
                for i in range(0, batch, rows_per_forward)
            ]
        )
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
