import pickle

import pytest
import tensordict
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

import nopad
import nopad.batches
import nopad.core
from nopad import OpCounter, left_right_2_no_padding, plan_left_right
from tests.batches import batch_shapes, make_batch, reference_nest, reference_response
from tests.models import make_padded_batch

PER_TOKEN = ("input_ids", "routed_experts", "teacher_logprobs", "teacher_ids")


def _rows(nested: torch.Tensor) -> list[torch.Tensor]:
    return list(nested.unbind())


@given(shape=batch_shapes(), mrope=st.sampled_from([0, 3, 4]))
def test_padded_nested_padded_round_trip_is_bit_exact(shape, mrope):
    prompt_lens, resp_lens, P, R = shape
    data = make_batch(prompt_lens, resp_lens, P, R, mrope=mrope, float_ids=True)
    out = nopad.left_right_2_no_padding(data, fields=["values"])
    mask = data["attention_mask"]
    plan = nopad.plan_left_right(mask, data["response_mask"])
    for key in (*PER_TOKEN, "values"):
        nested = out[key]
        assert nested.is_nested and nested._ragged_idx == 1 and nested.dtype == data[key].dtype
        for got, want in zip(_rows(nested), reference_nest(data[key], mask)):
            assert torch.equal(got, want)
        back = plan.unnest(nested)
        assert torch.equal(back, data[key] * mask.view(*mask.shape, *[1] * (data[key].dim() - 2)).to(data[key].dtype))
    pos = out["position_ids"]
    seq_dim = 2 if mrope else 1
    assert pos._ragged_idx == seq_dim and pos.shape[:seq_dim] == data["position_ids"].shape[:seq_dim]
    for got, want in zip(_rows(pos), reference_nest(data["position_ids"], mask, seq_dim)):
        assert torch.equal(got, want)
    assert torch.equal(out["loss_mask"], data["response_mask"])
    assert out.get_non_tensor("max_seq_len") == P + R and out.get_non_tensor("max_response_len") == R


@given(shape=batch_shapes(), trailing=st.sampled_from([(), (3,), (2, 2)]))
def test_no_padding_2_padding_matches_per_row_slices(shape, trailing):
    prompt_lens, resp_lens, P, R = shape
    data = make_batch(prompt_lens, resp_lens, P, R, extras=False)
    out = nopad.left_right_2_no_padding(data)
    offsets = out["input_ids"].offsets()
    total = int(offsets[-1])
    logp = torch.randn(total, *trailing, dtype=torch.float64)
    nested = torch.nested.nested_tensor_from_jagged(logp, offsets)
    want = reference_response(list(logp.split(offsets.diff().tolist())), resp_lens, R)
    assert torch.equal(nopad.no_padding_2_padding(nested, out), want)
    assert torch.equal(nopad.no_padding_2_padding(logp, out), want)  # flat (total, *) input
    # nested prompts/responses instead of padded ones, as verl's rollout produces them
    alt = TensorDict({}, batch_size=[len(prompt_lens)])
    alt["prompts"] = torch.nested.nested_tensor_from_jagged(
        torch.zeros(sum(prompt_lens), dtype=torch.long), nopad.core.prepare_offsets(torch.tensor(prompt_lens))
    )
    alt["responses"] = torch.nested.nested_tensor_from_jagged(
        torch.zeros(sum(resp_lens), dtype=torch.long), nopad.core.prepare_offsets(torch.tensor(resp_lens))
    )
    assert torch.equal(nopad.no_padding_2_padding(nested, alt, max_response_len=R), want)


def test_no_padding_2_padding_gradient_reaches_each_source_token_once():
    data = make_batch([2, 3, 1], [3, 0, 2], 3, 3, extras=False)
    out = nopad.left_right_2_no_padding(data)
    offsets = out["input_ids"].offsets()
    values = torch.randn(int(offsets[-1]), dtype=torch.float64, requires_grad=True)
    nested = torch.nested.nested_tensor_from_jagged(values, offsets)
    weights = torch.randn(3, 3, dtype=torch.float64)
    (nopad.no_padding_2_padding(nested, out) * weights).sum().backward()
    expected = torch.zeros_like(values)
    for b, (end, r) in enumerate(zip(offsets[1:].tolist(), [3, 0, 2])):
        expected[end - r - 1 : end - 1] = weights[b, :r]
    assert torch.equal(values.grad, expected)


def test_caller_tensordict_is_not_mutated():
    data = make_batch([2, 1], [1, 2], 2, 2)
    before = {k: v.clone() for k, v in data.items()}
    nopad.left_right_2_no_padding(data)
    assert set(data.keys()) == set(before) and all(torch.equal(data[k], v) for k, v in before.items())
    assert not data["input_ids"].is_nested


@pytest.mark.parametrize("B", [1, 4])
def test_all_equal_lengths_and_single_row_keep_the_ragged_dim(B):
    data = make_batch([3] * B, [2] * B, 3, 2, mrope=4)
    out = nopad.left_right_2_no_padding(data)
    assert out["input_ids"].is_nested and out["input_ids"].shape[0] == B
    pos = out["position_ids"]
    assert pos.is_nested and pos._ragged_idx == 2 and tuple(pos.shape[:2]) == (B, 4)
    assert pos.values().shape == (4, 5 * B)


def test_nested_fields_survive_pickle_and_tensordict_ops():
    data = make_batch([2, 3, 1, 3], [2, 1, 2, 0], 3, 2, mrope=4)
    out = nopad.left_right_2_no_padding(data)
    tensors = out.select("input_ids", "position_ids", "routed_experts")
    for label, td in [
        ("pickle", pickle.loads(pickle.dumps(tensors))),
        ("select", tensors.select("input_ids", "position_ids")),
        ("clone", tensors.clone()),
    ]:
        for key in td.keys():
            a, b = td[key], tensors[key]
            assert a.is_nested and a._ragged_idx == b._ragged_idx, (label, key)
            assert torch.equal(a.offsets(), b.offsets()), (label, key)
            assert all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind())), (label, key)
    # tensordict 0.8-0.10 (verl's pins) cannot index nested fields (torch cannot slice a jagged
    # tensor on the batch dim); nopad.batches.select_rows does it under every version, the same as 0.15 does
    for index, picked_rows in (
        (slice(1, 3), [1, 2]),
        (torch.tensor([3, 0]), [3, 0]),
        ([2], [2]),
        (torch.tensor([True, False, False, True]), [0, 3]),
    ):
        sub = nopad.batches.select_rows(tensors, index)
        assert sub.batch_size == torch.Size([len(picked_rows)])
        for key in tensors.keys():
            assert sub[key].is_nested and sub[key]._ragged_idx == tensors[key]._ragged_idx, key
            rows = zip(sub[key].unbind(), picked_rows, strict=True)
            assert all(torch.equal(x, tensors[key].unbind()[i]) for x, i in rows)
        try:
            native = tensors[index]
        except (RuntimeError, NotImplementedError):  # torch's own refusal, which select_rows avoids
            assert tuple(int(x) for x in tensordict.__version__.split(".")[:2]) < (0, 11)
        else:
            for key in tensors.keys():
                assert all(torch.equal(x, y) for x, y in zip(native[key].unbind(), sub[key].unbind(), strict=True))
    with pytest.raises(ValueError, match="index"):
        nopad.batches.select_rows(tensors, 1)


def test_response_from_and_to_nested_are_the_shifted_slice_and_its_inverse():
    data = make_batch([2, 3, 1], [3, 1, 2], 3, 3, extras=False)
    out = nopad.left_right_2_no_padding(data)
    offsets = out["input_ids"].offsets()
    values = torch.randn(int(offsets[-1]), 2)
    full = torch.nested.nested_tensor_from_jagged(values, offsets)
    resp_mask = nopad.response_to_nested(
        data["response_mask"],
        torch.nested.nested_tensor_from_jagged(torch.ones(6, dtype=torch.long), torch.tensor([0, 3, 4, 6])),
    )
    sliced = nopad.response_from_nested(full, resp_mask)
    padded = nopad.no_padding_2_padding(full, out)
    for b, row in enumerate(sliced.unbind()):
        assert torch.equal(row, padded[b, : row.shape[0]])
    back = nopad.response_to_nested(padded, resp_mask)
    assert all(torch.equal(x, y) for x, y in zip(back.unbind(), sliced.unbind()))


def test_build_attention_mask_from_nested():
    ids = torch.nested.nested_tensor_from_jagged(torch.arange(6), torch.tensor([0, 1, 4, 6]))
    want = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.int32)
    assert torch.equal(nopad.build_attention_mask_from_nested(ids, 4), want)
    assert torch.equal(nopad.build_attention_mask_from_nested(ids), want[:, :3])


def test_embeds_padding_2_no_padding():
    embeds = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    data = TensorDict(
        {
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
            "negative_prompt_embeds": embeds * 2,
            "negative_prompt_embeds_mask": mask,
        },
        batch_size=[2],
    )
    out = nopad.embeds_padding_2_no_padding(data)
    for prefix, scale in (("prompt", 1), ("negative_prompt", 2)):
        rows = out[f"{prefix}_embeds"].unbind()
        assert torch.equal(rows[0], embeds[0, :2] * scale) and torch.equal(rows[1], embeds[1, :3] * scale)
        assert [m.tolist() for m in out[f"{prefix}_embeds_mask"].unbind()] == [[True] * 2, [True] * 3]
    assert not data["prompt_embeds"].is_nested


# ---- bad input: ValueError naming the field, the row and what was expected ---------------------------
def _bad(data, match, **kw):
    with pytest.raises(ValueError, match=match):
        nopad.left_right_2_no_padding(data, **kw)


def test_missing_key():
    data = make_batch([1], [1], 2, 2)
    del data["position_ids"]
    _bad(data, r"missing \['position_ids'\]")


def test_prompt_not_left_padded_names_the_row():
    data = make_batch([2, 2], [1, 1], 3, 2)
    data["attention_mask"][1] = torch.tensor([1, 1, 0, 1, 0])
    _bad(data, r"attention_mask row 1: expected ones forming one run.*got attention_mask \[1, 1, 0, 1, 0\]")


def test_hole_in_response_names_the_row():
    data = make_batch([1, 2, 2], [2, 3, 1], 2, 3)
    data["attention_mask"][2] = torch.tensor([1, 1, 1, 0, 1])
    _bad(data, r"attention_mask row 2")


def test_empty_prompt_with_response():
    data = make_batch([1, 1], [1, 1], 2, 2)
    data["attention_mask"][0] = torch.tensor([0, 0, 1, 1])
    _bad(data, r"prompt row 0: expected a non-empty prompt")


def test_response_mask_outside_attention_fails_when_asked():
    data = make_batch([1, 1], [1, 1], 2, 2)
    data["response_mask"][1] = torch.tensor([1, 1])
    _bad(data, r"response_mask row 1: expected ones only where attention_mask is 1", check_response_mask=True)
    # by default the mask is passed on unread, as verl does: the very tensor, ones on padding included
    assert nopad.left_right_2_no_padding(data)["loss_mask"] is data["response_mask"]


def test_response_mask_wider_than_sequence():
    data = make_batch([1], [1], 1, 1)
    data["response_mask"] = torch.ones(1, 3, dtype=torch.long)
    _bad(data, r"response_mask: expected shape \(1, R\) with R < seqlen 2, got \(1, 3\)")


def test_shape_and_dtype_mismatches():
    data = make_batch([1, 2], [1, 1], 2, 2)
    bad = data.clone()
    bad["position_ids"] = torch.zeros(2, 2, 4, dtype=torch.long)
    _bad(bad, r"position_ids: expected shape \(2, 4\) or \(2, 3\|4, 4\), got \(2, 2, 4\)")
    bad = data.clone()
    bad["attention_mask"] = bad["attention_mask"].float() * 0.5  # a float 0/1 mask is a mask; 0.5 is not
    _bad(bad, r"attention_mask row 0: expected a 0/1 mask \(bool, or numbers that are only 0 and 1: .*got 0.5")
    bad = data.clone()
    bad["routed_experts"] = torch.zeros(2, 3, 1, dtype=torch.uint8)
    _bad(bad, r"routed_experts: expected a per-token tensor of shape \(2, 4, \.\.\.\), got \(2, 3, 1\)")


def test_unknown_field_name_is_refused():
    data = make_batch([1, 2], [1, 1], 2, 2)
    data["extra"] = torch.zeros(2, dtype=torch.long)
    _bad(data, r"extra: expected a per-token tensor of shape \(2, 4, \.\.\.\), got \(2,\)", fields=["extra"])


def test_no_padding_2_padding_refuses_a_flat_tensor_of_the_wrong_length():
    data = make_batch([1, 2], [1, 1], 2, 2)
    out = nopad.left_right_2_no_padding(data)
    with pytest.raises(ValueError, match=r"tensor: expected 5 tokens \(the batch's total\), got shape \(4,\)"):
        nopad.no_padding_2_padding(torch.zeros(4), out)


def _naive_left_right_row_ok(row: list[int], prompt_width: int) -> bool:
    """One run of ones that ends at the prompt's last column or starts the response; empty rows pass."""
    ones = [j for j, m in enumerate(row) if m]
    if not ones:
        return True
    one_run = ones == list(range(ones[0], ones[-1] + 1))
    return one_run and ones[0] < prompt_width and ones[-1] >= prompt_width - 1


# a run of ones [a, b) in 6 columns, sometimes with one slot flipped: mostly near-valid rows
_run_rows = st.tuples(st.integers(0, 6), st.integers(0, 6), st.sampled_from([None, None, 0, 1, 2, 3, 4, 5]))


@given(rows=st.lists(_run_rows, min_size=1, max_size=5), response_width=st.integers(1, 5))
def test_plan_left_right_accepts_exactly_the_rows_a_naive_check_accepts(rows, response_width):
    prompt_width = 6 - response_width
    mask = [[int(min(a, b) <= j < max(a, b)) ^ (j == flip) for j in range(6)] for a, b, flip in rows]
    attention_mask = torch.tensor(mask)
    response_mask = attention_mask[:, prompt_width:]
    bad_rows = [b for b, row in enumerate(mask) if not _naive_left_right_row_ok(row, prompt_width)]
    if bad_rows:
        with pytest.raises(ValueError, match=r"row (\d+): expected") as failure:
            nopad.plan_left_right(attention_mask, response_mask)
        assert int(failure.value.args[0].split(" row ")[1].split(":")[0]) in bad_rows
    else:
        plan = nopad.plan_left_right(attention_mask, response_mask)
        assert torch.equal(plan.indices, attention_mask.flatten().nonzero().flatten())


@pytest.mark.parametrize("width", [2**15 - 1, 2**15 + 5, 70_000])  # the last: past one packed int64
def test_plan_left_right_counts_rows_longer_than_int16(width):
    mask = torch.zeros(2, width, dtype=torch.long)  # prompt width 8, the rest response
    mask[0, 3:] = 1  # a row of width - 3 ones: more than int16 holds on the wider batch
    mask[1, 7:108] = 1
    plan = nopad.plan_left_right(mask, mask[:, 8:])
    assert plan.lengths.tolist() == [width - 3, 101] and plan.max_seqlen == width - 3
    assert torch.equal(plan.indices, mask.flatten().nonzero().flatten())


# ---- a plan made on the host ---------------------------------------------------------------------


def test_a_host_plan_gives_the_same_batch_with_no_sync_and_a_fraction_of_the_ops():
    from nopad.synthetic import synthetic_batch

    td = synthetic_batch(8, 16, 32, vocab=1000, mrope=4)
    plan = plan_left_right(td["attention_mask"], td["response_mask"])
    with OpCounter() as without:
        reference = left_right_2_no_padding(td)
    with OpCounter() as with_plan:
        out = left_right_2_no_padding(td, plan=plan)
    assert with_plan.syncs == 0 and not with_plan.host_reads and without.syncs == 1
    assert with_plan.ops < without.ops
    for key in ("input_ids", "position_ids"):
        assert torch.equal(out[key].values(), reference[key].values())
        assert torch.equal(out[key].offsets(), reference[key].offsets())
    assert torch.equal(out.get_non_tensor("indices"), reference.get_non_tensor("indices"))


def test_a_host_plan_drives_a_batch_on_another_device_in_one_copy_without_reading_it_back():
    from nopad.synthetic import synthetic_batch

    td = synthetic_batch(8, 16, 32, vocab=1000)
    plan = plan_left_right(td["attention_mask"], td["response_mask"])  # on the host, validated there
    on_device = td.to("meta")  # a device whose values cannot even be read: any sync would fail
    with OpCounter() as counter:
        out = left_right_2_no_padding(on_device, plan=plan)
    assert counter.syncs == 0 and not counter.host_reads
    # lengths, offsets, starts and where the ranges of indices begin cross together: a copy into a
    # pinned host buffer, then the one copy to the device; the indices themselves are made there
    assert counter.by_op["aten.copy_.default"] == 2 and "aten._to_copy.default" not in counter.by_op
    assert out["input_ids"].device.type == "meta" and out["input_ids"].values().shape == (plan.total,)
    moved = plan.to("meta")
    assert moved.total == plan.total and moved.max_seqlen == plan.max_seqlen and moved.indices.device.type == "meta"
    assert plan.to("cpu") is plan


def test_a_plan_of_another_batch_is_refused():
    td = make_padded_batch(4, 6, 5, seed=1)
    other = make_padded_batch(3, 6, 5, seed=1)
    plan = plan_left_right(other["attention_mask"], other["response_mask"])
    with pytest.raises(ValueError, match=r"plan: expected plan_left_right of this batch: 4 rows of width 11"):
        left_right_2_no_padding(td, plan=plan)


def test_no_padding_2_padding_reads_a_dict_of_the_batch_fields_as_it_reads_the_tensordict():
    from nopad.batches import no_padding_2_padding
    from nopad.core import IndexPlan

    # a dict of the fields is a valid batch here (only read): refusing it was a valid input refused
    ids = IndexPlan.from_lengths(torch.tensor([4, 6])).to_nested(torch.arange(10))
    responses = IndexPlan.from_lengths(torch.tensor([2, 3])).to_nested(torch.zeros(5, dtype=torch.int64))
    out = IndexPlan.from_nested(ids).to_nested(torch.arange(10.0))
    fields = {"input_ids": ids, "responses": responses}
    want = no_padding_2_padding(out, TensorDict(fields, batch_size=[2]))
    assert torch.equal(no_padding_2_padding(out, fields), want)
