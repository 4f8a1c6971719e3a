"""Balanced partitions: Karmarkar-Karp equal to the plain algorithm item for item (ties included),
verl's micro-batch cut, the trainer's balance across ranks, workloads, and a DP group of 2 gloo ranks."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nopad.batches import Workload, balanced_partitions, karmarkar_karp, micro_batch_partitions, rank_order

# private: the Karmarkar-Karp arrays and the fit / split steps behind the partitions
from nopad.batches._partition import fits, split_until
from tests.dist_utils import run_distributed
from tests.rows_batches import NOT_MONOTONE, reference_micro_partitions, reference_partitions


@pytest.mark.parametrize("equal_size", [False, True])
@pytest.mark.parametrize("spread", [0, 1, 3, 1000])
def test_karmarkar_karp_equals_the_plain_algorithm_over_a_grid(equal_size, spread):
    rng = np.random.default_rng(spread)
    for n in range(1, 25):
        for k in range(1, n + 1):
            if equal_size and n % k:
                continue
            values = rng.integers(0, spread + 1, n).tolist()  # small spreads: many ties
            assert karmarkar_karp(values, k, equal_size) == reference_partitions(values, k, equal_size), (values, k)


@given(
    values=st.lists(st.integers(0, 50), min_size=1, max_size=40),
    k=st.integers(1, 40),
    equal_size=st.booleans(),
)
def test_balanced_partitions_are_the_plain_ones_sorted(values, k, equal_size):
    k = min(k, len(values))
    if equal_size:
        values = values[: len(values) // k * k]
    got = balanced_partitions(np.array(values), k, equal_size)
    assert got == [sorted(p) for p in reference_partitions(values, k, equal_size)]
    assert sorted(i for p in got for i in p) == list(range(len(values)))
    if equal_size:
        assert {len(p) for p in got} == {len(values) // k}


def test_inputs_of_every_host_form_give_the_same_partitions():
    values = [7, 3, 3, 9, 1, 0, 4, 4]
    want = balanced_partitions(values, 3, False)
    assert balanced_partitions(np.array(values, dtype=np.int32), 3, False) == want
    assert balanced_partitions(torch.tensor(values), 3, False) == want


def test_the_default_workload_is_verls_and_a_config_gives_the_flops_ratio():
    lengths = np.array([0, 1, 100, 4096])
    assert Workload()(lengths).tolist() == (24576 * lengths + lengths**2).tolist()
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008, "num_attention_heads": 32}
    w = Workload.from_config(config)
    per_layer = 2 * 4096 * (2 * 4096 + 2 * 4096) + 6 * 4096 * 11008  # projections + gated MLP, per token
    assert (w.linear, w.quadratic) == (round(per_layer / (2 * 4096)), 1)
    gqa = Workload.from_config({**config, "num_key_value_heads": 8, "vocab_size": 32000})
    flops = 32 * (2 * 4096 * (8192 + 2 * 1024) + 6 * 4096 * 11008) + 2 * 4096 * 32000
    assert gqa.linear == round(flops / (2 * 4096 * 32))


def test_a_transformers_config_gives_its_workload():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    w = Workload.from_config(config)
    assert w.linear == round((2 * (2 * 64 * (128 + 64) + 6 * 64 * 128) + 2 * 64 * 1000) / (2 * 64 * 2))


@given(lengths=st.lists(st.integers(1, 500), min_size=1, max_size=24), dp=st.sampled_from([1, 2, 3, 4]))
def test_rank_order_gives_equal_blocks_light_at_both_ends(lengths, dp):
    lengths = lengths[: len(lengths) // dp * dp]
    if not lengths:
        return
    order, partitions = rank_order(lengths, dp)
    work = 24576 * np.array(lengths) + np.array(lengths) ** 2
    assert sorted(order.tolist()) == list(range(len(lengths)))
    block = len(lengths) // dp
    expected_sets = [set(p) for p in balanced_partitions(work, dp, True)]
    for r in range(dp):
        rows = order[r * block : (r + 1) * block].tolist()
        assert set(rows) == expected_sets[r] and rows == partitions[r]
        by_work = sorted(rows, key=lambda i: (work[i], i))
        assert rows == by_work[::2] + by_work[1::2][::-1]


@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    slack=st.integers(0, 60),
    step=st.sampled_from([1, 2, 3]),
    least=st.sampled_from([1, 2, 5]),
    balance=st.booleans(),
)
def test_micro_batch_partitions_are_verls_cut(lengths, slack, step, least, balance):
    budget = max(max(lengths), 1) + slack
    groups = len(lengths)
    start = -(-max(min(groups, -(-sum(lengths) // budget)), least, 1) // step) * step
    if start > groups:  # more micro-batches asked than rows: refused (see the bad-input test)
        return
    try:
        want = reference_micro_partitions(lengths, budget, step=step, least=least, balance=balance)
    except IndexError:
        return
    if len(want) > groups:
        return
    got = micro_batch_partitions(
        lengths, budget, num_batches_divided_by=step, min_num_micro_batch=least, balance=balance
    )
    assert got == want
    assert all(sum(lengths[i] for i in p) <= budget for p in got)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: karmarkar_karp([3, -1], 1, False), "values row 1: expected a value >= 0, got -1"),
        # THE reading of an integer argument (core._layout.integer_values), as IndexPlan.from_lengths words it
        (
            lambda: karmarkar_karp([1.5, 2.0], 1, False),
            "values: expected a 1-D tensor or sequence of integers (nothing is rounded), got list of dtype float64",
        ),
        (
            lambda: karmarkar_karp(torch.tensor([1.0]), 1, False),
            "values: expected a 1-D tensor or sequence of integers, got dtype torch.float32",
        ),
        (lambda: karmarkar_karp([[1, 2]], 1, False), "values: expected a 1-D sequence, got shape (1, 2)"),
        (lambda: karmarkar_karp([1, 2], 3, False), "k_partitions: expected at most 2, the number of items"),
        (lambda: karmarkar_karp([1, 2, 3], 2, True), "a divisor of 3 items (equal_size=True)"),
        (lambda: karmarkar_karp([1, 2], 0, False), "k_partitions: expected an int >= 1, got 0"),
        (lambda: karmarkar_karp([2**62, 1], 1, False), "values whose sum fits in int64"),
        (lambda: micro_batch_partitions([5, 9], 8), "max_token_len: expected >= 9, the longest row (in tokens), got 8"),
        (lambda: micro_batch_partitions([5, 4], 8, force_group_size=2), "the longest group of 2 rows (in tokens)"),
        (lambda: micro_batch_partitions([5, 5], 10, min_num_micro_batch=3), "min_num_micro_batch: expected at most 2"),
        (
            lambda: micro_batch_partitions([9, 9], 10, num_batches_divided_by=3),
            "num_batches_divided_by: expected a count",
        ),
        (
            lambda: micro_batch_partitions([9, 9, 9], 10, num_batches_divided_by=2),
            "max_token_len: expected a budget met",
        ),
        (lambda: micro_batch_partitions([5, 5], 10, dp_group="dp"), "dp_group: expected a torch.distributed"),
        (lambda: karmarkar_karp([1, 2, 3, 4], 2, "false"), "equal_size: expected True or False"),
        (lambda: micro_batch_partitions([], 10), "a non-empty batch"),
        (lambda: micro_batch_partitions([1, 2], 10.0), "max_token_len: expected an int >= 1, got 10.0"),
        (lambda: Workload(linear=-1), "linear: expected an int >= 0, got -1"),
        (lambda: Workload.from_config({"hidden_size": 8}), "config.num_hidden_layers: expected an int >= 1"),
        (lambda: rank_order([1, 2, 3], 2), "a divisor of 3 items (equal_size=True)"),
    ],
)
def test_bad_partition_input_is_refused_naming_what_was_expected(call, words):
    with pytest.raises(ValueError) as info:
        call()
    assert words in str(info.value)


BY_TOKENS = Workload(linear=1, quadratic=0)


def test_a_fitting_cut_grows_to_more_parts_by_halving_and_still_fits():
    tokens = np.array(NOT_MONOTONE)
    from nopad.batches._partition import karmarkar_karp_arrays

    assert not fits(karmarkar_karp_arrays(tokens, 19, False), tokens, 92)
    grown = split_until(karmarkar_karp_arrays(tokens, 18, False), 19, tokens)
    assert len(grown) == 19 and fits(grown, tokens, 92)
    assert sorted(i for p in grown for i in p) == list(range(len(tokens)))


def _partitions_on_a_dp_group(rank, world_size, lengths_by_rank, budget):
    import torch.distributed as dist

    calls = []
    all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        parts = micro_batch_partitions(lengths_by_rank[rank], budget, dp_group=dist.group.WORLD, workload=BY_TOKENS)
    finally:
        dist.all_reduce = all_reduce
    return parts, len(calls)


@pytest.mark.slow
def test_a_dp_group_agrees_on_one_count_in_one_all_reduce_and_every_rank_fits():
    # rank 0 fits in 18 parts (not in 19), rank 1 needs 19: both cut 19, rank 0 by halving its 18-part cut
    lengths = [NOT_MONOTONE, [92] * 19]
    results = run_distributed(_partitions_on_a_dp_group, 2, lengths, 92)
    for (parts, calls), rank_lengths in zip(results, lengths):
        assert len(parts) == 19 and calls == 1
        assert all(sum(rank_lengths[i] for i in p) <= 92 for p in parts)
        assert sorted(i for p in parts for i in p) == list(range(len(rank_lengths)))
