"""Response log-probs of a nested micro-batch with each group's shared prompt computed once.

The FSDP adapter's :func:`nopad.engines.packed_logprobs` with ``share_prefixes=True`` comes here: the
rows (prompt then response, as :func:`nopad.left_right_2_no_padding` lays them out) are planned in
the shared-prefix layout (``nopad.batches._prefixes``), the model runs once over it with its
attention switched to ``nopad_shared`` for the call, and the chunked head scores each response
token from the hidden state before it in its own row: a response's first token reads its prompt's
last position, computed once for the group. The head stands in for the output layer inside the
model's forward, as the plain path's does (:func:`nopad.engines.chunked_head`), so a weight that FSDP
shards is whole while it is used, and the model's post-processing of its logits is checked the same
way. Results come back as the plain path gives them:
nested (B, j) on the rows' tokens, each response token's log-prob at the position before it, 0
elsewhere, so :func:`nopad.no_padding_2_padding` and the losses read them unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from nopad.batches._prefixes import SharedPrefixPlan, plan_shared_prefixes
from nopad.core._errors import input_error
from nopad.core._layout import jagged_values, nested_offsets, row_ids_of
from nopad.core._torch_internals import wrap_jagged
from nopad.engines._head import head_forward
from nopad.modeling._attention import current_implementation
from nopad.modeling._logprobs import ScoredTokens, checked_temperature, default_tile, scored_tokens
from nopad.modeling._prefixes import IMPLEMENTATION, PLAN_KWARG, kernel_of_implementation, use_shared_prefix_attention
from nopad.modeling._routing import checkpointed
from nopad.parallel._ulysses import set_attn_implementation


def prompt_lengths_of(micro_batch: Any, input_ids: Tensor) -> Tensor:
    """(B,) int64 prompt lengths of nested (B, j) ``input_ids``: each row's tokens before the response
    positions that :func:`nopad.no_padding_2_padding` reads (found as ``tokens="response"`` finds
    them, so the two agree by construction). The response must be the row's last tokens: the prompt
    is everything before it."""
    offsets = nested_offsets(input_ids).to(torch.int64)
    batch, total = offsets.shape[0] - 1, jagged_values(input_ids).shape[0]
    scored = scored_tokens("response", None, micro_batch, input_ids)
    assert scored is not None  # "response" always names positions
    index = scored.index.to(offsets.device)
    counted = torch.ones_like(index) if scored.valid is None else scored.valid.to(index)
    responses = offsets.new_zeros(batch).index_add_(0, row_ids_of(offsets, total).index_select(0, index), counted)
    return offsets.diff() - responses


@contextmanager
def switched_to_shared_attention(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the model's attention is ``nopad_shared``, with the kernel its attention
    forced (``nopad_varlen_fa``: flash_attn), if any; on leaving it, what it was. A model whose
    layers are checkpointed is refused under autograd: their backward recomputes them after the block,
    under the attention switched back."""
    before = current_implementation(model)
    if torch.is_grad_enabled() and checkpointed(model) and not str(before).startswith(IMPLEMENTATION):
        raise input_error(
            "model",
            None,
            "a model whose layers are not checkpointed, for shared prefixes with gradients (a checkpointed "
            "layer's backward recomputes it after the attention is switched back)",
            f"{type(model).__name__} with activation checkpointing on",
        )
    # a model without an attention implementation is refused here
    use_shared_prefix_attention(model, kernel_of_implementation(before))
    try:
        yield
    finally:
        set_attn_implementation(model, str(before))


def shared_prefix_logprobs(
    model: torch.nn.Module,
    micro_batch: Any,
    input_ids: Tensor,
    temperature: Tensor | float,
    with_entropy: bool,
    chunk_size: int | None,
    *,
    share: bool = True,
) -> dict[str, Tensor]:
    """Nested (B, j) response log-probs (and entropy) from one forward over the shared-prefix layout.

    Args:
        model: a transformers causal LM whose every position-mixing layer the shared layout serves
            (else a ValueError naming the layer, before any forward).
        micro_batch: the nested micro-batch (its response fields say where each response starts).
        input_ids: its nested (B, j) ``input_ids``.
        temperature: a float, or a 0-d or (B,) tensor per row (checked here).
        with_entropy: whether to compute the entropy too.
        chunk_size: the chunked head's tokens per tile, or None for the device's default.
        share: False plans every row as its own group (the same attention and head over the plain
            packed layout: what the benchmark compares sharing against).

    Returns:
        ``{"log_probs": (B, j), "entropy": (B, j)}`` nested on ``input_ids``' rows, float32: each
        response token's values at the position before it, 0 elsewhere (entropy only with
        ``with_entropy``).
    """
    kwargs, scored, temps = shared_prefix_inputs(micro_batch, input_ids, temperature, share=share)
    plan, packed_ids = kwargs[PLAN_KWARG], kwargs["input_ids"]
    tile = None if chunk_size is None else (chunk_size, default_tile(packed_ids.device)[1])
    with (
        switched_to_shared_attention(model),
        head_forward(
            model,
            packed_ids[0],
            temps,
            plan.total,
            with_entropy=with_entropy,
            required=True,
            tile=tile,
            scored=scored,
            input_ids=packed_ids,
        ) as served,
    ):
        output = served(**kwargs)
    out = {"log_probs": on_rows(output.log_probs[0], scored, plan, input_ids)}
    if with_entropy:
        out["entropy"] = on_rows(output.entropy[0], scored, plan, input_ids)
    return out


def shared_prefix_inputs(
    micro_batch: Any, input_ids: Tensor, temperature: Tensor | float, *, share: bool = True
) -> tuple[dict[str, Any], ScoredTokens, Tensor | float]:
    """The model kwargs of the shared-prefix layout of nested (B, j) ``input_ids``, the response
    tokens the head scores there, and the temperature per packed token.

    Returns:
        kwargs: ``input_ids`` (1, T) the rows packed in the plan's order, ``position_ids`` (1, T)
            each token's position in its own row, the plan under ``shared_prefixes`` (what the
            ``nopad_shared`` attention reads), ``use_cache`` False.
        scored: each response token at its own packed position (unique: responses are never
            shared; the label there is the token itself), read from the hidden state of the token
            before it in its row (``plan.logprob_index``: a group's prompt's last one, shared).
        temperature: a float as it is (checked), else (T,) one per packed token (its row's).
    """
    plan = plan_shared_prefixes(input_ids, prompt_lengths_of(micro_batch, input_ids), share=share)
    packed_ids = plan.pack(jagged_values(input_ids)).unsqueeze(0)  # (1, T)
    own = plan.unpack_index.index_select(0, plan.label_index)
    scored = ScoredTokens(own, None, plan.total, "response", read=plan.logprob_index)
    kwargs = {
        "input_ids": packed_ids,
        "position_ids": plan.position_ids.unsqueeze(0),
        PLAN_KWARG: plan,
        "use_cache": False,
    }
    return kwargs, scored, _per_packed_token(temperature, plan)


def _per_packed_token(temperature: Tensor | float, plan: SharedPrefixPlan) -> Tensor | float:
    """A float as it is (checked); a 0-d or (B,) temperature tensor -> (T,) one per packed token, its
    row's (a shared prompt's tokens take their group's first row's, and are never scored)."""
    if not isinstance(temperature, Tensor):
        return checked_temperature(temperature, plan.rows)
    block = row_ids_of(plan.cu_seqlens_q.to(torch.int64), plan.total)
    return checked_temperature(temperature, plan.rows, plan.block_order.index_select(0, block))


def on_rows(packed: Tensor, scored: ScoredTokens, plan: SharedPrefixPlan, input_ids: Tensor) -> Tensor:
    """(T,) values at the response tokens' own packed positions (``scored.index``, as
    :func:`shared_prefix_inputs` made it) -> nested (B, j) on the rows, each at the position before
    its token (where the plain path's head writes it), 0 elsewhere."""
    values = packed.index_select(0, scored.index.to(packed.device))
    frame = packed.new_zeros(plan.rows_total).index_copy(0, plan.label_index - 1, values)
    return wrap_jagged(frame, nested_offsets(input_ids))
