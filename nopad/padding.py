"""verl-compatible conversions between padded TensorDicts and jagged nested tensors.

Padded layout (B, S): the prompt occupies the first ``S - R`` columns, left-padded; the response
the last ``R`` columns, right-padded, so each row's real tokens are one run that straddles column
``S - R``. Every conversion below is a fixed number of tensor ops whatever B.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable

import torch
from tensordict import TensorDict
from torch import Tensor

from nopad._batch import get_field
from nopad.layout import IndexPlan, _fail, gather_rows, nested_offsets, prepare_offsets, ragged_dim, to_host
from nopad.layout import is_nested as _is_nested

REQUIRED_KEYS = ("input_ids", "attention_mask", "response_mask", "position_ids")
PER_TOKEN_KEYS = ("routed_experts", "teacher_logprobs", "teacher_ids")


def _first_row(bad: Tensor) -> int:
    return int(bad.nonzero()[0])


def plan_left_right(attention_mask: Tensor, response_mask: Tensor, *, check_response_mask: bool = False) -> IndexPlan:
    """Plan of a left-padded-prompt / right-padded-response batch, validated. ONE host sync.

    attention_mask (B, S), response_mask (B, R) with R < S. Raises ValueError naming the row when
    a row is not one contiguous run across column S - R or has an empty prompt but a response.
    Only the shape of ``response_mask`` is read unless ``check_response_mask``: then a row that
    marks response tokens attention_mask calls padding fails too, at the cost of one more pass
    over (B, R) inside the same sync.
    """
    if attention_mask.dim() != 2:
        raise _fail("attention_mask", None, "shape (batch, seqlen)", f"{tuple(attention_mask.shape)}")
    (B, S), R = attention_mask.shape, response_mask.shape[-1]
    if response_mask.dim() != 2 or response_mask.shape[0] != B or R >= S:
        raise _fail("response_mask", None, f"shape ({B}, R) with R < seqlen {S}", f"{tuple(response_mask.shape)}")
    if B == 0:
        raise _fail("attention_mask", None, "at least one row", "an empty batch")
    prompt_width = S - R
    # One cumsum pass answers everything. A row's run must be [start, end) with start = P - prompt
    # length; it is exactly that when no one comes before start and all ones have come by end.
    # Any nonzero counts as a one (as nonzero() and unpad_input see it); the narrow count writes a
    # quarter of what an int64 cumsum of an int64 mask would, which the gathers after it feel.
    ones_upto = attention_mask.bool().cumsum(-1, dtype=torch.int16 if S < 2**15 else torch.int32)
    lengths, prompt_lens = ones_upto[:, -1].long(), ones_upto[:, prompt_width - 1].long()
    starts = prompt_width - prompt_lens
    last_cols = torch.stack([starts - 1, starts + lengths - 1], 1)
    # a full prompt starts at 0: its "column before" is clamped onto column 0, which holds a one
    before_start, by_end = ones_upto.gather(1, last_cols.clamp(min=0)).unbind(1)
    checks = {
        "attention_mask": (
            by_end - before_start + (starts == 0) != lengths,
            "ones forming one run: prompt left-padded, response right-padded",
        ),
        "prompt": (
            (prompt_lens == 0) & (lengths > 0),
            "a non-empty prompt (the first response log-prob comes from it)",
        ),
    }
    if check_response_mask:
        checks["response_mask"] = (
            (response_mask > attention_mask[:, prompt_width:]).any(-1),
            "ones only where attention_mask is 1",
        )
    bad_rows = functools.reduce(operator.or_, (bad for bad, _ in checks.values()))
    shortest, longest = torch.aminmax(lengths)
    offsets = prepare_offsets(lengths)
    total, max_len, min_len, failed = to_host(offsets[-1], longest, shortest, bad_rows.sum())
    if failed:  # the failure path may take its time: find which check and which row
        for field, (bad, expected) in checks.items():
            if bad.any():
                row = _first_row(bad)
                raise _fail(field, row, expected, f"attention_mask {attention_mask[row].tolist()}")
    return IndexPlan(lengths, offsets, total=total, width=S, starts=starts, max_seqlen=max_len, min_seqlen=min_len)


def _check_per_token(data: TensorDict, key: str, B: int, S: int) -> Tensor:
    x = data[key]
    if not isinstance(x, Tensor) or x.dim() < 2 or tuple(x.shape[:2]) != (B, S):
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise _fail(key, None, f"a per-token tensor of shape ({B}, {S}, ...)", f"{shape}")
    return x


def left_right_2_no_padding(
    data: TensorDict, fields: Iterable[str] = (), *, check_response_mask: bool = False
) -> TensorDict:
    """Padded TensorDict -> a new TensorDict with nested per-token fields. One host sync.

    Input keys: input_ids (B, S), attention_mask (B, S), response_mask (B, R), position_ids (B, S)
    or (B, C, S) with C in {3, 4}. Output: input_ids nested (B, j), position_ids nested (B, j) or
    (B, C, j), loss_mask = response_mask, and routed_experts / teacher_logprobs / teacher_ids plus
    every key in ``fields`` nested (B, j, *). Non-tensor metadata: max_seq_len (S),
    max_response_len (R), indices (total,). The caller's TensorDict is not modified.

    Every row's attention_mask is checked, since the nested rows are cut from it. response_mask
    is passed on as loss_mask unread, as verl does; ``check_response_mask=True`` also fails a row
    whose response_mask marks padding (one more pass over it, in the same sync). Reading it costs
    as much as the gathers themselves on a CPU, so a producer that builds the mask from
    attention_mask, or checked it once, should leave this off in the forward pass.
    """
    missing = [k for k in REQUIRED_KEYS if k not in data.keys()]
    if missing:
        raise _fail("data", None, f"keys {list(REQUIRED_KEYS)}", f"missing {missing}")
    input_ids, attention_mask = data["input_ids"], data["attention_mask"]
    response_mask, position_ids = data["response_mask"], data["position_ids"]
    if any(_is_nested(x) for x in (input_ids, attention_mask, response_mask, position_ids)):
        raise _fail(
            "data", None, "padded (dense) input_ids, attention_mask, response_mask, position_ids", "a nested tensor"
        )
    if input_ids.dim() != 2:
        raise _fail("input_ids", None, "shape (batch, seqlen)", f"{tuple(input_ids.shape)}")
    B, S = input_ids.shape
    if tuple(attention_mask.shape) != (B, S):
        raise _fail("attention_mask", None, f"shape {(B, S)} like input_ids", f"{tuple(attention_mask.shape)}")
    if attention_mask.dtype.is_floating_point:
        raise _fail("attention_mask", None, "an integer or bool mask", f"dtype {attention_mask.dtype}")
    mrope = position_ids.dim() == 3
    if (
        position_ids.shape[0] != B
        or position_ids.shape[-1] != S
        or (mrope and position_ids.shape[1] not in (3, 4))
        or position_ids.dim() not in (2, 3)
    ):
        raise _fail("position_ids", None, f"shape ({B}, {S}) or ({B}, 3|4, {S})", f"{tuple(position_ids.shape)}")

    plan = plan_left_right(attention_mask, response_mask, check_response_mask=check_response_mask)
    out = data.copy()  # shallow: new keys and metadata never reach the caller's TensorDict
    out["input_ids"] = plan.nest(input_ids)
    out["position_ids"] = plan.nest(position_ids, seq_dim=2 if mrope else 1)
    out["loss_mask"] = response_mask
    for key in (*PER_TOKEN_KEYS, *fields):
        if key in data.keys() and not _is_nested(data[key]):
            out[key] = plan.nest(_check_per_token(data, key, B, S))
    out.set_non_tensor("max_seq_len", S)
    out.set_non_tensor("max_response_len", response_mask.shape[1])
    out.set_non_tensor("indices", plan.indices)
    return out


def _response_lengths(data: TensorDict) -> tuple[Tensor, int | None]:
    """Response length per row and the padded response width, from whatever ``data`` carries."""
    width = get_field(data, "max_response_len")
    responses = data.get("responses", None)
    if _is_nested(responses):
        return nested_offsets(responses).diff(), width
    response_mask = data.get("response_mask", None)
    if "attention_mask" in data.keys() and not _is_nested(data["attention_mask"]):
        if responses is not None:
            width = responses.shape[1]
        elif response_mask is not None and not _is_nested(response_mask):
            width = response_mask.shape[1] if width is None else width
        if width is None:
            raise _fail("data", None, "responses, response_mask or max_response_len", "none of them")
        return data["attention_mask"][:, -width:].sum(-1), width
    if _is_nested(response_mask):
        return nested_offsets(response_mask).diff(), width
    raise _fail(
        "data", None, "nested responses, or attention_mask with responses/response_mask", f"keys {list(data.keys())}"
    )


def _sequence_ends(tensor: Tensor, data: TensorDict) -> Tensor:
    if _is_nested(tensor):
        return nested_offsets(tensor)[1:]
    for key in ("input_ids", "prompts"):
        if _is_nested(data.get(key, None)):
            ends = nested_offsets(data[key])[1:]
            if key == "prompts":
                ends = ends + nested_offsets(data["responses"])[1:]
            return ends
    return data["attention_mask"].sum(-1).cumsum(0)


def no_padding_2_padding(tensor: Tensor, data: TensorDict, max_response_len: int | None = None) -> Tensor:
    """Nested (B, j, *) or flat (total, *) model output -> padded response (B, R, *).

    Row b holds the outputs at positions [end_b - r_b - 1, end_b - 1) of its sequence: the
    log-prob of response token t is produced at position t - 1. Zero-padded on the right.
    No host sync when the width R is known (from ``max_response_len``, ``responses`` or
    ``response_mask``); gradients flow back to the values.
    """
    values = tensor.values() if _is_nested(tensor) else tensor
    if _is_nested(tensor) and ragged_dim(tensor) != 1:
        raise _fail("tensor", None, "a nested tensor ragged on dim 1", f"ragged dim {ragged_dim(tensor)}")
    resp_lens, width = _response_lengths(data)
    width = max_response_len if max_response_len is not None else width
    if width is None:
        width = to_host(resp_lens.max())[0]
    indices = get_field(data, "indices")
    if isinstance(indices, Tensor) and not _is_nested(tensor) and indices.shape[0] != values.shape[0]:
        raise _fail("tensor", None, f"{indices.shape[0]} tokens (the batch's total)", f"shape {tuple(values.shape)}")
    ends = _sequence_ends(tensor, data).to(values.device)
    resp_lens = resp_lens.to(values.device)
    return gather_rows(values, ends - resp_lens - 1, None, resp_lens, width)


def response_from_nested(tensor: Tensor, response_mask: Tensor) -> Tensor:
    """Nested full-sequence output (B, j) -> nested response output (B, j_r), shifted by one.

    ``response_mask`` is nested (B, j_r); no sync (its values give the total).
    """
    if not (_is_nested(tensor) and _is_nested(response_mask)):
        raise _fail("tensor/response_mask", None, "two nested tensors", "a dense tensor")
    resp = IndexPlan.from_nested(response_mask)
    ends = nested_offsets(tensor)[1:].to(resp.offsets.device)
    src = resp.token_index(ends - resp.lengths - 1)  # token t's log-prob comes from position t - 1
    return resp.to_nested(tensor.values().index_select(0, src))


def response_to_nested(tensor: Tensor, response_mask: Tensor) -> Tensor:
    """Padded response (B, R, *) -> nested (B, j_r, *) with the lengths of nested ``response_mask``."""
    if not _is_nested(response_mask):
        raise _fail("response_mask", None, "a nested tensor", "a dense tensor")
    return IndexPlan.from_nested(response_mask, width=tensor.shape[1]).nest(tensor)


def build_attention_mask_from_nested(input_ids: Tensor, max_seq_len: int | None = None) -> Tensor:
    """Nested (B, j) -> right-padded int32 attention mask (B, max_seq_len). Sync only if width unknown."""
    plan = IndexPlan.from_nested(input_ids, width=max_seq_len)
    width = max_seq_len if max_seq_len is not None else plan.max_seqlen
    positions = torch.arange(width, device=plan.lengths.device)
    return (positions < plan.lengths.unsqueeze(1)).to(torch.int32)


def _embeds_to_nested(embeds: Tensor, mask: Tensor, field: str) -> tuple[Tensor, Tensor]:
    if embeds.dim() != 3 or tuple(mask.shape) != tuple(embeds.shape[:2]):
        raise _fail(
            field,
            None,
            f"(batch, seqlen, dim) embeds with a {tuple(embeds.shape[:2])} mask",
            f"embeds {tuple(embeds.shape)}, mask {tuple(mask.shape)}",
        )
    plan = IndexPlan.from_mask(mask)
    return plan.nest(embeds), plan.nest(mask.bool())


def embeds_padding_2_no_padding(data: TensorDict) -> TensorDict:
    """prompt_embeds (B, S, D) with prompt_embeds_mask -> nested embeds and masks (also negative_*).

    The mask may have any pattern; only the marked positions are kept. Returns a new TensorDict.
    """
    out = data.copy()
    for prefix in ("prompt", "negative_prompt"):
        key = f"{prefix}_embeds"
        if isinstance(data.get(key, None), Tensor) and not _is_nested(data[key]):
            out[key], out[f"{key}_mask"] = _embeds_to_nested(data[key], data[f"{key}_mask"], key)
    return out
