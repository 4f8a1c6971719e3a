"""Synthetic left/right padded batches for the core tests, and the naive per-row references."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from tensordict import TensorDict


def padded_masks(prompt_lens, resp_lens, prompt_width: int, resp_width: int):
    """attention_mask (B, P+R) and response_mask (B, R) for the given per-row lengths."""
    p = torch.as_tensor(prompt_lens).unsqueeze(1)
    r = torch.as_tensor(resp_lens).unsqueeze(1)
    prompt_cols = torch.arange(prompt_width)
    resp_cols = torch.arange(resp_width)
    prompt_mask = prompt_cols >= prompt_width - p
    response_mask = resp_cols < r
    return torch.cat([prompt_mask, response_mask], 1).long(), response_mask.long()


def make_batch(
    prompt_lens,
    resp_lens,
    prompt_width,
    resp_width,
    *,
    mrope: int = 0,
    seed: int = 0,
    extras: bool = True,
    float_ids: bool = False,
) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    attention_mask, response_mask = padded_masks(prompt_lens, resp_lens, prompt_width, resp_width)
    B, S = attention_mask.shape
    input_ids = torch.randint(1, 50_000, (B, S), generator=g) * attention_mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if mrope:
        position_ids = position_ids.unsqueeze(1).repeat(1, mrope, 1) + torch.arange(mrope).view(1, mrope, 1) * 1000
    fields = dict(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, position_ids=position_ids
    )
    if extras:
        fields["routed_experts"] = torch.randint(0, 64, (B, S, 3, 2), generator=g, dtype=torch.int32).to(torch.uint8)
        fields["teacher_logprobs"] = torch.randn(B, S, 4, generator=g)
        fields["teacher_ids"] = torch.randint(0, 50_000, (B, S, 4), generator=g)
    if float_ids:
        fields["values"] = torch.randn(B, S, generator=g, dtype=torch.float64)
    return TensorDict(fields, batch_size=[B])


@st.composite
def batch_shapes(draw, max_batch: int = 6, max_width: int = 7):
    """(prompt_lens, resp_lens, P, R): B=1, length-1 rows, full rows, equal lengths, empty tail rows."""
    B = draw(st.integers(1, max_batch))
    P = draw(st.integers(1, max_width))
    R = draw(st.integers(1, max_width))
    kind = draw(st.sampled_from(["random", "full", "equal", "ones", "empty_tail"]))
    if kind == "full":
        return [P] * B, [R] * B, P, R
    if kind == "equal":
        p, r = draw(st.integers(1, P)), draw(st.integers(0, R))
        return [p] * B, [r] * B, P, R
    if kind == "ones":
        return [1] * B, [1] * B, P, R
    prompt_lens = draw(st.lists(st.integers(1, P), min_size=B, max_size=B))
    resp_lens = draw(st.lists(st.integers(0, R), min_size=B, max_size=B))
    if kind == "empty_tail" and B > 1:  # rows of pure padding, as when a batch is padded to a dp multiple
        n = draw(st.integers(1, B - 1))
        prompt_lens[-n:], resp_lens[-n:] = [0] * n, [0] * n
    return prompt_lens, resp_lens, P, R


def reference_nest(x: torch.Tensor, mask: torch.Tensor, seq_dim: int = 1) -> list[torch.Tensor]:
    """Per-row boolean indexing: the naive loop every conversion is checked against."""
    return [x[b].index_select(seq_dim - 1, mask[b].bool().nonzero().flatten()) for b in range(x.shape[0])]


def reference_response(values_per_row: list[torch.Tensor], resp_lens, width: int) -> torch.Tensor:
    """Row b: outputs at positions [len_b - r_b - 1, len_b - 1) of its own sequence, zero-padded."""
    rows = []
    for v, r in zip(values_per_row, resp_lens):
        n = v.shape[0]
        piece = v[n - r - 1 : n - 1] if r > 0 else v[:0]
        pad = v.new_zeros((width - r, *v.shape[1:]))
        rows.append(torch.cat([piece, pad]))
    return torch.stack(rows)
