"""The catalogue of bad input to the conversions: every case refused, with words that say what to fix.

One parametrised case per bad input, by kind. Each asserts the error type, the words of the
message, and that the call left its inputs as they were. Then near-valid inputs drawn by
hypothesis (a valid batch with one thing off) are refused, while the valid ones still give exact
results. The losses, the packer and the packed files keep their catalogues beside their tests.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

import nopad
import nopad.batches
import nopad.core

# private: the plan's internal gathers are given bad input directly, as their callers cannot
import nopad.core._layout
from tests.batches import batch_shapes, make_batch, reference_response


def _batch(extras: bool = False) -> TensorDict:
    return make_batch([2, 3, 1], [3, 0, 2], 3, 3, extras=extras)


def _converted() -> tuple[TensorDict, torch.Tensor]:
    """A converted micro-batch and a nested model output on its own offsets."""
    out = nopad.left_right_2_no_padding(_batch())
    ids = out["input_ids"]
    return out, torch.nested.nested_tensor_from_jagged(torch.randn(ids.values().shape[0]), ids.offsets())


def _other_boundaries() -> tuple[torch.Tensor, TensorDict]:
    """Same rows and total as the batch, other boundaries: the output of another micro-batch."""
    out, logp = _converted()
    offsets = out["input_ids"].offsets().clone()
    offsets[1] += 1
    return torch.nested.nested_tensor_from_jagged(logp.values(), offsets), out


def _with(key: str, value) -> TensorDict:
    data = _batch()
    data[key] = value
    return data


def _nested(lengths: list[int], values: torch.Tensor | None = None) -> torch.Tensor:
    offsets = nopad.core.prepare_offsets(torch.tensor(lengths))
    values = torch.ones(sum(lengths)) if values is None else values
    return torch.nested.nested_tensor_from_jagged(values, offsets)


@dataclass
class Case:
    kind: str
    name: str
    make: Callable[[], tuple]
    call: Callable
    words: str


def _holes() -> TensorDict:
    data = _batch()
    data["attention_mask"][0, 4] = 0  # a hole inside row 0's response
    return data


def _float_ids() -> TensorDict:
    data = _batch()
    data["input_ids"] = data["input_ids"].float()
    return data


CASES = [
    # ---- outputs that do not belong to the batch ---------------------------------------------
    Case(
        "not the batch's output",
        "nested output on other boundaries",
        _other_boundaries,
        nopad.no_padding_2_padding,
        r"tensor: expected the rows of data's input_ids: 3 rows, 11 tokens and their boundaries, got other boundaries",
    ),
    Case(
        "not the batch's output",
        "nested output of another batch size",
        lambda: (_nested([5, 6]), _converted()[0]),
        nopad.no_padding_2_padding,
        r"tensor: expected the rows of data's input_ids: 3 rows, 11 tokens, got 2 rows, 11 tokens",
    ),
    Case(
        "not the batch's output",
        "nested output with another total",
        lambda: (_nested([2, 3, 2]), _converted()[0]),
        nopad.no_padding_2_padding,
        r"3 rows, 11 tokens, got 3 rows, 7 tokens",
    ),
    Case(
        "not the batch's output",
        "flat output with another total",
        lambda: (torch.zeros(8), _converted()[0]),
        nopad.no_padding_2_padding,
        r"tensor: expected 11 tokens \(the batch's total\), got shape \(8,\)",
    ),
    Case(
        "not the batch's output",
        "response mask of another batch size",
        lambda: (_converted()[1], _nested([1, 1])),
        nopad.response_from_nested,
        r"response_mask: expected 3 rows like tensor, got 2 rows",
    ),
    Case(
        "not the batch's output",
        "a plan of another batch",
        lambda: (_batch(), None),
        lambda data, _: nopad.left_right_2_no_padding(
            data, plan=nopad.plan_left_right(torch.ones(2, 6, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
        ),
        r"plan: expected plan_left_right of this batch: 3 rows of width 6",
    ),
    # ---- reading past a row ----------------------------------------------------------------------
    Case(
        "reading past a row",
        "padded responses narrower than the nested mask",
        lambda: (torch.zeros(2, 2), _nested([3, 1])),
        nopad.response_to_nested,
        r"tensor: expected width >= 3, the longest row of response_mask, got width 2",
    ),
    Case(
        "reading past a row",
        "attention mask narrower than the longest row",
        lambda: (_nested([4, 2]), 3),
        nopad.build_attention_mask_from_nested,
        r"max_seq_len: expected width >= 4, the longest row of input_ids, got width 3",
    ),
    Case(
        "reading past a row",
        "a hole in a row's run",
        lambda: (_holes(),),
        nopad.left_right_2_no_padding,
        r"attention_mask row 0: expected ones forming one run",
    ),
    # ---- wrong types and coercions ---------------------------------------------------------------
    Case(
        "type or coercion",
        "float input_ids",
        lambda: (_float_ids(),),
        nopad.left_right_2_no_padding,
        r"input_ids: expected an integer tensor, got dtype torch.float32",
    ),
    Case(
        "type or coercion",
        "bool position_ids",
        lambda: (_with("position_ids", torch.ones(3, 6, dtype=torch.bool)),),
        nopad.left_right_2_no_padding,
        r"position_ids: expected an integer tensor, got dtype torch.bool",
    ),
    Case(
        "type or coercion",
        "float attention_mask of halves",
        lambda: (_with("attention_mask", _batch()["attention_mask"].float() / 2),),
        nopad.left_right_2_no_padding,
        r"attention_mask row 0: expected a 0/1 mask \(bool, or numbers that are only 0 and 1: a weight is not a "
        r"mask\), got 0.5",
    ),
    Case(
        "type or coercion",
        "a dict instead of a TensorDict",
        lambda: (dict(_batch().items()),),
        nopad.left_right_2_no_padding,
        r"data: expected a TensorDict, got dict",
    ),
    Case(
        "type or coercion",
        "fields given as one string",
        lambda: (_batch(), "values"),
        nopad.left_right_2_no_padding,
        r"fields: expected a list of field names, got the string 'values' \(write \['values'\]\)",
    ),
    Case(
        "type or coercion",
        "max_response_len as a string",
        lambda: (*reversed(_converted()), "3"),
        nopad.no_padding_2_padding,
        r"max_response_len: expected an int >= 0, got '3'",
    ),
    Case(
        "type or coercion",
        "max_response_len as a float",
        lambda: (*reversed(_converted()), 3.0),
        nopad.no_padding_2_padding,
        r"max_response_len: expected an int >= 0, got 3.0",
    ),
    Case(
        "type or coercion",
        "max_seq_len as a bool",
        lambda: (_nested([1, 1]), True),
        nopad.build_attention_mask_from_nested,
        r"max_seq_len: expected an int >= 0, got True",
    ),
    Case(
        "type or coercion",
        "float indices",
        lambda: (torch.zeros(4, 2), torch.tensor([0.0, 2.0])),
        nopad.core.index_first_axis,
        r"indices: expected an integer tensor, got dtype torch.float32",
    ),
    Case(
        "type or coercion",
        "model output that is not a tensor",
        lambda: ([0.1, 0.2], _converted()[0]),
        nopad.no_padding_2_padding,
        r"tensor: expected a nested \(B, j, \*\) or flat \(total, \*\) tensor, got list",
    ),
    # ---- shapes ----------------------------------------------------------------------------------
    Case(
        "shape",
        "response_mask as wide as the sequence",
        lambda: (_with("response_mask", torch.ones(3, 6, dtype=torch.long)),),
        nopad.left_right_2_no_padding,
        r"response_mask: expected shape \(3, R\) with R < seqlen 6, got \(3, 6\)",
    ),
    Case(
        "shape",
        "per-token field of the wrong width",
        lambda: (_with("values", torch.zeros(3, 5)), ["values"]),
        nopad.left_right_2_no_padding,
        r"values: expected a per-token tensor of shape \(3, 6, ...\), got \(3, 5\)",
    ),
    Case(
        "shape",
        "padded responses of another batch size",
        lambda: (torch.zeros(3, 4), _nested([1, 1])),
        nopad.response_to_nested,
        r"tensor: expected a padded \(2, R, ...\) tensor, got \(3, 4\)",
    ),
    Case(
        "shape",
        "unpad_input mask of another shape",
        lambda: (torch.zeros(2, 5, 3), torch.ones(2, 4, dtype=torch.long)),
        nopad.core.unpad_input,
        r"attention_mask: expected shape \(2, 5\) like hidden's first two dims, got \(2, 4\)",
    ),
    Case(
        "shape",
        "pad_input with fewer indices than rows",
        lambda: (torch.zeros(3, 2), torch.tensor([0, 1]), 2, 2),
        nopad.core.pad_input,
        r"indices: expected shape \(3,\), got shape \(2,\)",
    ),
    Case(
        "shape",
        "embeds without their mask",
        lambda: (TensorDict({"prompt_embeds": torch.zeros(2, 3, 4)}, batch_size=[2]),),
        nopad.embeds_padding_2_no_padding,
        r"prompt_embeds_mask: expected a \(batch, seqlen\) mask beside prompt_embeds, got none",
    ),
]


# ---- issue 22: a plan or boundaries of something else, widths that cut, coercions, flags, masks ----
def _other_mask_plan(data: TensorDict) -> TensorDict:
    """A plan of another mask of the same shape (rows 0 and 2 swapped) given with this batch."""
    other = data["attention_mask"][[2, 1, 0]]
    return nopad.left_right_2_no_padding(data, plan=nopad.plan_left_right(other, data["response_mask"]))


def _narrow_plan(data: TensorDict) -> TensorDict:
    """A plan of this attention mask (full rows) but of responses 2 wide, given with responses 3 wide."""
    return nopad.left_right_2_no_padding(data, plan=nopad.plan_left_right(data["attention_mask"], torch.ones(3, 2)))


def _metadata_width(value) -> tuple:
    out, logp = _converted()
    out.set_non_tensor("max_response_len", value)
    return logp, out


CASES += [
    Case(
        "not the batch's output",
        "a plan of another mask of the same shape",
        lambda: (_batch(),),
        _other_mask_plan,
        r"plan row 0: expected plan_left_right of this batch's attention_mask, got a plan of another mask",
    ),
    Case(
        "not the batch's output",
        "a plan of another response width",
        lambda: (make_batch([3, 3, 3], [3, 3, 3], 3, 3, extras=False),),
        _narrow_plan,
        r"plan: expected plan_left_right of this batch: responses of width 3, got a plan of responses of width 2",
    ),
    Case(
        "not the batch's output",
        "unnest of a nested tensor on other boundaries",
        lambda: (_nested([1, 4]),),
        lambda nested: nopad.IndexPlan.from_lengths([3, 2]).unnest(nested),
        r"nested: expected the plan's 2 rows of 5 tokens and their boundaries, got other boundaries",
    ),
    Case(
        "reading past a row",
        "max_response_len narrower than the responses",
        lambda: (*reversed(_converted()), 2),
        nopad.no_padding_2_padding,
        r"max_response_len: expected a response width >= 3, the longest response \(a narrower one cuts it\), got 2",
    ),
    Case(
        "reading past a row",
        "a response as long as its row",
        lambda: (_nested([3, 4]), _nested([3, 2])),
        nopad.response_from_nested,
        r"response_mask row 0: expected a response shorter than tensor's row \(3 tokens: a prompt gives its first "
        r"log-prob\), got 3 tokens",
    ),
    Case(
        "reading past a row",
        "a plan narrower than its longest row",
        lambda: (torch.arange(12).view(2, 6),),
        lambda x: nopad.IndexPlan.from_lengths([7, 2], width=6).pack(x),
        r"width: expected >= 7, where the longest run of real tokens ends, got 6",
    ),
    Case(
        "reading past a row",
        "unpack narrower than the longest row",
        lambda: (torch.arange(9.0),),
        lambda v: nopad.IndexPlan.from_lengths([7, 2]).unpack(v, width=3),
        r"width: expected >= 7, where the longest run of real tokens ends, got 3",
    ),
    Case(
        "reading past a row",
        "runs that start past the width",
        lambda: (torch.arange(5.0),),
        lambda v: nopad.IndexPlan.from_lengths([3, 2], width=4, starts=torch.tensor([2, 0])).unpack(v),
        r"width: expected >= 5, where the longest run of real tokens ends, got 4",
    ),
    Case(
        "reading past a row",
        "offsets whose longest row does not fit the width",
        lambda: (torch.tensor([0, 4, 6]),),
        lambda offsets: nopad.IndexPlan.from_offsets(offsets, width=3),
        r"width: expected >= 4, the longest row, got 3",
    ),
    Case(
        "reading past a row",
        "a nested tensor's plan narrower than its longest row",
        lambda: (_nested([4, 1]),),
        lambda nested: nopad.IndexPlan.from_nested(nested, width=2),
        r"width: expected >= 4, where the longest run of real tokens ends, got 2",
    ),
    Case(
        "reading past a row",
        "values of another total wrapped on the plan's offsets",
        lambda: (torch.arange(3.0),),
        lambda v: nopad.IndexPlan.from_lengths([2, 3]).to_nested(v),
        r"values: expected 5 tokens on dim 0, got shape \(3,\)",
    ),
    Case(
        "reading past a row",
        "row starts for another batch size",
        lambda: (torch.tensor([0]),),
        lambda row_start: nopad.IndexPlan.from_lengths([3, 2]).token_index(row_start),
        r"row_start: expected shape \(2,\), got \(1,\)",
    ),
    Case(
        "reading past a row",
        "a total that is not the lengths' sum",
        lambda: (torch.tensor([3, 2]),),
        lambda lengths: nopad.IndexPlan.from_lengths(lengths, total=4),
        r"total: expected the sum of the lengths, 5, got 4",
    ),
    Case(
        "reading past a row",
        "starts of another batch size",
        lambda: (torch.tensor([3, 2]),),
        lambda lengths: nopad.IndexPlan.from_lengths(lengths, width=5, starts=torch.tensor([0])),
        r"starts: expected shape \(2,\) like lengths, got \(1,\)",
    ),
    Case(
        "type or coercion",
        "float lengths in a list",
        lambda: ([3.7, 2.2],),
        nopad.IndexPlan.from_lengths,
        r"lengths: expected a 1-D tensor or sequence of integers \(nothing is rounded\), got list of dtype float64",
    ),
    Case(
        "type or coercion",
        "bool lengths",
        lambda: (torch.tensor([True, False]),),
        nopad.IndexPlan.from_lengths,
        r"lengths: expected a 1-D tensor or sequence of integers, got dtype torch.bool",
    ),
    Case(
        "type or coercion",
        "float lengths tensor",
        lambda: (torch.tensor([3.5, 2.0]),),
        nopad.IndexPlan.from_lengths,
        r"lengths: expected a 1-D tensor or sequence of integers, got dtype torch.float32",
    ),
    Case(
        "type or coercion",
        "lengths as strings",
        lambda: (["3", "2"],),
        nopad.IndexPlan.from_lengths,
        r"lengths: expected a 1-D tensor or sequence of integers \(nothing is rounded\), got list of dtype <U1",
    ),
    Case(
        "type or coercion",
        "float offsets",
        lambda: (torch.tensor([0.0, 1.5, 3.0]),),
        nopad.IndexPlan.from_offsets,
        r"offsets: expected a 1-D tensor or sequence of integers, got dtype torch.float32",
    ),
    Case(
        "type or coercion",
        "float lengths to prepare_offsets",
        lambda: (torch.tensor([1.5, 2.5]),),
        nopad.core.prepare_offsets,
        r"lengths: expected an integer tensor, got dtype torch.float32",
    ),
    Case(
        "type or coercion",
        "a width given as a float",
        lambda: ([3, 2],),
        lambda lengths: nopad.IndexPlan.from_lengths(lengths, width=2.5),
        r"width: expected an int in \[0, 2147483647\], got 2.5",
    ),
    Case(
        "type or coercion",
        "max_response_len metadata as a string",
        lambda: _metadata_width("3"),
        nopad.no_padding_2_padding,
        r"data\['max_response_len'\]: expected an int >= 0, got '3'",
    ),
    Case(
        "flag",
        "check_response_mask as a string",
        lambda: (_batch(),),
        lambda data: nopad.left_right_2_no_padding(data, check_response_mask="false"),
        r"check_response_mask: expected True or False \(a bool\), got 'false' \(str\)",
    ),
    Case(
        "flag",
        "plus_position as a string",
        lambda: (torch.tensor([1, 2]), torch.tensor([0, 1, 3])),
        lambda per_row, offsets: nopad.core._layout.spread_over_tokens(per_row, offsets, 3, plus_position="false"),
        r"plus_position: expected True or False \(a bool\), got 'false' \(str\)",
    ),
    Case(
        "flag",
        "non_blocking as a string",
        lambda: ([3, 2],),
        lambda lengths: nopad.IndexPlan.from_lengths(lengths).to("meta", non_blocking="no"),
        r"non_blocking: expected True or False \(a bool\), got 'no' \(str\)",
    ),
    Case(
        "flag",
        "a field to nest that data does not hold",
        lambda: (_batch(extras=True),),
        lambda data: nopad.left_right_2_no_padding(data, ["teacher_logprob"]),
        r"fields: expected names of per-token fields of data \(keys .*\), got \['teacher_logprob'\]",
    ),
    Case(
        "mask not 0/1",
        "unpad_input with a mask of 2s",
        lambda: (torch.arange(6.0).view(2, 3, 1), torch.tensor([[2, 2, 0], [2, 0, 0]])),
        nopad.core.unpad_input,
        r"attention_mask row 0: expected a 0/1 mask \(bool, or numbers that are only 0 and 1: a weight is not a "
        r"mask\), got 2",
    ),
    Case(
        "mask not 0/1",
        "unpad_input with a mask of halves",
        lambda: (torch.arange(6.0).view(2, 3, 1), torch.tensor([[0.5, 0.5, 0], [0.5, 0, 0]])),
        nopad.core.unpad_input,
        r"attention_mask row 0: expected a 0/1 mask .*got 0.5",
    ),
    Case(
        "mask not 0/1",
        "unpad_input with an unused mask of halves",
        lambda: (torch.zeros(2, 3, 1), torch.ones(2, 3, dtype=torch.long), torch.full((2, 3), 0.5)),
        nopad.core.unpad_input,
        r"unused_mask row 0: expected a 0/1 mask .*got 0.5",
    ),
    Case(
        "weak message",
        "indices past the first axis",
        lambda: (torch.zeros(3, 2), torch.tensor([0, 5])),
        nopad.core.index_first_axis,
        r"indices: expected indices in \[0, 3\) \(rows of the first axis\), got 5",
    ),
    Case(
        "weak message",
        "negative indices to put",
        lambda: (torch.ones(2), torch.tensor([0, -1]), 3),
        nopad.core.index_put_first_axis,
        r"indices: expected indices in \[0, 3\) \(rows of the first axis\), got -1",
    ),
    Case(
        "weak message",
        "next-token labels of another total",
        lambda: (torch.arange(4),),
        lambda values: nopad.IndexPlan.from_lengths([3, 2]).next_token_labels(values),
        r"values: expected 5 tokens on dim 0, got shape \(4,\)",
    ),
]


def _freeze(x):
    """A copy of what ``x`` holds, to compare with after the call (nested tensors as values + offsets)."""
    if nopad.core._layout.is_nested(x):
        return ("nested", x.values().clone(), x.offsets().clone())
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (TensorDict, dict)):
        return {k: _freeze(x[k]) for k in x.keys()}
    return copy.deepcopy(x)


def _same(before, x) -> bool:
    if isinstance(before, tuple) and before[:1] == ("nested",):
        return torch.equal(before[1], x.values()) and torch.equal(before[2], x.offsets())
    if isinstance(before, torch.Tensor):
        return torch.equal(before, x)
    if isinstance(before, dict):
        return set(before) == set(x.keys()) and all(_same(before[k], x[k]) for k in before)
    return before == x


@pytest.mark.parametrize("case", CASES, ids=[f"{c.kind}: {c.name}" for c in CASES])
def test_bad_input_is_refused_with_what_to_fix_and_the_input_is_left_alone(case):
    args = case.make()
    before = [_freeze(a) for a in args]
    with pytest.raises(ValueError, match=case.words):
        case.call(*args)
    assert all(_same(b, a) for b, a in zip(before, args))


def test_the_catalogue_covers_every_kind():
    kinds = {c.kind for c in CASES}
    assert kinds == {
        "not the batch's output",
        "reading past a row",
        "type or coercion",
        "shape",
        "flag",
        "mask not 0/1",
        "weak message",
    }


# ---- near-valid inputs, drawn -------------------------------------------------------------------


@given(shape=batch_shapes(), data=st.data())
def test_a_nested_output_moved_onto_other_boundaries_is_refused(shape, data):
    prompt_lens, resp_lens, P, R = shape
    out = nopad.left_right_2_no_padding(make_batch(prompt_lens, resp_lens, P, R, extras=False))
    offsets = out["input_ids"].offsets()
    lengths = offsets.diff().tolist()
    total = int(offsets[-1])
    logp = torch.randn(total, dtype=torch.float64)
    # move one token from one row to another: same batch size, same total, other boundaries
    donors = [b for b, n in enumerate(lengths) if n > 0]
    if len(lengths) < 2 or not donors:
        return
    donor = data.draw(st.sampled_from(donors))
    taker = data.draw(st.sampled_from([b for b in range(len(lengths)) if b != donor]))
    moved = list(lengths)
    moved[donor] -= 1
    moved[taker] += 1
    other = _nested(moved, logp)
    with pytest.raises(ValueError, match="other boundaries"):
        nopad.no_padding_2_padding(other, out)
    # the same boundaries in a tensor of their own are the batch's: compared by value, exact result
    same = torch.nested.nested_tensor_from_jagged(logp, offsets.clone())
    want = reference_response(list(logp.split(lengths)), resp_lens, R)
    assert torch.equal(nopad.no_padding_2_padding(same, out), want)
    assert torch.equal(nopad.no_padding_2_padding(torch.nested.nested_tensor_from_jagged(logp, offsets), out), want)


@given(shape=batch_shapes(), data=st.data())
def test_a_batch_with_one_field_off_is_refused_and_the_valid_one_converts_exactly(shape, data):
    prompt_lens, resp_lens, P, R = shape
    batch = make_batch(prompt_lens, resp_lens, P, R, extras=False)
    off = data.draw(st.sampled_from(["none", "float ids", "float positions", "float mask", "wide response"]))
    if off == "float ids":
        batch["input_ids"] = batch["input_ids"].double()
    elif off == "float positions":
        batch["position_ids"] = batch["position_ids"].float()
    elif off == "float mask":
        batch["attention_mask"] = batch["attention_mask"].half() * 2
    elif off == "wide response":
        batch["response_mask"] = torch.ones(len(prompt_lens), P + R, dtype=torch.long)
    if off != "none":
        with pytest.raises(ValueError, match=r"expected (an integer|shape|a 0/1 mask)"):
            nopad.left_right_2_no_padding(batch)
        return
    out = nopad.left_right_2_no_padding(batch)
    for b, row in enumerate(out["input_ids"].unbind()):
        assert torch.equal(row, batch["input_ids"][b][batch["attention_mask"][b].bool()])


@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5), narrower=st.integers(1, 3))
def test_a_padded_width_narrower_than_a_row_is_refused_never_read_past(lengths, narrower):
    longest = max(lengths)
    mask = _nested(lengths)
    width = longest - narrower
    if width < 0:
        return
    if longest > width:
        with pytest.raises(ValueError, match=f"expected width >= {longest}"):
            nopad.response_to_nested(torch.zeros(len(lengths), width), mask)
    padded = torch.arange(len(lengths) * longest, dtype=torch.float32).view(len(lengths), longest)
    got = nopad.response_to_nested(padded, mask)
    for b, n in enumerate(lengths):
        assert torch.equal(got[b], padded[b, :n])


# ---- valid edges: accepted, and exact ---------------------------------------------------------------
def test_a_float_or_bool_0_1_attention_mask_converts_exactly_as_the_integer_one():
    data = _batch()
    want = nopad.left_right_2_no_padding(data)
    for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.uint8):
        other = _with("attention_mask", data["attention_mask"].to(dtype))
        got = nopad.left_right_2_no_padding(other)
        assert torch.equal(got["input_ids"].values(), want["input_ids"].values()), dtype
        assert torch.equal(got["input_ids"].offsets(), want["input_ids"].offsets()), dtype
    mask = data["attention_mask"]
    hidden = torch.randn(*mask.shape, 2)
    ref = nopad.core.unpad_input(hidden, mask)
    for dtype in (torch.float64, torch.bool):
        got = nopad.core.unpad_input(hidden, mask.to(dtype))
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(got, ref))


def test_a_plan_from_an_equal_copy_of_the_mask_is_accepted_and_exact():
    data = _batch()
    plan = nopad.plan_left_right(data["attention_mask"].clone(), data["response_mask"])  # another tensor, equal
    got = nopad.left_right_2_no_padding(data, plan=plan)
    want = nopad.left_right_2_no_padding(data)
    assert torch.equal(got["input_ids"].values(), want["input_ids"].values())
    assert torch.equal(got["position_ids"].values(), want["position_ids"].values())


def test_a_response_width_wider_than_r_pads_with_zeros_exactly():
    out, logp = _converted()
    narrow = nopad.no_padding_2_padding(logp, out)
    wide = nopad.no_padding_2_padding(logp, out, max_response_len=5)
    assert wide.shape == (3, 5) and torch.equal(wide[:, :3], narrow) and not wide[:, 3:].any()


def test_runs_with_starts_and_no_width_are_planned_to_where_they_end():
    """The width defaults to where the longest run ends (it was the longest length: a run at start 3
    of a 2-token row was read from the next row)."""
    plan = nopad.IndexPlan.from_lengths([2, 1], starts=torch.tensor([3, 0]))
    assert plan.width == 5
    padded = torch.arange(10).view(2, 5)
    assert plan.pack(padded).tolist() == [3, 4, 5]
    assert plan.unpack(torch.tensor([7, 8, 9])).tolist() == [[0, 0, 0, 7, 8], [9, 0, 0, 0, 0]]


def test_numpy_ints_are_ints_for_the_plan():
    plan = nopad.IndexPlan.from_lengths(np.array([3, 2], dtype=np.int32), width=np.int64(4))
    assert plan.width == 4 and type(plan.width) is int and plan.lengths.tolist() == [3, 2]
    assert nopad.IndexPlan.from_lengths(torch.tensor([3, 2], dtype=torch.uint8)).lengths.dtype == torch.int64


def test_nested_responses_define_the_response_as_verl_reads_them():
    """verl's test_no_padding_2_padding_varying_lengths: right-padded rows whose attention ends at column
    S - R, with the prompts and responses given nested. The plan sees every row as a prompt alone; the
    nested responses say otherwise, and they decide (this gave all zeros, silently)."""
    prompt_lens, response_lens, S, R = [10, 30, 5, 40], [40, 20, 45, 10], 100, 50
    B = len(prompt_lens)
    input_ids = torch.zeros(B, S, dtype=torch.long)
    attention_mask = torch.zeros(B, S)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        input_ids[i, : p + r] = torch.arange(1, p + r + 1)
        attention_mask[i, : p + r] = 1
    response_mask = (torch.arange(R) < torch.tensor(response_lens).unsqueeze(1)).float()
    rows = [input_ids[i, : p + r] for i, (p, r) in enumerate(zip(prompt_lens, response_lens))]
    data = TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "position_ids": torch.arange(S).expand(B, S).clone(),
            "prompts": torch.nested.as_nested_tensor([x[:p] for x, p in zip(rows, prompt_lens)], layout=torch.jagged),
            "responses": torch.nested.as_nested_tensor([x[p:] for x, p in zip(rows, prompt_lens)], layout=torch.jagged),
        },
        batch_size=[B],
    )
    out = nopad.left_right_2_no_padding(data)
    ids = out["input_ids"]
    logp = torch.nested.nested_tensor_from_jagged(ids.values().float(), ids.offsets())
    got = nopad.no_padding_2_padding(logp, out)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        assert torch.equal(got[i, :r], torch.arange(p, p + r, dtype=torch.float)), i
        assert not got[i, r:].any()


CASES_MORE = [
    Case(
        "flag",
        "check_response_mask with a plan made elsewhere",
        lambda: (_batch(),),
        lambda data: nopad.left_right_2_no_padding(
            data, plan=nopad.plan_left_right(data["attention_mask"], data["response_mask"]), check_response_mask=True
        ),
        r"check_response_mask: expected check_response_mask=False with a plan \(pass it to plan_left_right, which "
        r"reads the masks\), got True",
    ),
    Case(
        "weak message",
        "to_host of a tensor that is not a scalar",
        lambda: (torch.tensor([1, 2]),),
        nopad.core._layout.to_host,
        r"scalars: expected 0-d \(one-element\) tensors, got \[\(2,\)\]",
    ),
    Case(
        "weak message",
        "a negative width to gather_rows",
        lambda: (torch.arange(5.0), torch.tensor([0, 3]), None, torch.tensor([3, 2])),
        lambda *args: nopad.core._layout.gather_rows(*args, -1),
        r"width: expected an int >= 0, got -1",
    ),
    # issue 36: a total past the lengths' sum gave the tokens past them the last row (or position)
    Case(
        "reading past a row",
        "prepare_row_ids with a total larger than the lengths' sum",
        lambda: (torch.tensor([2, 3]), 7),
        nopad.core.prepare_row_ids,
        r"total: expected the sum of the lengths, 5, got 7",
    ),
    Case(
        "reading past a row",
        "prepare_row_ids with a total short of the lengths' sum",
        lambda: (torch.tensor([2, 3]), 4),
        nopad.core.prepare_row_ids,
        r"total: expected the sum of the lengths, 5, got 4",
    ),
    Case(
        "reading past a row",
        "prepare_position_ids with a total past the last offset",
        lambda: (torch.tensor([0, 2, 5]), 7),
        nopad.core.prepare_position_ids,
        r"total: expected the last offset, 5, got 7",
    ),
    Case(
        "reading past a row",
        "prepare_position_ids with offsets not from 0",
        lambda: (torch.tensor([1, 2, 5]), 5),
        nopad.core.prepare_position_ids,
        r"offsets: expected boundaries from 0 to total 5, got 1..5",
    ),
    Case(
        "mask not 0/1",
        "embeds with a float mask of halves, named",
        lambda: (
            TensorDict({"prompt_embeds": torch.zeros(2, 3, 4), "prompt_embeds_mask": torch.full((2, 3), 0.5)}, [2]),
        ),
        nopad.embeds_padding_2_no_padding,
        r"mask row 0: expected a 0/1 mask .*got 0.5",
    ),
]


@pytest.mark.parametrize("case", CASES_MORE, ids=[f"{c.kind}: {c.name}" for c in CASES_MORE])
def test_more_bad_input_is_refused_with_what_to_fix(case):
    args = case.make()
    before = [_freeze(a) for a in args]
    with pytest.raises(ValueError, match=case.words):
        case.call(*args)
    assert all(_same(b, a) for b, a in zip(before, args))


def test_row_ids_and_positions_of_a_right_total_are_served_and_on_a_device_not_read(device_path):
    assert nopad.core.prepare_row_ids(torch.tensor([2, 0, 3]), 5).tolist() == [0, 0, 2, 2, 2]
    assert nopad.core.prepare_position_ids(torch.tensor([0, 2, 2, 5]), 5).tolist() == [0, 1, 0, 1, 2]
    assert nopad.core.prepare_row_ids(torch.tensor([2, 3]), 7).shape == (7,)  # a device's: the caller vouches


def test_an_integer_mask_selects_its_nonzero_entries_as_the_gathers_read_it():
    """A selection mask is read as nonzero = token on every path (the plan, the gathers): a mask of 2s
    or a negative response mask converts exactly as the 0/1 mask does, at no extra pass."""
    plan, twos = (
        nopad.IndexPlan.from_mask(torch.tensor([[1, 0], [1, 1]])),
        nopad.IndexPlan.from_mask(torch.tensor([[2, 0], [1, 1]])),
    )
    assert torch.equal(plan.indices, twos.indices) and torch.equal(plan.lengths, twos.lengths)
    data = _batch()
    want = nopad.left_right_2_no_padding(data)
    for key, scaled in (("attention_mask", 2), ("response_mask", -1)):
        got = nopad.left_right_2_no_padding(_with(key, data[key] * scaled), check_response_mask=True)
        for field in ("input_ids", "position_ids"):
            assert torch.equal(got[field].values(), want[field].values())
            assert torch.equal(got[field].offsets(), want[field].offsets())
