"""Online packing, and the meeting point: online and offline rows give the same THD batch."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nopad.diagnostics import OpCounter
from nopad.engines import postprocess_thd, preprocess_thd
from nopad.packing import (
    ALGORITHMS,
    ByteTokenizer,
    collate_packed,
    cp_alignment,
    pack_conversations,
    pack_online,
    packed_to_thd,
    read_packed,
    write_packed,
)
from tests.dist_utils import run_distributed

BYTES = ByteTokenizer()


def _nested(seqs):
    values = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def _conversations(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, 250, (n,), generator=g).tolist() for n in lengths]
    masks = [torch.randint(0, 2, (n,), generator=g).tolist() for n in lengths]
    return ids, masks


def _both_paths(lengths, budget, *, tp=1, cp=1, algorithm="best_fit_decreasing", seed=0, path=None):
    """The same conversations packed online (nested batch) and offline (rows, optionally via a file)."""
    ids, masks = _conversations(lengths, seed)
    online, bins = pack_online(
        _nested(ids),
        budget,
        loss_mask=_nested(masks),
        tp_size=tp,
        cp_size=cp,
        algorithm=algorithm,
        pad_token_id=BYTES.pad_token_id,
    )
    align = cp_alignment(tp, cp)
    rows, report = pack_conversations(
        zip(ids, masks), budget, alignment=align, pad_token_id=BYTES.pad_token_id, algorithm=algorithm
    )
    if path is None:
        offline = collate_packed(rows, pad_token_id=BYTES.pad_token_id, alignment=align)
    else:
        write_packed(
            path,
            rows,
            pack_length=budget,
            tokenizer=BYTES.identity,
            pad_token_id=BYTES.pad_token_id,
            alignment=align,
            tp_size=tp,
            cp_size=cp,
        )
        offline = read_packed(path, tokenizer=BYTES.identity).batch(range(len(rows)))
    return online, offline, bins, ids, masks


def _assert_same_batch(a, b):
    assert set(a.keys()) == set(b.keys())
    for k in a.keys():
        assert torch.equal(a[k], b[k]), k


cases = st.tuples(
    st.sampled_from([(1, 1), (2, 1), (1, 2), (1, 4), (2, 2)]),  # (tp, cp)
    st.sampled_from(sorted(ALGORITHMS)),
    st.integers(1, 4),  # budget in units of the alignment
    st.lists(st.integers(1, 40), min_size=1, max_size=24),
    st.integers(0, 2**16),
)


@given(cases)
def test_online_rows_equal_offline_rows_for_the_same_conversations(case):
    (tp, cp), algorithm, units, raw_lengths, seed = case
    budget = cp_alignment(tp, cp) * 4 * units
    lengths = [min(n, budget) for n in raw_lengths]
    online, offline, bins, _, _ = _both_paths(lengths, budget, tp=tp, cp=cp, algorithm=algorithm, seed=seed)
    _assert_same_batch(online, offline)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_online_and_offline_file_meet_at_the_same_thd_batch(cp, tmp_path):
    lengths = [5, 17, 3, 9, 30, 1, 12, 8, 16, 2]
    online, offline, bins, ids, masks = _both_paths(lengths, 32, cp=cp, path=tmp_path / "p.parquet")
    ordered = [i for b in bins for i in sorted(b)]
    for rank in range(cp):
        a = packed_to_thd(online, cp_size=cp, cp_rank=rank)
        b = packed_to_thd(offline, cp_size=cp, cp_rank=rank)
        for field in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert torch.equal(a.packed_seq_params.cu_seqlens_q, b.packed_seq_params.cu_seqlens_q)
        assert a.packed_seq_params.max_seqlen_q == b.packed_seq_params.max_seqlen_q
        # and both equal the adapter run directly on the conversations in row order
        direct = _nested([ids[i] for i in ordered])
        tokens, params, positions = preprocess_thd(direct, cp_size=cp, cp_rank=rank)
        labels, _, _ = preprocess_thd(direct, cp_size=cp, cp_rank=rank, need_roll=True)
        real = tokens != 0  # ids are >= 1; the adapter pads with 0, the rows with the tokenizer's pad id
        assert torch.equal(a.tokens[real], tokens[real])
        assert (a.tokens[~real] == BYTES.pad_token_id).all()
        assert torch.equal(a.packed_seq_params.cu_seqlens_q, params.cu_seqlens_q)
        assert torch.equal(a.position_ids[real], positions[real])
        used = a.loss_mask.bool()
        assert torch.equal(a.labels[used], labels[used])  # every counted label is the true next token


def test_thd_refuses_rows_packed_for_another_cp_size():
    online, _, _, _, _ = _both_paths([5, 6, 7], 16, cp=1)
    expected = r"packed_cu_seqlens row 0: expected segment lengths that are multiples of 4 \(tp=1, cp=2, zigzag\)"
    with pytest.raises(ValueError, match=expected):
        packed_to_thd(online, cp_size=2, cp_rank=0)


def test_online_rows_for_data_parallel_and_min_rows():
    ids, _ = _conversations([3, 3, 3, 3, 3])
    rows, bins = pack_online(_nested(ids), 64, dp_size=4)
    assert rows.batch_size[0] == len(bins) == 4
    rows, bins = pack_online(_nested(ids), 64, min_bins=3)
    assert rows.batch_size[0] == 3


def test_online_refuses_a_sequence_longer_than_the_budget_and_dense_input():
    ids, _ = _conversations([3, 9])
    with pytest.raises(ValueError, match=r"input_ids row 1: expected 1 to 8 tokens after padding to a multiple of 4"):
        pack_online(_nested(ids), 8, cp_size=2)
    with pytest.raises(ValueError, match="jagged nested"):
        pack_online(torch.zeros(2, 3, dtype=torch.int64), 8)


def test_online_packing_op_count_is_independent_of_batch_size():
    counts = []
    for batch in (8, 256):
        g = torch.Generator().manual_seed(batch)
        ids, masks = _conversations(torch.randint(1, 60, (batch,), generator=g).tolist())
        nested, mask = _nested(ids), _nested(masks)
        pack_online(nested, 128, loss_mask=mask, cp_size=2)  # warm-up
        with OpCounter() as counter:
            pack_online(nested, 128, loss_mask=mask, cp_size=2)
        counts.append(counter)
    assert counts[0].by_op == counts[1].by_op
    assert counts[0].syncs == counts[1].syncs == 1  # the lengths, for the host-side bin packing


def _cp_round_trip(rank, world_size, path):
    packed = read_packed(path, tokenizer=ByteTokenizer().identity)
    batch = packed.batch(range(len(packed)))
    thd = packed_to_thd(batch, cp_size=world_size, cp_rank=rank)
    output = thd.tokens.to(torch.float32).unsqueeze(-1).requires_grad_()  # an identity "model"
    nested = postprocess_thd(output, thd.packed_seq_params, thd.input_ids, cp_size=world_size, cp_rank=rank)
    return nested.values().squeeze(-1).to(torch.int64), thd.input_ids.values()


@pytest.mark.slow
def test_offline_file_through_cp2_shards_and_back_recovers_every_row(tmp_path):
    ids, masks = _conversations([5, 17, 3, 9, 30, 1, 12], seed=3)
    rows, _ = pack_conversations(zip(ids, masks), 32, alignment=4, pad_token_id=BYTES.pad_token_id)
    path = tmp_path / "cp2.parquet"
    write_packed(
        path, rows, pack_length=32, tokenizer=BYTES.identity, pad_token_id=BYTES.pad_token_id, alignment=4, cp_size=2
    )
    results = run_distributed(_cp_round_trip, 2, str(path))
    flat_rows = torch.tensor([t for r in rows for t in r["input_ids"]])
    for recovered, segments in results:
        assert torch.equal(recovered, segments) and torch.equal(segments, flat_rows)


def test_packed_to_thd_op_count_is_independent_of_the_number_of_rows():
    counts = []
    for batch in (8, 256):
        g = torch.Generator().manual_seed(batch)
        ids, masks = _conversations(torch.randint(1, 60, (batch,), generator=g).tolist())
        rows, _ = pack_online(_nested(ids), 128, loss_mask=_nested(masks), cp_size=2)
        packed_to_thd(rows, cp_size=2, cp_rank=1)  # warm-up
        with OpCounter() as counter:
            packed_to_thd(rows, cp_size=2, cp_rank=1)
        counts.append(counter)
    assert counts[0].by_op == counts[1].by_op
    assert counts[0].syncs == counts[1].syncs == 2  # the rows' boundaries, the adapter's plan
