import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import nopad
import nopad.batches
import nopad.core

# private: the plan's range and gather helpers are tested on their own
import nopad.core._layout
from nopad import IndexPlan

lengths_st = st.lists(st.integers(0, 9), min_size=1, max_size=12)


def _naive_right_padded_indices(lengths, width):
    return torch.tensor([b * width + k for b, n in enumerate(lengths) for k in range(n)], dtype=torch.long)


@given(lengths=lengths_st, extra=st.integers(0, 3))
def test_from_lengths_matches_a_naive_loop(lengths, extra):
    width = max(lengths) + extra
    plan = IndexPlan.from_lengths(torch.tensor(lengths), width=width)
    assert plan.total == sum(lengths) and plan.max_seqlen == max(lengths) and plan.min_seqlen == min(lengths)
    assert plan.offsets.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert plan.cu_seqlens.dtype == torch.int32 and plan.offsets.dtype == torch.int64
    assert torch.equal(plan.indices, _naive_right_padded_indices(lengths, width))
    assert plan.row_ids.tolist() == [b for b, n in enumerate(lengths) for _ in range(n)]
    assert plan.position_ids.tolist() == [k for n in lengths for k in range(n)]
    plan.validate()


@given(lengths=lengths_st)
def test_from_offsets_and_from_nested_agree_with_from_lengths(lengths):
    ref = IndexPlan.from_lengths(torch.tensor(lengths))
    by_offsets = IndexPlan.from_offsets(ref.offsets)
    nested = torch.nested.nested_tensor_from_jagged(torch.arange(ref.total), ref.offsets)
    by_nested = IndexPlan.from_nested(nested, width=ref.width)
    for plan in (by_offsets, by_nested):
        assert plan.total == ref.total and plan.max_seqlen == ref.max_seqlen
        assert torch.equal(plan.indices, ref.indices)


@given(mask=st.lists(st.lists(st.integers(0, 1), min_size=5, max_size=5), min_size=1, max_size=6))
def test_from_mask_accepts_any_mask_and_round_trips(mask):
    mask = torch.tensor(mask)
    x = torch.randn(*mask.shape, 3)
    plan = IndexPlan.from_mask(mask)
    packed = plan.pack(x)
    assert torch.equal(packed, x[mask.bool()])
    assert torch.equal(plan.unpack(packed), x * mask.unsqueeze(-1))
    nested = plan.nest(x)
    assert all(torch.equal(r, x[b][mask[b].bool()]) for b, r in enumerate(nested.unbind()))


@given(lengths=lengths_st, trailing=st.sampled_from([(), (2,), (2, 3)]))
def test_pack_unpack_are_exact_inverses_with_a_left_offset(lengths, trailing):
    width = max(lengths) + 2
    starts = torch.tensor([(b % 3) for b in range(len(lengths))]).clamp(max=width - torch.tensor(lengths))
    plan = IndexPlan.from_lengths(torch.tensor(lengths), width=width, starts=starts)
    col = torch.arange(width)
    mask = (col >= starts[:, None]) & (col < (starts + torch.tensor(lengths))[:, None])
    x = torch.randn(len(lengths), width, *trailing) * mask.view(*mask.shape, *[1] * len(trailing))
    assert torch.equal(plan.pack(x), x[mask])
    assert torch.equal(plan.unpack(plan.pack(x)), x)


def test_nest_mrope_sets_ragged_dim_last():
    plan = IndexPlan.from_lengths(torch.tensor([2, 2]), width=3)
    x = torch.arange(2 * 4 * 3).view(2, 4, 3)
    nested = plan.nest(x, seq_dim=2)
    assert nested._ragged_idx == 2 and nested.shape[:2] == (2, 4)
    assert torch.equal(nested.unbind()[1], x[1, :, :2])
    assert torch.equal(plan.unnest(nested), x * (torch.arange(3) < 2))


def test_gather_rows_gradient():
    values = torch.randn(6, dtype=torch.float64, requires_grad=True)
    starts, lo, hi = torch.tensor([0, 3]), torch.tensor([0, 1]), torch.tensor([2, 3])
    assert torch.autograd.gradcheck(lambda v: nopad.core._layout.gather_rows(v, starts, lo, hi, 4), (values,))


@pytest.mark.parametrize(
    "offsets, match",
    [
        (torch.tensor([1, 3]), r"offsets: expected boundaries starting at 0"),
        (torch.tensor([0, 4, 2]), r"offsets: expected boundaries starting at 0 that never go down"),
        (torch.tensor([0]), r"offsets: expected a 1-D tensor of batch\+1 >= 2 boundaries, got shape \(1,\)"),
    ],
)
def test_bad_offsets(offsets, match):
    with pytest.raises(ValueError, match=match):
        IndexPlan.from_offsets(offsets)


def test_validate_names_the_row():
    lengths = torch.tensor([2, 5, 1])
    plan = IndexPlan(
        lengths, nopad.core.prepare_offsets(lengths), total=8, width=4, starts=torch.zeros(3, dtype=torch.long)
    )
    with pytest.raises(ValueError, match=r"lengths row 1: expected the run of real tokens to end within width 4"):
        plan.validate()
    # the public constructors refuse the same at the edge
    with pytest.raises(ValueError, match=r"width: expected >= 5, where the longest run of real tokens ends, got 4"):
        IndexPlan.from_lengths(lengths, width=4, total=8, max_seqlen=5, min_seqlen=1)
    with pytest.raises(ValueError, match=r"lengths row 1: expected a value >= 0, got -1"):
        IndexPlan.from_lengths(torch.tensor([2, -1]))


def test_pack_refuses_wrong_shapes():
    plan = IndexPlan.from_lengths(torch.tensor([2, 1]), width=3)
    with pytest.raises(ValueError, match=r"expected batch 2 on dim 0 and width 3 on dim 1, got shape \(2, 4\)"):
        plan.pack(torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"values: expected 3 tokens on dim 0, got shape \(4,\)"):
        plan.unpack(torch.zeros(4))


@given(lengths=lengths_st)
def test_last_token_mask_matches_a_naive_loop(lengths):
    plan = IndexPlan.from_lengths(torch.tensor(lengths))
    assert plan.last_token_mask.tolist() == [k == n - 1 for n in lengths for k in range(n)]


@given(
    lengths=lengths_st,
    per_row=st.lists(st.integers(-50, 50), min_size=12, max_size=12),
    plus_position=st.booleans(),
)
def test_spread_over_tokens_matches_a_naive_loop(lengths, per_row, plus_position):
    expected, t = [], 0  # t counts tokens over the whole batch
    for b, n in enumerate(lengths):
        for _ in range(n):
            expected.append(per_row[b] + (t if plus_position else 0))
            t += 1
    offsets = nopad.core.prepare_offsets(torch.tensor(lengths))
    per_row_t = torch.tensor(per_row[: len(lengths)])
    assert (
        nopad.core._layout.spread_over_tokens(per_row_t, offsets, t, plus_position=plus_position).tolist() == expected
    )


@given(st.lists(st.tuples(st.integers(-5, 40), st.integers(0, 6)), max_size=12))
def test_concatenated_ranges_on_host_and_device_equal_the_loop(ranges):
    firsts = np.array([f for f, _ in ranges], dtype=np.int64)
    lengths = np.array([n for _, n in ranges], dtype=np.int64)
    expected = [f + k for f, n in ranges for k in range(n)]
    assert nopad.core._layout.host_ranges(firsts, lengths).tolist() == expected
    positions, steps = nopad.core._layout.range_steps(firsts, lengths)
    device = nopad.core._layout.expand_ranges(torch.from_numpy(positions), torch.from_numpy(steps), len(expected))
    assert device.tolist() == expected


def test_block_causal_mask_with_a_window_and_without_causality_matches_a_naive_loop():
    cu = torch.tensor([0, 4, 9])
    segment = [0] * 4 + [1] * 5
    for causal in (True, False):
        for window in (None, 1, 2, 3):
            mask = nopad.core._layout.block_causal_mask(cu, 9, causal=causal, window=window)[0, 0].tolist()
            expected = [
                [
                    segment[i] == segment[j] and (not causal or j <= i) and (window is None or abs(i - j) < window)
                    for j in range(9)
                ]
                for i in range(9)
            ]
            assert mask == expected, (causal, window)


@pytest.mark.parametrize("multiple", [1, 2, 3, 8, 16])
def test_round_up_matches_a_naive_loop_for_ints_arrays_and_tensors(multiple):
    from nopad.core._layout import round_up

    def naive(n):
        while n % multiple:
            n += 1
        return n

    ns = list(range(0, 50))
    want = [naive(n) for n in ns]
    assert [round_up(n, multiple) for n in ns] == want
    assert round_up(np.array(ns), multiple).tolist() == want
    assert round_up(torch.tensor(ns), multiple).tolist() == want
