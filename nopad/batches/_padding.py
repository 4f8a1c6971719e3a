"""verl-compatible conversions between padded TensorDicts and jagged nested tensors.

Padded layout (B, S): the prompt occupies the first ``S - R`` columns, left-padded; the response
the last ``R`` columns, right-padded, so each row's real tokens are one run that straddles column
``S - R``. Every conversion below is a fixed number of tensor ops whatever B.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from nopad.batches._reorder import DATA, DENSE, NESTED, Relayout, register_relayout
from nopad.core._batch import get_field
from nopad.core._errors import check_flag, check_int, free_to_read, input_error, mask_error, mask_flag, not_01
from nopad.core._layout import (
    IndexPlan,
    device_to_host,
    gather_rows,
    jagged_values,
    nested_offsets,
    ragged_dim,
    response_gather,
    to_host,
)
from nopad.core._layout import is_nested as _is_nested
from nopad.core._schema import ANY, IDS, MASK, Field, check_field
from nopad.core._torch_internals import put_checked

REQUIRED_KEYS = ("input_ids", "attention_mask", "response_mask", "position_ids")
PER_TOKEN_KEYS = ("routed_experts", "teacher_logprobs", "teacher_ids")


@functools.lru_cache(maxsize=64)
def _row_fact_weights(width: int, prompt_width: int, device: torch.device) -> Tensor:
    """(S,) int64 weights whose sum over a row's ones packs three facts in one integer: the row's
    ones, its prompt's ones, and its signed moment (the sum of -c over the prompt's ones and of
    c - P over the response's), in base S + 1 (see :func:`_unpack_row_facts`)."""
    cols = torch.arange(width, dtype=torch.int64)
    base = width + 1
    moment = torch.where(cols < prompt_width, -cols, cols - prompt_width)
    return (1 + (cols < prompt_width).long() * base + moment * base**2).to(device)


def _fits_one_int64(width: int) -> bool:
    """Whether the packed sum of :func:`_row_fact_weights` cannot overflow: S up to about 65,000."""
    base = width + 1
    return width + base * width + base**2 * (width * width // 2 + 1) < 2**63


def _row_facts(attention_mask: Tensor, response_mask: Tensor, prompt_width: int, check_response_mask: bool) -> Any:
    """(B, 3 or 4) int64 numpy: ones, prompt ones, signed moment [, response tokens on padding]. The sync.

    One weighted sum per row (integer, so exact; no BLAS, whose thread pool stalls on a busy host).
    An integer or bool mask selects: any nonzero entry is a token (as the gathers read it), so its
    values need no check. A float mask must hold only 0s and 1s: how many do not travels in the
    same read (a 0.5 is neither a token nor padding), and :func:`nopad.core._errors.mask_error` is raised.
    """
    ones = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    width = ones.shape[1]
    packed = _fits_one_int64(width)
    if packed:
        columns = [(ones * _row_fact_weights(width, prompt_width, ones.device)).sum(-1)]
    else:  # rows longer than ~65,000 tokens: the three sums apart
        cols = torch.arange(width, device=ones.device)
        moment = torch.where(cols < prompt_width, -cols, cols - prompt_width)
        columns = [ones.sum(-1), ones[:, :prompt_width].sum(-1), (ones * moment).sum(-1)]
    if check_response_mask:
        columns.append(((response_mask != 0) & (ones[:, prompt_width:] == 0)).sum(-1))
    rows = columns[0] if len(columns) == 1 else torch.stack(columns, 1).flatten()
    if attention_mask.dtype.is_floating_point or (check_response_mask and response_mask.dtype.is_floating_point):
        host = _read_with_float_mask_checks(rows, attention_mask, response_mask, check_response_mask)
    else:
        host = device_to_host(rows)
    facts = host.reshape(-1, len(columns))
    return _unpack_row_facts(facts, width) if packed else facts


def _read_with_float_mask_checks(rows: Tensor, attention_mask: Tensor, response_mask: Tensor, both: bool) -> Any:
    """``rows`` on the host, after refusing a float mask (of the two read) that is not a 0/1 mask:
    how many of its entries are neither travels in the same copy."""
    masks = ((attention_mask, "attention_mask"), (response_mask, "response_mask"))[: 2 if both else 1]
    checked = [(mask, field) for mask, field in masks if mask.dtype.is_floating_point and mask.numel()]
    host = device_to_host(torch.cat([rows, *(not_01(mask).sum().reshape(1) for mask, _ in checked)]))
    count = rows.shape[0]
    for k, (mask, field) in enumerate(checked):
        if host[count + k] > 0:
            raise mask_error(mask, field)
    return host[:count]


def _unpack_row_facts(host: Any, width: int) -> Any:
    """The packed first column of :func:`_row_facts` -> (ones, prompt ones, moment) columns. Host math."""
    base = width + 1
    rest, ones = np.divmod(host[:, 0], base)  # numpy floors, so the negative moment does not disturb it
    moment, prompt = np.divmod(rest, base)
    return np.column_stack([ones, prompt, moment, host[:, 1:]])


def _first_bad_row(facts: Any, prompt_width: int) -> tuple[str, int, str] | None:
    """The first failed check of :func:`_row_facts`' facts: (field, row, expected), or None. Host math.

    A row is one run straddling column P exactly when its prompt's p ones are the last p prompt
    columns (their sum of c is then as large as p ones can make it) and its response's r ones the
    first r (as small as r ones can make it). Both gaps are >= 0, so their sum, which the signed
    moment gives, is 0 exactly when both are.
    """
    ones, prompt, moment = facts[:, 0], facts[:, 1], facts[:, 2]
    response = ones - prompt
    gap = prompt * (2 * prompt_width - prompt - 1) // 2 - response * (response - 1) // 2 + moment
    if not (gap.any() or (prompt < np.minimum(ones, 1)).any() or (facts.shape[1] > 3 and facts[:, 3].any())):
        return None  # every row passes: the common case, decided in three array ops
    checks = [
        ("attention_mask", gap != 0, "ones forming one run: prompt left-padded, response right-padded"),
        ("prompt", (prompt == 0) & (ones > 0), "a non-empty prompt (the first response log-prob comes from it)"),
    ]
    if facts.shape[1] > 3:
        checks.append(("response_mask", facts[:, 3] > 0, "ones only where attention_mask is 1"))
    failed = [(int(np.flatnonzero(bad)[0]), field, expected) for field, bad, expected in checks if bad.any()]
    if not failed:
        return None
    row, field, expected = min(failed)
    return field, row, expected


def plan_left_right(
    attention_mask: Tensor,
    response_mask: Tensor,
    *,
    check_response_mask: bool = False,
    device: torch.device | str | None = None,
) -> IndexPlan:
    """Plan of a left-padded-prompt / right-padded-response batch, validated. ONE host sync.

    attention_mask (B, S), response_mask (B, R) with R < S: any nonzero entry of an integer or bool
    mask is a token; a float mask holds only 0s and 1s. Raises
    ValueError naming the row when a row is not one contiguous run across column S - R or has an
    empty prompt but a response. Only the shape of ``response_mask`` is read unless
    ``check_response_mask``: then a row that marks response tokens attention_mask calls padding
    fails too (one more pass over (B, R), in the same sync).

    The device computes three facts per row in one product; they come to the host in one copy,
    where every row is checked and the plan is laid out; a few (B,) arrays go back in one copy.
    A mask on the CPU (the rollout's) costs no device sync at all: pass ``device`` to build the
    plan for a batch that lives there.

    A float mask's values are checked in the same read, on every device (the attention mask's, and
    the response mask's with ``check_response_mask``).
    """
    check_response_mask = check_flag(check_response_mask, "check_response_mask")
    _check_masks(attention_mask, response_mask)
    return _plan_left_right(attention_mask, response_mask, check_response_mask, device)


# the padded batch left_right_2_no_padding takes (nopad.core._schema): the masks first, whose shapes the
# others repeat; the response mask's (B, R) with R < S is checked beside it
MASKS = (Field("attention_mask", MASK, (("B", "S"),)), Field("response_mask", MASK, (("...",),)))
LEFT_RIGHT = (
    *MASKS,
    Field("input_ids", IDS, (("B", "S"),), like="attention_mask"),
    Field("position_ids", IDS, (("B", "S"), ("B", "C", "S")), choices=(("C", (3, 4)),)),
)


def per_token(key: str) -> Field:
    """A per-token field beside the masks: (B, S, ...)."""
    return Field(key, ANY, (("B", "S", "..."),), words="a per-token tensor")


def _check_masks(attention_mask: Any, response_mask: Any) -> dict[str, int]:
    """The two masks' types, dtypes and shapes: (B, S) and (B, R) with R < S and B >= 1. Host facts."""
    sizes = check_field(attention_mask, MASKS[0], {})
    check_field(response_mask, MASKS[1], sizes)
    (B, S), shape = attention_mask.shape, tuple(response_mask.shape)
    if len(shape) != 2 or shape[0] != B or shape[1] >= S:
        raise input_error("response_mask", None, f"shape ({B}, R) with R < seqlen {S}", f"{shape}")
    if B == 0:
        raise input_error("attention_mask", None, "at least one row", "an empty batch")
    return {**sizes, "R": shape[1]}


def _plan_left_right(
    attention_mask: Tensor, response_mask: Tensor, check_response_mask: bool, device: torch.device | str | None
) -> IndexPlan:
    """:func:`plan_left_right` of checked arguments: the row facts, their checks and the plan."""
    S, R = attention_mask.shape[1], response_mask.shape[-1]
    facts = _row_facts(attention_mask, response_mask, S - R, check_response_mask)
    failure = _first_bad_row(facts, S - R)
    if failure is not None:
        field, row, expected = failure
        raise input_error(field, row, expected, f"attention_mask {attention_mask[row].tolist()}")
    lengths, starts = facts[:, 0], (S - R) - facts[:, 1]
    target = attention_mask.device if device is None else torch.device(device)
    # known as this mask's for free
    return IndexPlan.from_runs(lengths, starts, width=S, device=target, response_width=R, mask=attention_mask)


def _check_plan_of(plan: IndexPlan, attention_mask: Tensor) -> None:
    """Refuse a plan that is not ``attention_mask``'s, where that is free: made from this very mask
    (identity and version: nothing to read), or the mask lives on the CPU (its ones are compared with
    the plan's, a read of host memory). A device mask is not read: the caller vouches for the plan."""
    if plan.made_from(attention_mask):
        return
    if not free_to_read(attention_mask, plan.indices):
        return
    ones = attention_mask != 0
    facts = [ones.sum(), ones.flatten().index_select(0, plan.indices).all()]
    flag = mask_flag(attention_mask, "attention_mask")
    count, planned, *only_01 = to_host(*facts, *([flag] if flag is not None else []))
    if only_01 and not only_01[0]:
        raise mask_error(attention_mask, "attention_mask")
    if count != plan.total or not planned:
        in_plan = torch.zeros(ones.numel(), dtype=torch.bool).index_fill_(0, plan.indices.cpu(), True)
        row = int((in_plan.view_as(ones) != ones).any(-1).nonzero()[0])
        raise input_error(
            "plan",
            row,
            "plan_left_right of this batch's attention_mask",
            f"a plan of another mask (its row {row} has other real tokens)",
        )


def _conversion_width(sources: Any, kinds: dict[str, str]) -> int | None:
    """S, when row sources carry this conversion's ``indices``: a (total,) integer tensor beside nested
    ``input_ids`` of that many tokens and a padded (B, S) ``attention_mask``; else None."""
    if kinds.get("indices") != DATA or kinds.get("input_ids") != NESTED or kinds.get("attention_mask") != DENSE:
        return None
    widths = set()
    for src in sources:
        indices, ids, mask = src.get("indices").data, src.get("input_ids"), src.get("attention_mask")
        if not isinstance(indices, Tensor) or indices.dim() != 1 or indices.dtype.is_floating_point:
            return None
        if mask.dim() != 2 or ragged_dim(ids) != 1 or indices.shape[0] != jagged_values(ids).shape[0]:
            return None
        widths.add(mask.shape[1])
    return widths.pop() if len(widths) == 1 else None


# the conversion's ``indices`` place nested input_ids' tokens in the padded (B, S) batch: rows of the
# batch moved or cut re-lay them out (nopad.batches._reorder.take)
register_relayout("indices", Relayout("input_ids", _conversion_width))


def left_right_2_no_padding(
    data: TensorDict,
    fields: Iterable[str] = (),
    *,
    check_response_mask: bool = False,
    plan: IndexPlan | None = None,
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

    ``plan``: the batch's :func:`plan_left_right`, made beforehand, typically on the host from the
    CPU copy of ``attention_mask`` that the rollout already had (validation happens there). The
    conversion then makes no host sync at all: a host plan reaches the batch's device in one
    non-blocking copy (:meth:`IndexPlan.to`). It must be this batch's plan: its batch size, width
    and response width are checked, and so are its real tokens where that is free (a plan made from
    this very mask tensor; a mask on the CPU, read from host memory). A plan made from a CPU copy
    of a device mask is not compared with the device mask: that would cost the sync it saves.

    ``check_response_mask`` applies where the plan is made: with a ``plan`` it is refused (pass it
    to :func:`plan_left_right`), never ignored. ``fields`` names per-token fields to nest besides the
    standard ones; each must be in ``data``.
    """
    if not isinstance(data, TensorDict):
        raise input_error("data", None, "a TensorDict", type(data).__name__)
    if isinstance(fields, str):
        raise input_error("fields", None, "a list of field names", f"the string {fields!r} (write [{fields!r}])")
    fields = list(fields)
    check_response_mask = check_flag(check_response_mask, "check_response_mask")
    present = set(data.keys())  # one walk of the keys (each data.keys() builds a view)
    missing = [k for k in REQUIRED_KEYS if k not in present]
    if missing:
        raise input_error("data", None, f"keys {list(REQUIRED_KEYS)}", f"missing {missing}")
    absent = [k for k in fields if not isinstance(k, str) or k not in present]
    if absent:
        raise input_error("fields", None, f"names of per-token fields of data (keys {list(data.keys())})", f"{absent}")
    input_ids, attention_mask = data["input_ids"], data["attention_mask"]
    response_mask, position_ids = data["response_mask"], data["position_ids"]
    sizes = _check_masks(attention_mask, response_mask)
    for field in LEFT_RIGHT[2:]:
        sizes = check_field(data[field.key], field, sizes)
    B, S = sizes["B"], sizes["S"]
    mrope = "C" in sizes
    extra = [k for k in (*PER_TOKEN_KEYS, *fields) if k in present and not _is_nested(data[k])]
    for key in extra:
        sizes = check_field(data[key], per_token(key), sizes)

    if plan is None:
        plan = _plan_left_right(attention_mask, response_mask, check_response_mask, None)
    elif check_response_mask:  # the masks are read where the plan is made: the flag would be ignored here
        expected = "check_response_mask=False with a plan (pass it to plan_left_right, which reads the masks)"
        raise input_error("check_response_mask", None, expected, "True")
    elif not isinstance(plan, IndexPlan) or plan.batch_size != B or plan.width != S or plan.responses is None:
        raise input_error("plan", None, f"plan_left_right of this batch: {B} rows of width {S}", f"{plan!r}")
    elif plan.responses.width != response_mask.shape[1]:
        expected = f"plan_left_right of this batch: responses of width {response_mask.shape[1]}"
        raise input_error("plan", None, expected, f"a plan of responses of width {plan.responses.width}")
    else:
        _check_plan_of(plan, attention_mask)
        plan = plan.to(input_ids.device)
    out = data.copy()  # shallow: new keys and metadata never reach the caller's TensorDict
    put = functools.partial(put_checked, out)
    put("input_ids", plan.nest(input_ids))
    put("position_ids", plan.nest(position_ids, seq_dim=2 if mrope else 1))
    put("loss_mask", response_mask)
    for key in extra:
        put(key, plan.nest(data[key]))
    out.set_non_tensor("max_seq_len", S)
    out.set_non_tensor("max_response_len", response_mask.shape[1])
    out.set_non_tensor("indices", plan.indices)
    return out


def _metadata_width(data: TensorDict) -> int | None:
    """``data``'s max_response_len metadata, an int >= 0 when present (a string or float is refused)."""
    width = get_field(data, "max_response_len")
    return None if width is None else check_int(width, "data['max_response_len']", low=0)


def _response_lengths(data: TensorDict) -> tuple[Tensor, int | None]:
    """Response length per row and the padded response width, from whatever ``data`` carries."""
    width = _metadata_width(data)
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
            raise input_error("data", None, "responses, response_mask or max_response_len", "none of them")
        return data["attention_mask"][:, -width:].sum(-1), width
    if _is_nested(response_mask):
        return nested_offsets(response_mask).diff(), width
    raise input_error(
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
    ``response_mask``); gradients flow back to the values. A batch that
    :func:`left_right_2_no_padding` converted comes back in four ops, through the way back its
    plan laid out. Response lengths come from nested ``responses`` (or ``response_mask``) when
    ``data`` carries them, as verl reads them; else from the attention mask's response columns.

    Every response must fit in R and leave its row a prompt of at least one token (the first
    log-prob comes from it): checked on the host from the plan's own lengths, or from CPU lengths
    (a read of host memory); lengths on a device are not read for it (a host sync).

    The output must belong to ``data``: a nested output must share the offsets of ``data``'s nested
    ``input_ids`` (the same tensor, as every nested field nopad makes does; offsets of another tensor
    are compared by value, which costs one host sync), a flat one must have its total of tokens.
    """
    if max_response_len is not None:
        max_response_len = check_int(max_response_len, "max_response_len", low=0)
    if not isinstance(tensor, Tensor):
        raise input_error("tensor", None, "a nested (B, j, *) or flat (total, *) tensor", type(tensor).__name__)
    if not isinstance(data, Mapping):  # a TensorDict, or a dict of its fields (only read here)
        raise input_error("data", None, "a TensorDict or a mapping of its fields", type(data).__name__)
    nested = _is_nested(tensor)
    values = jagged_values(tensor) if nested else tensor
    if nested and ragged_dim(tensor) != 1:
        raise input_error("tensor", None, "a nested tensor ragged on dim 1", f"ragged dim {ragged_dim(tensor)}")
    offsets = _check_belongs_to_batch(tensor, values, data)
    way_back = response_gather(offsets) if offsets is not None else None
    if way_back is not None and not _has_nested(data, "responses", "prompts"):  # those define their own lengths
        width = max_response_len if max_response_len is not None else _metadata_width(data)
        if width is not None and width < way_back.width and width < way_back.longest:
            raise _cut(width, way_back.longest)
        if width in (None, way_back.width):
            return way_back.unpad(values)
    resp_lens, width = _response_lengths(data)
    width = max_response_len if max_response_len is not None else width
    ends = _sequence_ends(tensor, data)
    if resp_lens.numel() and free_to_read(resp_lens, ends):  # free: host memory
        starts = ends - torch.nn.functional.pad(ends[:-1], (1, 0))
        longest, no_prompt = to_host(resp_lens.max(), ((resp_lens > 0) & (resp_lens >= starts)).any())
        if width is not None and width < longest:
            raise _cut(width, longest)
        if no_prompt:
            row = int(((resp_lens > 0) & (resp_lens >= starts)).nonzero()[0])
            expected = "a response shorter than its sequence (a prompt of >= 1 token gives its first log-prob)"
            raise input_error(
                "data", row, expected, f"response {int(resp_lens[row])} of a {int(starts[row])}-token row"
            )
    if width is None:
        width = to_host(resp_lens.max())[0]
    ends, resp_lens = ends.to(values.device), resp_lens.to(values.device)
    return gather_rows(values, ends - resp_lens - 1, None, resp_lens, width)


def _has_nested(data: TensorDict, *keys: str) -> bool:
    """Whether ``data`` holds any of ``keys`` as a nested tensor (a membership test first: cheap)."""
    present = data.keys()
    return any(key in present and _is_nested(data.get(key)) for key in keys)


def _cut(width: int, longest: int) -> ValueError:
    expected = f"a response width >= {longest}, the longest response (a narrower one cuts it)"
    return input_error("max_response_len", None, expected, f"{width}")


def _check_belongs_to_batch(tensor: Tensor, values: Tensor, data: TensorDict) -> Tensor | None:
    """The offsets ``tensor``'s rows follow, after checking they are ``data``'s; None if unknown.

    Identity first (free); then the host facts (batch, total); the values only when a different
    offsets tensor got this far (one host sync, on a path nopad's own tensors never take).
    """
    ids: Tensor | None = data.get("input_ids", None) if "input_ids" in data.keys() else None
    batch_offsets, batch_total = None, None
    if ids is not None and _is_nested(ids):
        batch_offsets, batch_total = nested_offsets(ids), jagged_values(ids).shape[0]
    if not _is_nested(tensor):
        total = batch_total
        if total is None:
            indices = get_field(data, "indices")
            total = indices.shape[0] if isinstance(indices, Tensor) else None
        if total is not None and values.shape[0] != total:
            raise input_error("tensor", None, f"{total} tokens (the batch's total)", f"shape {tuple(values.shape)}")
        return batch_offsets
    offsets = nested_offsets(tensor)
    if batch_offsets is None or offsets is batch_offsets:
        return offsets
    expected = f"the rows of data's input_ids: {batch_offsets.shape[0] - 1} rows, {batch_total} tokens"
    got = f"{offsets.shape[0] - 1} rows, {values.shape[0]} tokens"
    if offsets.shape != batch_offsets.shape or values.shape[0] != batch_total:
        raise input_error("tensor", None, expected, got)
    if not torch.equal(offsets, batch_offsets.to(offsets.device)):
        raise input_error("tensor", None, expected + " and their boundaries", "other boundaries (another micro-batch?)")
    return offsets


def response_from_nested(tensor: Tensor, response_mask: Tensor) -> Tensor:
    """Nested full-sequence output (B, j) -> nested response output (B, j_r), shifted by one.

    ``response_mask`` is nested (B, j_r) with the same B; no sync (its values give the total).
    Each response must be shorter than its row (the first log-prob comes from the prompt): checked
    where the lengths live on the CPU (a read of host memory), not on a device (a host sync).
    """
    if not (_is_nested(tensor) and _is_nested(response_mask)):
        raise input_error("tensor/response_mask", None, "two nested tensors", "a dense tensor")
    resp = IndexPlan.from_nested(response_mask)
    offsets = nested_offsets(tensor)
    ends = offsets[1:].to(resp.offsets.device)
    if ends.shape[0] != resp.batch_size:
        raise input_error("response_mask", None, f"{ends.shape[0]} rows like tensor", f"{resp.batch_size} rows")
    if free_to_read(offsets, resp.lengths):
        rows = offsets.diff().to(torch.int64)
        too_long = (resp.lengths > 0) & (resp.lengths >= rows)
        if bool(too_long.any()):
            row = int(too_long.nonzero()[0])
            expected = (
                f"a response shorter than tensor's row ({int(rows[row])} tokens: a prompt gives its first log-prob)"
            )
            raise input_error("response_mask", row, expected, f"{int(resp.lengths[row])} tokens")
    src = resp.token_index(ends - resp.lengths - 1)  # token t's log-prob comes from position t - 1
    return resp.to_nested(jagged_values(tensor).index_select(0, src))


def response_to_nested(tensor: Tensor, response_mask: Tensor) -> Tensor:
    """Padded response (B, R, *) -> nested (B, j_r, *) with the lengths of nested ``response_mask``.

    Every row of ``response_mask`` must fit in R. That is checked on the host from the longest row
    the nested mask records (nopad's nested tensors all do), or else with one host sync.
    """
    if not _is_nested(response_mask):
        raise input_error("response_mask", None, "a nested tensor", "a dense tensor")
    plan = IndexPlan.from_nested(response_mask)
    if not isinstance(tensor, Tensor) or _is_nested(tensor) or tensor.dim() < 2 or tensor.shape[0] != plan.batch_size:
        shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
        raise input_error("tensor", None, f"a padded ({plan.batch_size}, R, ...) tensor", f"{shape}")
    _check_fits(plan, tensor.shape[1], "tensor", "response_mask")
    plan.width = tensor.shape[1]
    return plan.nest(tensor)


def _check_fits(plan: IndexPlan, width: int, field: str, rows_of: str) -> None:
    """Refuse a padded width narrower than the longest row: its gather would read the next row."""
    if plan.max_seqlen > width:
        raise input_error(field, None, f"width >= {plan.max_seqlen}, the longest row of {rows_of}", f"width {width}")


def build_attention_mask_from_nested(input_ids: Tensor, max_seq_len: int | None = None) -> Tensor:
    """Nested (B, j) -> right-padded int32 attention mask (B, max_seq_len).

    ``max_seq_len`` must hold the longest row (checked on the host when ``input_ids`` records it, as
    nopad's nested tensors do; else with one host sync); without it, one sync finds the longest.
    """
    plan = IndexPlan.from_nested(input_ids)
    if max_seq_len is not None:
        max_seq_len = check_int(max_seq_len, "max_seq_len", low=0)
        _check_fits(plan, max_seq_len, "max_seq_len", "input_ids")
    width = max_seq_len if max_seq_len is not None else plan.max_seqlen
    positions = torch.arange(width, device=plan.lengths.device)
    return (positions < plan.lengths.unsqueeze(1)).to(torch.int32)


def _embeds_to_nested(embeds: Tensor, mask: Tensor, field: str) -> tuple[Tensor, Tensor]:
    if embeds.dim() != 3 or tuple(mask.shape) != tuple(embeds.shape[:2]):
        raise input_error(
            field,
            None,
            f"(batch, seqlen, dim) embeds with a {tuple(embeds.shape[:2])} mask",
            f"embeds {tuple(embeds.shape)}, mask {tuple(mask.shape)}",
        )
    plan = IndexPlan.from_mask(mask)  # a selection mask: nonzero = token, as verl reads it
    return plan.nest(embeds), plan.nest(mask.bool())


def embeds_padding_2_no_padding(data: TensorDict) -> TensorDict:
    """prompt_embeds (B, S, D) with prompt_embeds_mask -> nested embeds and masks (also negative_*).

    The mask may have any pattern; only the marked positions are kept. Returns a new TensorDict.
    """
    if not isinstance(data, TensorDict):
        raise input_error("data", None, "a TensorDict", type(data).__name__)
    out = data.copy()
    for prefix in ("prompt", "negative_prompt"):
        key = f"{prefix}_embeds"
        if isinstance(data.get(key, None), Tensor) and not _is_nested(data[key]):
            mask = data.get(f"{key}_mask", None)
            if not isinstance(mask, Tensor):
                raise input_error(f"{key}_mask", None, f"a (batch, seqlen) mask beside {key}", "none")
            out[key], out[f"{key}_mask"] = _embeds_to_nested(data[key], mask, key)
    return out
