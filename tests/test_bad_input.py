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

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

import nopad
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
    offsets = nopad.prepare_offsets(torch.tensor(lengths))
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
        "float attention_mask",
        lambda: (_with("attention_mask", _batch()["attention_mask"].float()),),
        nopad.left_right_2_no_padding,
        r"attention_mask: expected an integer or bool mask, got dtype torch.float32",
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
        nopad.index_first_axis,
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
        nopad.unpad_input,
        r"attention_mask: expected shape \(2, 5\) like hidden's first two dims, got \(2, 4\)",
    ),
    Case(
        "shape",
        "pad_input with fewer indices than rows",
        lambda: (torch.zeros(3, 2), torch.tensor([0, 1]), 2, 2),
        nopad.pad_input,
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


def _freeze(x):
    """A copy of what ``x`` holds, to compare with after the call (nested tensors as values + offsets)."""
    if nopad.is_nested(x):
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
    assert kinds == {"not the batch's output", "reading past a row", "type or coercion", "shape"}


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
        batch["attention_mask"] = batch["attention_mask"].half()
    elif off == "wide response":
        batch["response_mask"] = torch.ones(len(prompt_lens), P + R, dtype=torch.long)
    if off != "none":
        with pytest.raises(ValueError, match=r"expected (an integer|shape)"):
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
