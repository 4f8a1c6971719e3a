"""Response log-probs of a nested micro-batch with each group's shared prompt computed once.

The FSDP adapter's :func:`nopad.engines.packed_logprobs` with ``share_prefixes=True`` comes here: the
rows (prompt then response, as :func:`nopad.left_right_2_no_padding` lays them out) are planned in
the shared-prefix layout (``nopad.batches._prefixes``), the model runs once over it with its
attention switched to ``nopad_shared`` for the call, and the chunked head scores each response
token from the hidden state before it in its own row: a response's first token reads its prompt's
last position, computed once for the group. Results come back as the plain path gives them:
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
from nopad.engines._head import refusal
from nopad.modeling._attention import current_implementation
from nopad.modeling._logprobs import checked_temperature, default_tile, run_head, scored_tokens
from nopad.modeling._prefixes import PLAN_KWARG, use_shared_prefix_attention
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
def _shared_attention(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the model's attention is ``nopad_shared``; on leaving it, what it was."""
    before = current_implementation(model)
    use_shared_prefix_attention(model)  # a model without an attention implementation is refused here
    try:
        yield
    finally:
        set_attn_implementation(model, str(before))


def _hidden_of_output_layer(model: torch.nn.Module, layer: torch.nn.Module, kwargs: dict) -> Tensor:
    """(T, H) the hidden states ``model(**kwargs)`` hands its output layer, no logits made: the layer
    stands in with a (1, T, 1) zero output for this one forward."""
    seen: list[Tensor] = []

    def forward(hidden: Tensor) -> Tensor:
        seen.append(hidden)
        return hidden.new_zeros(*hidden.shape[:-1], 1)

    own = layer.__dict__.get("forward")
    layer.forward = forward  # type: ignore[method-assign]
    try:
        model(**kwargs)
    finally:
        if own is None:
            layer.__dict__.pop("forward", None)
        else:
            layer.forward = own  # type: ignore[method-assign]
    if len(seen) != 1 or seen[0].dim() != 3 or seen[0].shape[0] != 1:
        shapes = [tuple(h.shape) for h in seen]
        raise input_error("model", None, "one call of its output layer on (1, T, hidden) states", f"calls on {shapes}")
    return seen[0][0]


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
    spec, why = refusal(model)
    if spec is None:
        raise input_error("head", None, "a model the chunked head can serve (share_prefixes scores by it)", str(why))
    plan = plan_shared_prefixes(input_ids, prompt_lengths_of(micro_batch, input_ids), share=share)
    values = jagged_values(input_ids)
    kwargs = {
        "input_ids": plan.pack(values).unsqueeze(0),
        "position_ids": plan.position_ids.unsqueeze(0),
        "use_cache": False,
        PLAN_KWARG: plan,
    }
    with _shared_attention(model):
        hidden = _hidden_of_output_layer(model, spec.layer, kwargs)
    tile = None if chunk_size is None else (chunk_size, default_tile(hidden.device)[1])
    scored = hidden.index_select(0, plan.logprob_index)  # (M, H): the state before each response token
    labels = values.index_select(0, plan.label_index)
    log_probs, entropy = run_head(
        scored,
        spec.layer.weight,
        spec.layer.bias,
        labels,
        _per_response_token(temperature, plan),
        with_entropy,
        scale=spec.scale,
        softcap=spec.softcap,
        tile=tile,
    )
    out = {"log_probs": _on_rows(log_probs, plan, input_ids)}
    if entropy is not None:
        out["entropy"] = _on_rows(entropy, plan, input_ids)
    return out


def _per_response_token(temperature: Tensor | float, plan: SharedPrefixPlan) -> Tensor | float:
    """A float as it is (checked); a 0-d or (B,) temperature tensor -> (M,) one per response token."""
    rows = row_ids_of(plan.completion_offsets, plan.completion_total) if isinstance(temperature, Tensor) else None
    return checked_temperature(temperature, plan.rows, rows)


def _on_rows(per_token: Tensor, plan: SharedPrefixPlan, input_ids: Tensor) -> Tensor:
    """(M,) values of the response tokens -> nested (B, j) on the rows, each at the position before
    its token (where the plain path's head writes it), 0 elsewhere; autograd flows."""
    frame = per_token.new_zeros(plan.rows_total).index_copy(0, plan.label_index - 1, per_token)
    return wrap_jagged(frame, nested_offsets(input_ids))
