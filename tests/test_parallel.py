"""Context-parallel index math: alignment, zigzag/contiguous shards for all ranks, and their inverse."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nopad.core import prepare_offsets

# private: the CP shard math's pieces are tested on their own
from nopad.parallel._cp import (
    check_cp_args,
    contiguous_shard_index,
    cp_alignment,
    fp8_alignment,
    gather_cp_shards,
    padded_lengths_of,
    shard_index,
    unshard_index,
    zigzag_shard_index,
)


def test_transformer_engine_documented_zigzag_case():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert zigzag_shard_index(cu, 8, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert zigzag_shard_index(cu, 8, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert zigzag_shard_index(cu, 8, 2).tolist() == [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]


def test_alignment_rules():
    assert cp_alignment(1, 1, "zigzag") == 1
    assert cp_alignment(2, 1, "zigzag") == cp_alignment(2, 1, "contiguous") == 2
    assert cp_alignment(2, 4, "zigzag") == 16
    assert cp_alignment(2, 4, "contiguous") == 8
    assert fp8_alignment(4) == (16, 512)
    assert fp8_alignment(48) == (48, 6144)


def test_tail_padding_is_folded_into_the_last_segment():
    assert padded_lengths_of(np.array([3, 5, 1]), 4, total_multiple=32).tolist() == [4, 8, 20]


def _zigzag_oracle(padded_lengths, cp_size, rank):
    """Per-segment loop: split each segment into 2*cp chunks, keep chunks r and 2*cp-1-r."""
    out, start = [], 0
    for length in padded_lengths:
        chunks = torch.arange(start, start + length).chunk(2 * cp_size)
        out += [chunks[rank], chunks[2 * cp_size - 1 - rank]]
        start += length
    return torch.cat(out)


cp_cases = st.tuples(
    st.lists(st.integers(1, 40), min_size=1, max_size=8),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2]),
    st.sampled_from(["zigzag", "contiguous"]),
    st.sampled_from([1, 3, 64]),
)


@given(cp_cases)
def test_all_ranks_cover_every_padded_slot_exactly_once(case):
    lengths, cp_size, tp_size, layout, total_multiple_factor = case
    align = cp_alignment(tp_size, cp_size, layout)
    padded = torch.from_numpy(padded_lengths_of(np.array(lengths), align, align * total_multiple_factor))
    # every segment honours its alignment and holds its sequence; only the last absorbs the tail
    assert (padded % align == 0).all() and (padded >= torch.tensor(lengths)).all()
    assert (padded[:-1] - torch.tensor(lengths[:-1]) < align).all()
    assert int(padded.sum()) % (align * total_multiple_factor) == 0

    cu = prepare_offsets(padded).to(torch.int32)
    total_padded = int(cu[-1])
    local_len = total_padded // cp_size
    every_rank = shard_index(cu, local_len, cp_size, None, layout)
    assert every_rank.shape == (cp_size, local_len)
    assert torch.equal(every_rank.flatten().sort().values, torch.arange(total_padded))
    for rank in range(cp_size):
        one_rank = shard_index(cu, local_len, cp_size, rank, layout)
        assert torch.equal(one_rank, every_rank[rank])
        if layout == "contiguous" or cp_size == 1:
            assert torch.equal(one_rank, torch.arange(rank * local_len, (rank + 1) * local_len))
        else:
            assert torch.equal(one_rank, _zigzag_oracle(padded.tolist(), cp_size, rank))


@given(cp_cases)
def test_unshard_index_inverts_the_sharding_on_real_tokens(case):
    lengths, cp_size, tp_size, layout, total_multiple_factor = case
    lengths = torch.tensor(lengths)
    align = cp_alignment(tp_size, cp_size, layout)
    cu = prepare_offsets(torch.from_numpy(padded_lengths_of(lengths.numpy(), align, align * total_multiple_factor)))
    local_len = int(cu[-1]) // cp_size
    # what each rank holds, gathered rank-major: the global slot numbers themselves
    gathered = shard_index(cu, local_len, cp_size, None, layout).flatten()
    total = int(lengths.sum())
    recovered = gathered[unshard_index(cu, lengths, total, local_len, cp_size, layout)]
    real_slots = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(cu[:-1], lengths)])
    assert torch.equal(recovered, real_slots)


def test_contiguous_index_for_all_ranks_is_a_reshape():
    assert contiguous_shard_index(3, 2).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert contiguous_shard_index(3, 2, 1).tolist() == [3, 4, 5]


def test_gather_without_context_parallelism_keeps_the_tensor():
    x = torch.randn(5, 2, requires_grad=True)
    out = gather_cp_shards(x, 1, 0)
    assert out.shape == (1, 5, 2)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones(5, 2))


def test_gather_with_cp_needs_torch_distributed():
    with pytest.raises(ValueError, match="cp_size: expected torch.distributed to be initialised for cp_size=2"):
        gather_cp_shards(torch.zeros(3), 2, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1, 0, "zigzag"), "tp_size: expected an int >= 1, got 0"),
        ((1, 0, 0, "zigzag"), "cp_size: expected an int >= 1, got 0"),
        ((1, 2, 2, "zigzag"), r"cp_rank: expected an int in \[0, cp_size=2\), got 2"),
        ((1, 2, -1, "zigzag"), r"cp_rank: expected an int in \[0, cp_size=2\), got -1"),
        ((1, 2, 0, "ring"), "cp_layout: expected one of .*, got 'ring'"),
    ],
)
def test_bad_parallel_arguments_name_the_argument_and_the_value(args, message):
    with pytest.raises(ValueError, match=message):
        check_cp_args(*args)
