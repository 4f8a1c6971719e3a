"""Row algebra on nested batches: every operation equals the per-row reference, the inverse pairs
round-trip, nested metadata survives, and the op count does not grow with the batch."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorData, TensorDict

import nopad
from nopad.batches import (
    RowRestore,
    cat_rows,
    chunk_rows,
    micro_batches,
    pad_rows,
    select_rows,
    split_rows,
    unpad_rows,
)
from nopad.diagnostics import OpCounter
from tests.batches import batch_shapes, make_batch
from tests.rows_batches import (
    assert_rows,
    check_nested_fields,
    nested_batch,
    reference_micro_partitions,
    row_lengths,
    rows_of,
)


@st.composite
def batch_and_index(draw):
    lengths = draw(row_lengths())
    B = len(lengths)
    kind = draw(st.sampled_from(["list", "mask", "slice", "tensor", "empty", "negative"]))
    if kind == "mask":
        index = torch.tensor(draw(st.lists(st.booleans(), min_size=B, max_size=B)))
        rows = index.nonzero().flatten().tolist()
    elif kind == "slice":
        start, stop, step = draw(st.integers(0, B)), draw(st.integers(0, B)), draw(st.integers(1, 3))
        index, rows = slice(start, stop, step), list(range(B))[start:stop:step]
    elif kind == "empty":
        index, rows = [], []
    else:
        rows = draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=2 * B))  # repeats allowed
        index = torch.tensor(rows) if kind == "tensor" else rows
        if kind == "negative":
            index = [r - B for r in rows]
    return lengths, index, rows, draw(st.booleans())


@given(case=batch_and_index())
def test_select_rows_equals_the_rows_picked_one_by_one(case):
    lengths, index, rows, register = case
    data = nested_batch(lengths, register=register)
    want = rows_of(data)
    got = select_rows(data, index)
    assert_rows(got, [want[r] for r in rows])
    assert got["position_ids"]._ragged_idx == 2 and got.get("uid").tolist() == [want[r]["uid"] for r in rows]


@given(lengths=row_lengths(), cuts=st.data(), register=st.booleans())
def test_split_then_cat_is_the_batch_again_and_parts_are_views(lengths, cuts, register):
    data = nested_batch(lengths, register=register)
    B = len(lengths)
    bounds = sorted(set(cuts.draw(st.lists(st.integers(1, B - 1), max_size=3)))) if B > 1 else []
    sizes = np.diff([0, *bounds, B]).tolist()
    parts = split_rows(data, sizes)
    want = rows_of(data)
    start = 0
    for part, size in zip(parts, sizes):
        assert_rows(part, want[start : start + size])
        values = part["input_ids"].values()
        assert values.untyped_storage().data_ptr() == data["input_ids"].values().untyped_storage().data_ptr()
        start += size
    assert_rows(cat_rows(parts), want)


@given(lengths=row_lengths(max_batch=8), chunks=st.sampled_from([1, 2, 4]))
def test_chunk_rows_cuts_equal_consecutive_parts(lengths, chunks):
    lengths = (lengths * 8)[: 8 // chunks * chunks] if len(lengths) % chunks else lengths
    if len(lengths) % chunks:
        return
    data = nested_batch(lengths)
    parts = chunk_rows(data, chunks)
    size = len(lengths) // chunks
    want = rows_of(data)
    for i, part in enumerate(parts):
        assert_rows(part, want[i * size : (i + 1) * size])


@given(lengths=row_lengths(), divisor=st.integers(1, 5))
def test_pad_rows_repeats_the_first_rows_and_unpad_takes_them_off(lengths, divisor):
    data = nested_batch(lengths)
    padded, pad = pad_rows(data, divisor)
    B = len(lengths)
    assert pad == -B % divisor and padded.batch_size[0] % divisor == 0
    want = rows_of(data)
    assert_rows(padded, want + [want[i % B] for i in range(pad)])
    assert_rows(unpad_rows(padded, pad), want)


@given(lengths=row_lengths(max_batch=10, max_len=30), slack=st.integers(0, 40), balance=st.booleans())
def test_micro_batches_fit_the_budget_and_restore_puts_outputs_back(lengths, slack, balance):
    data = nested_batch(lengths, register=False)
    budget = max(max(lengths), 1) + slack
    micro, restore = micro_batches(data, budget, balance=balance)
    assert restore.partitions == reference_micro_partitions(lengths, budget, balance=balance)
    want = rows_of(data)
    for part, rows in zip(micro, restore.partitions):
        assert part["input_ids"].values().shape[0] <= budget
        assert_rows(part, [want[r] for r in rows])
    # outputs of each micro-batch, of every kind, back in the batch's row order
    assert_rows(restore(micro), want)
    nested_out = restore([m["log_probs"] * 2 for m in micro])
    assert torch.equal(nested_out.values(), data["log_probs"].values() * 2)
    assert torch.equal(nested_out.offsets(), data["log_probs"].offsets())
    assert torch.equal(restore([m["advantages"] for m in micro]), data["advantages"])
    as_dict = restore([{"lp": m["log_probs"], "adv": m["advantages"]} for m in micro])
    assert torch.equal(as_dict["adv"], data["advantages"])
    assert torch.equal(as_dict["lp"].values(), data["log_probs"].values())
    assert restore([m.get("uid").tolist() for m in micro]) == data.get("uid").tolist()
    joined = cat_rows(micro)  # already joined in micro-batch order: restore takes that too
    assert_rows(restore(joined), want)


def test_micro_batches_keep_forced_groups_together_and_meet_the_step():
    lengths = [5, 9, 1, 7, 3, 3, 8, 2, 6, 6, 4, 1]
    data = nested_batch(lengths)
    micro, restore = micro_batches(data, 20, force_group_size=2, num_batches_divided_by=3, min_num_micro_batch=2)
    assert len(micro) % 3 == 0
    assert restore.partitions == reference_micro_partitions(lengths, 20, step=3, least=2, group=2)
    for rows in restore.partitions:
        assert all(r % 2 == 0 and r + 1 in rows for r in rows if r % 2 == 0)


def test_equal_lengths_stay_nested_with_their_ragged_dim_and_records():
    data = nested_batch([4, 4, 4, 4])
    for part in chunk_rows(data, 2) + [select_rows(data, [0])]:
        assert part["input_ids"].is_nested and part["position_ids"]._ragged_idx == 2
        assert part["input_ids"]._maybe_max_seqlen == 4 == part["input_ids"]._maybe_min_seqlen
        check_nested_fields(part)


def test_metadata_that_differs_between_joined_batches_becomes_per_row():
    a, b = nested_batch([2, 3], seed=1), nested_batch([1], seed=2)
    b["temperature"] = NonTensorData(1.0)
    joined = cat_rows([a, b])
    assert type(joined.get("temperature")).__name__ == "NonTensorStack"
    assert joined.get("temperature").tolist() == [0.7, 0.7, 1.0]
    assert cat_rows([a, nested_batch([1], seed=3)]).get("temperature").data == 0.7


CONVERTED = ("input_ids", "position_ids", "routed_experts", "teacher_logprobs", "teacher_ids")


def _assert_as_converted(got: TensorDict, padded_rows: TensorDict) -> None:
    """``got`` equals converting ``padded_rows``: every nested field, the padded ones and ``indices``."""
    want = nopad.left_right_2_no_padding(padded_rows)
    for key in CONVERTED:
        assert torch.equal(got[key].values(), want[key].values()), key
        assert torch.equal(got[key].offsets(), want[key].offsets()), key
    for key in ("attention_mask", "response_mask", "loss_mask"):
        assert torch.equal(got[key], want[key]), key
    assert torch.equal(got.get_non_tensor("indices"), want.get_non_tensor("indices"))
    assert got.get_non_tensor("max_seq_len") == want.get_non_tensor("max_seq_len")


@given(shape=batch_shapes(), mrope=st.sampled_from([0, 4]), picks=st.data())
def test_rows_of_a_converted_batch_are_the_conversion_of_those_padded_rows(shape, mrope, picks):
    prompt_lens, resp_lens, P, R = shape
    padded = make_batch(prompt_lens, resp_lens, P, R, mrope=mrope)
    B = len(prompt_lens)
    out = nopad.left_right_2_no_padding(padded)
    rows = picks.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=2 * B))
    _assert_as_converted(select_rows(out, rows), select_rows(padded, rows))
    micro, restore = micro_batches(out, max(max(p + r for p, r in zip(prompt_lens, resp_lens)), 1) + 3)
    for part, part_rows in zip(micro, restore.partitions):
        _assert_as_converted(part, select_rows(padded, part_rows))
    _assert_as_converted(restore(micro), padded)
    _assert_as_converted(cat_rows([out, select_rows(out, rows)]), cat_rows([padded, select_rows(padded, rows)]))
    padded_out, pad = pad_rows(out, 3)
    _assert_as_converted(padded_out, pad_rows(padded, 3)[0])
    _assert_as_converted(unpad_rows(padded_out, pad), padded)


def test_the_way_back_of_a_selected_converted_batch_is_the_conversion_of_its_rows():
    data = make_batch([3, 2, 1, 4], [2, 0, 3, 1], 4, 4, mrope=4)
    out = nopad.left_right_2_no_padding(data)
    picked, again = select_rows(out, [3, 0]), nopad.left_right_2_no_padding(select_rows(data, [3, 0]))
    logp = torch.nested.nested_tensor_from_jagged(picked["input_ids"].values().float(), picked["input_ids"].offsets())
    assert torch.equal(nopad.no_padding_2_padding(logp, picked), nopad.no_padding_2_padding(logp, again))
    flat = logp.values()  # a flat (total,) output: its total is checked against the rows' own
    assert torch.equal(nopad.no_padding_2_padding(flat, picked), nopad.no_padding_2_padding(logp, again))


# ---- the "no loops" contract ----------------------------------------------------------------------
def _count(fn, *args, **kw):
    fn(*args, **kw)  # warm-up: length records are made once per value
    with OpCounter() as counter:
        result = fn(*args, **kw)
    return counter, result


def _lengths(B, seed=0):
    return torch.randint(1, 64, (B,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("register", [True, False])
def test_select_split_cat_pad_op_counts_do_not_grow_with_the_batch(register):
    counts = {}
    for B in (8, 4096):
        data = nested_batch(_lengths(B), register=register)
        index = np.random.default_rng(1).permutation(B)[: B // 2]  # a host index (a device one is one read)
        parts = chunk_rows(data, 4)
        counts[B] = [
            _count(select_rows, data, index)[0],
            _count(chunk_rows, data, 4)[0],
            _count(cat_rows, parts)[0],
            _count(pad_rows, select_rows(data, slice(0, B - 3)), 4)[0],
        ]
    for small, large in zip(counts[8], counts[4096]):
        assert small.by_op == large.by_op
        assert small.syncs == large.syncs == (0 if register else small.syncs)
    # offsets torch built: their lengths come over once (the one sync), then nopad knows them
    assert all(c.syncs <= 1 for c in counts[8])


def test_micro_batches_and_restore_cost_the_same_ops_at_8_and_4096_rows_and_no_sync_on_nopad_offsets():
    by_size = {}
    for B in (8, 4096):
        lengths = _lengths(B)
        data = nested_batch(lengths)
        (cut, (micro, restore)) = _count(micro_batches, data, sum(lengths), min_num_micro_batch=4)
        outputs = [m["log_probs"] for m in micro]
        back, _ = _count(restore, outputs)
        assert len(micro) == 4 and cut.syncs == 0 and back.syncs == 0
        by_size[B] = (cut.by_op, back.by_op)
    assert by_size[8] == by_size[4096]


def test_a_converted_batch_is_cut_and_restored_without_a_host_sync():
    data = make_batch(
        *[[int(x) for x in torch.randint(1, 8, (64,), generator=torch.Generator().manual_seed(s))] for s in (0, 1)],
        8,
        8,
    )
    out = nopad.left_right_2_no_padding(data)
    with OpCounter() as counter:
        micro, restore = micro_batches(out, 40)
        restore([m["input_ids"] for m in micro])
        select_rows(out, list(range(10)))
    assert counter.syncs == 0


def test_outputs_out_of_order_are_refused_never_put_back_into_the_wrong_rows():
    data = nested_batch([4, 4, 4, 4], register=False)
    micro, restore = micro_batches(data, 8)
    assert [len(p) for p in restore.partitions] == [2, 2]  # as many rows and tokens: only the offsets tell
    outputs = [m["log_probs"] * 2 for m in micro]
    swapped = r"outputs\[0\]: expected the rows of micro-batch 0, got the rows of micro-batch 1"
    with pytest.raises(ValueError, match=swapped):
        restore(outputs[::-1])
    twice = r"outputs\[1\]: expected the rows of micro-batch 1, got the rows of micro-batch 0"
    with pytest.raises(ValueError, match=twice):
        restore([{"lp": outputs[0]}, {"lp": outputs[0]}])
    assert torch.equal(restore(outputs).values(), data["log_probs"].values() * 2)


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda d: select_rows(d, 1), "an int would drop the batch dim"),
        (lambda d: select_rows(d, [0, 4]), "index row 1: expected a row in [-4, 4), got 4"),
        (lambda d: select_rows(d, [0.5]), "integer row indices"),
        (lambda d: select_rows(d, torch.tensor([True, False])), "a bool mask of 4 rows"),
        (lambda d: select_rows(d, [[0, 1]]), "a 1-D index of rows"),
        (lambda d: select_rows(d, torch.tensor([1, 0, 1, 0], dtype=torch.uint8)), "a uint8 tensor (ambiguous"),
        (lambda d: select_rows({"x": 1}, [0]), "a TensorDict with a batch dim"),
        (lambda d: split_rows(d, [2, 0, 2]), "sizes[1]: expected an int >= 1, got 0"),
        (lambda d: split_rows(d, [1, 2]), "part sizes >= 1 that sum to the batch's 4 rows"),
        (lambda d: chunk_rows(d, 3), "a divisor of the batch's 4 rows"),
        (lambda d: chunk_rows(d, True), "chunks: expected an int >= 1, got True"),
        (lambda d: cat_rows([]), "a non-empty list of TensorDicts"),
        (lambda d: cat_rows(d), "a non-empty list of TensorDicts"),
        (lambda d: cat_rows([d, d.exclude("advantages")]), "the keys of batch 0"),
        (lambda d: cat_rows([d, _retyped(d, "input_ids", torch.int32)]), "int32"),
        (lambda d: pad_rows(d, 0), "divisor: expected an int >= 1, got 0"),
        (lambda d: unpad_rows(d, 5), "pad: expected an int in [0, 4], got 5"),
        (lambda d: micro_batches(d, 4), "max_token_len: expected >= 7, the longest row (in tokens), got 4"),
        (lambda d: micro_batches(d, 40, force_group_size=3), "a multiple of force_group_size=3 rows"),
        (lambda d: micro_batches(d, 40, lengths=[1, 2, 3]), "4 integers >= 0, one per row"),
        (lambda d: micro_batches(d, 40, lengths=[1, 2, 3, 4]), "lengths summing to input_ids' 16 tokens"),
        (lambda d: micro_batches(d, 40, lengths=[7, 1, 4, 4]), "lengths row 0: expected input_ids' length 3"),
        (lambda d: RowRestore([[0, 1], [2, 3]])([d]), "a list of 2 outputs (one per micro-batch) or one joined"),
        (
            lambda d: RowRestore([[0, 1], [2, 3]])([[1], [2, 3]]),
            "outputs[0]: expected 2 rows, as micro-batch 0 holds, got 1",
        ),
        (
            lambda d: RowRestore([[0], [1, 2, 3]])([select_rows(d, [0, 1, 2]), select_rows(d, [0])]),
            "outputs[0]: expected 1 rows, as micro-batch 0 holds, got 3",
        ),
        (lambda d: RowRestore([[0, 1], [2, 3]])(["ab", "cd"]), "tensors, TensorDicts, dicts or per-row lists"),
    ],
)
def test_bad_rows_input_is_refused_naming_what_was_expected(call, words):
    data = nested_batch([3, 2, 7, 4], register=False)
    with pytest.raises(ValueError) as info:
        call(data)
    assert words in str(info.value)


def _retyped(data: TensorDict, key: str, dtype: torch.dtype) -> TensorDict:
    out = data.clone()
    x = data[key]
    out[key] = torch.nested.nested_tensor_from_jagged(x.values().to(dtype), x.offsets())
    return out


def test_an_empty_selection_is_a_batch_of_zero_rows():
    data = nested_batch([3, 2])
    empty = select_rows(data, [])
    assert empty.batch_size == torch.Size([0]) and empty["input_ids"].values().shape == (0,)
    assert empty["position_ids"].values().shape == (4, 0)
    assert cat_rows([empty, data])["input_ids"].offsets().tolist() == [0, 3, 5]


def test_gradients_flow_back_through_restore_and_select():
    data = nested_batch([3, 5, 2, 4])
    micro, restore = micro_batches(data, 8)
    weights = torch.randn(data["log_probs"].values().shape[0], requires_grad=True)
    outputs = []
    for m, rows in zip(micro, restore.partitions):
        # each micro-batch's output uses the weights of its own rows' tokens
        picked = select_rows(
            TensorDict({"w": nopad.IndexPlan.from_nested(data["log_probs"]).to_nested(weights)}, batch_size=[4]), rows
        )["w"]
        outputs.append(torch.nested.nested_tensor_from_jagged(picked.values() * 2, m["log_probs"].offsets()))
    back = restore(outputs)
    back.values().sum().backward()
    assert torch.equal(weights.grad, torch.full_like(weights, 2.0))


def test_a_batch_with_a_second_batch_dim_keeps_it():
    data = TensorDict({"x": torch.arange(24).view(4, 3, 2)}, batch_size=[4, 3])
    picked = select_rows(data, [2, 0])
    assert picked.batch_size == torch.Size([2, 3]) and torch.equal(picked["x"], data["x"][[2, 0]])
    assert [p.batch_size for p in chunk_rows(data, 2)] == [torch.Size([2, 3])] * 2
