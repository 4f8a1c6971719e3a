"""Bin packing: every item exactly once, no bin over capacity, FFD/BFD match their definitions."""

import math
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

# private: every algorithm is run on its own, beyond the public pack_lengths
from nopad._apps.bench import format_table
from nopad._apps.bench_packing import files_bench, packing_bench, rows_bench, synthetic_conversations
from nopad.packing import ALGORITHMS, pack_lengths, packing_metrics
from nopad.packing._algorithms import (
    best_fit_decreasing,
    bin_of_items,
    concatenative,
    first_fit_decreasing,
    first_fit_shuffle,
    modified_first_fit_decreasing,
)


def _check_valid(bins, lengths, capacity):
    items = sorted(i for b in bins for i in b)
    assert items == list(range(len(lengths))), "an item was lost or repeated"
    assert all(b for b in bins), "an empty bin"
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert len(bins) >= math.ceil(sum(lengths) / capacity)


def _naive_fit_decreasing(lengths, capacity, best):
    """Scan every open bin per item: the textbook definitions, for comparison."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins, room = [], []
    for i in order:
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if not fits:
            bins.append([]), room.append(capacity)
            fits = [len(bins) - 1]
        b = min(fits, key=lambda b: room[b]) if best else fits[0]
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


lengths_and_capacity = st.integers(1, 60).flatmap(
    lambda cap: st.tuples(st.lists(st.integers(1, cap), min_size=0, max_size=80), st.just(cap))
)


@given(lengths_and_capacity)
def test_every_algorithm_packs_every_item_once_within_capacity(case):
    lengths, capacity = case
    for name, algorithm in ALGORITHMS.items():
        bins = algorithm(lengths, capacity)
        _check_valid(bins, lengths, capacity)
        assert name and len(bins) <= max(len(lengths), 0)


@given(lengths_and_capacity)
def test_first_fit_decreasing_equals_the_scanning_definition(case):
    lengths, capacity = case
    assert first_fit_decreasing(lengths, capacity) == _naive_fit_decreasing(lengths, capacity, best=False)


@given(lengths_and_capacity)
def test_best_fit_decreasing_equals_the_scanning_definition_up_to_ties(case):
    lengths, capacity = case
    ours, ref = best_fit_decreasing(lengths, capacity), _naive_fit_decreasing(lengths, capacity, best=True)
    load = lambda bins: sorted(sum(lengths[i] for i in b) for b in bins)  # noqa: E731
    # bins with equal room are interchangeable, so the multiset of loads is the definition's
    assert len(ours) == len(ref) and load(ours) == load(ref)


@given(lengths_and_capacity)
def test_concatenative_keeps_order_and_closes_a_bin_only_when_the_next_item_does_not_fit(case):
    lengths, capacity = case
    bins = concatenative(lengths, capacity)
    assert [i for b in bins for i in b] == list(range(len(lengths)))
    for b, nxt in zip(bins, bins[1:]):
        assert sum(lengths[i] for i in b) + lengths[nxt[0]] > capacity


def _naive_first_fit(order, lengths, capacity):
    bins, room = [], []
    for i in order:
        b = next((b for b in range(len(bins)) if room[b] >= lengths[i]), None)
        if b is None:
            bins.append([]), room.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


@given(lengths_and_capacity, st.integers(0, 2**32))
def test_first_fit_shuffle_is_first_fit_over_a_seeded_shuffle(case, seed):
    lengths, capacity = case
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    bins = first_fit_shuffle(lengths, capacity, seed=seed)
    assert bins == _naive_first_fit(order, lengths, capacity)
    assert first_fit_shuffle(lengths, capacity, seed=seed) == bins  # same seed, same bins


def test_first_fit_shuffle_seed_changes_the_order_and_default_is_deterministic():
    lengths = list(range(1, 41))
    assert first_fit_shuffle(lengths, 64) == first_fit_shuffle(lengths, 64, seed=0)
    assert first_fit_shuffle(lengths, 64, seed=1) != first_fit_shuffle(lengths, 64, seed=2)
    assert pack_lengths(lengths, 64, algorithm="first_fit_shuffle") == first_fit_shuffle(lengths, 64)


def test_mffd_fills_large_bins_with_medium_then_small_items():
    # two large (60), two medium (35) -> each large bin takes one medium; the rest go to new FFD bins
    bins = modified_first_fit_decreasing([60, 60, 35, 35, 30, 30, 20, 20], 100)
    assert [sorted(b) for b in bins] == [[0, 2], [1, 3], [4, 5, 6, 7]]


def test_mffd_small_pair_phase_goes_backward_over_large_bins_without_a_medium():
    # large 70 and 64, no medium, smalls 19, 18, 17 (between C/6 and C/3)
    bins = modified_first_fit_decreasing([70, 64, 18, 17, 19], 100)
    # backward: bin 1 (room 36) takes the smallest small (17) then the largest that still fits (19);
    # first fit decreasing would instead put 19 with 70 and 18, 17 with 64
    assert sorted(bins[1]) == [1, 3, 4] and sorted(bins[0]) == [0, 2]
    assert sorted(map(sorted, first_fit_decreasing([70, 64, 18, 17, 19], 100))) == [[0, 4], [1, 2, 3]]


@given(lengths_and_capacity, st.integers(1, 5), st.integers(0, 12))
def test_bin_count_is_a_multiple_of_dp_and_at_least_min_bins(case, dp, min_bins):
    lengths, capacity = case
    if not lengths:
        assert pack_lengths(lengths, capacity, min_bins=min_bins, bins_multiple_of=dp) == []
        return
    needed = -(-max(len(best_fit_decreasing(lengths, capacity)), min_bins) // dp) * dp
    if len(lengths) < needed:  # bins are split, never left empty: too few items is an error
        with pytest.raises(ValueError, match="bins"):
            pack_lengths(lengths, capacity, min_bins=min_bins, bins_multiple_of=dp)
        return
    bins = pack_lengths(lengths, capacity, min_bins=min_bins, bins_multiple_of=dp)
    _check_valid(bins, lengths, capacity)
    assert len(bins) % dp == 0 and len(bins) >= min_bins


def test_splitting_for_dp_balances_the_split_bin():
    bins = pack_lengths([4, 4, 4, 4], 16, bins_multiple_of=2)
    assert sorted(sorted(b) for b in bins) == [[0, 1], [2, 3]] or all(len(b) == 2 for b in bins)


def test_metrics_of_a_hand_packing():
    m = packing_metrics([[0, 1], [2]], [6, 2, 4], 10)
    assert (m.bins, m.lower_bound, m.waste) == (2, 2, 8)
    assert m.utilisation == pytest.approx(12 / 20) and m.ratio_to_lower_bound == 1.0
    assert m.balance == pytest.approx(4 / 8)


@pytest.mark.parametrize(
    "lengths, capacity, match",
    [([3, 0], 8, "lengths item 1"), ([9], 8, "lengths item 0"), ([1], 0, "capacity"), ([1.5], 8, "integers")],
)
def test_bad_lengths_are_refused_naming_the_item(lengths, capacity, match):
    with pytest.raises(ValueError, match=match):
        best_fit_decreasing(lengths, capacity)


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="algorithm"):
        pack_lengths([1], 4, algorithm="worst_fit")


def test_bench_best_fit_decreasing_is_within_one_percent_of_the_lower_bound():
    rows = packing_bench(n=20_000, capacity=8192, seed=1)
    by_name = {r["algorithm"]: r for r in rows}
    assert set(by_name) == set(ALGORITHMS)
    assert by_name["best_fit_decreasing"]["ratio_to_lower_bound"] <= 1.01
    assert by_name["concatenative"]["bins"] >= by_name["best_fit_decreasing"]["bins"]
    assert "best_fit_decreasing" in format_table(rows)
    assert all(np.isfinite(r["seconds"]) for r in rows)


def test_rows_bench_reports_rows_built_and_tokens_per_second_for_every_algorithm():
    rows = rows_bench(n=400, pack_length=2048, repeats=1)
    by_name = {r["algorithm"]: r for r in rows}
    assert set(by_name) == set(ALGORITHMS)
    tokens = sum(len(ids) for ids, _ in synthetic_conversations(400, 2048))
    for r in rows:
        assert r["tokens"] == tokens and r["rows"] >= r["lower_bound"] == -(-tokens // 2048)
        assert np.isfinite(r["M_tokens_per_s"]) and r["M_tokens_per_s"] > 0
    assert by_name["best_fit_decreasing"]["rows"] <= by_name["concatenative"]["rows"]
    assert "M_tokens_per_s" in format_table(rows)


def test_files_bench_times_pack_write_and_read_of_the_same_rows():
    steps = files_bench(n=300, pack_length=1024)
    assert [r["step"] for r in steps] == ["pack", "write", "read and validate"]
    tokens = sum(len(ids) for ids, _ in synthetic_conversations(300, 1024))
    assert all(r["tokens"] == tokens and r["rows"] >= -(-tokens // 1024) and r["seconds"] > 0 for r in steps)
    assert len({r["rows"] for r in steps}) == 1


def test_synthetic_conversations_are_chat_sized_with_a_long_tail():
    convs = synthetic_conversations(20_000, 8192)
    lengths = np.array([len(ids) for ids, _ in convs])
    assert 380 <= np.median(lengths) <= 420 and lengths.max() <= 8192 and lengths.min() >= 1
    assert all(len(ids) == len(mask) for ids, mask in convs[:100])


@given(lengths_and_capacity, st.sampled_from(sorted(ALGORITHMS)))
def test_bin_of_items_is_the_bins_of_pack_lengths_as_one_array(case, algorithm):
    lengths, capacity = case
    bins = pack_lengths(lengths, capacity, algorithm=algorithm)
    bin_of = bin_of_items(np.asarray(lengths, dtype=np.int64), capacity, algorithm)
    assert bin_of.dtype == np.int64 and len(bin_of) == len(lengths)
    assert [sorted(b) for b in bins] == [np.flatnonzero(bin_of == k).tolist() for k in range(len(bins))]


@pytest.mark.parametrize(
    "lengths, capacity, algorithm, match",
    [
        ([3, 0], 8, "best_fit_decreasing", "lengths item 1"),
        ([9], 8, "concatenative", "lengths item 0"),
        ([1], 8, "worst_fit", "algorithm: expected one of"),
    ],
)
def test_bin_of_items_refuses_what_pack_lengths_refuses(lengths, capacity, algorithm, match):
    with pytest.raises(ValueError, match=match):
        bin_of_items(lengths, capacity, algorithm)
