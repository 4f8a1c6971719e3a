"""THD plan speed and exactness: a fixed, small op count with one host read, and every index equal to
a per-sequence reference loop over lengths, tp, cp, layouts, fp8 padding, buckets and source starts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nopad.core import prepare_offsets
from nopad.diagnostics import OpCounter
from nopad.engines import ThdPlan, postprocess_thd, preprocess_thd

# private: the CP shard math's pieces and the THD plan's internals, op by op
from nopad.parallel import _thd as thd_module
from nopad.parallel._cp import rank_chunks, real_token_pieces, run_of_each, run_sizes, shard_index, unshard_index


def nested_ids(lengths, device="cpu"):
    """Nested (B, j) ids whose value says where the token is: seq * 1000 + pos + 1 (never 0)."""
    lengths = torch.as_tensor(lengths)
    offsets = prepare_offsets(lengths)
    row = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    values = row * 1000 + torch.arange(int(offsets[-1])) - offsets[row] + 1
    return torch.nested.nested_tensor_from_jagged(values.to(device), offsets.to(device))


# ---- the reference: one Python loop per sequence and per slot -------------------------------------
def reference_padding(lengths, *, tp, cp, layout, fp8=False, bucket=None):
    """Per-sequence padded lengths: each rounded up to its alignment, the tail folded into the last."""
    align = tp * cp * (2 if layout == "zigzag" else 1) if cp > 1 else tp
    total_multiple = align
    if fp8:
        align, total_multiple = math.lcm(16, align), align * 128
    if bucket:
        total_multiple = math.lcm(total_multiple, bucket)
    padded = [n + (-n) % align for n in lengths]
    padded[-1] += (-sum(padded)) % total_multiple
    return padded, align


def reference_slots(padded, cp, rank, layout):
    """The global padded slots ``rank`` holds, in its local order."""
    starts = [sum(padded[:i]) for i in range(len(padded) + 1)]
    if layout == "contiguous" or cp == 1:
        local = starts[-1] // cp
        return list(range(rank * local, (rank + 1) * local))
    slots = []
    for begin, length in zip(starts, padded):
        chunk = length // (2 * cp)
        for k in (rank, 2 * cp - 1 - rank):
            slots += range(begin + k * chunk, begin + (k + 1) * chunk)
    return slots


def reference_plan(lengths, source_starts, *, tp, cp, rank, layout, fp8=False, bucket=None):
    """Every per-slot index of one rank, slot by slot."""
    padded, _ = reference_padding(lengths, tp=tp, cp=cp, layout=layout, fp8=fp8, bucket=bucket)
    cu = [sum(padded[:i]) for i in range(len(padded) + 1)]
    out = {k: [] for k in ("global_index", "segment", "offset", "position", "padding", "source", "source_roll")}
    for slot in reference_slots(padded, cp, rank, layout):
        seq = next(s for s in range(len(padded)) if cu[s] <= slot < cu[s + 1])
        off, n = slot - cu[seq], lengths[seq]
        out["global_index"].append(slot)
        out["segment"].append(seq)
        out["offset"].append(off)
        out["position"].append(off if off < n else 0)
        out["padding"].append(off >= n)
        out["source"].append(source_starts[seq] + off if off < n else 0)
        out["source_roll"].append(source_starts[seq] + off + 1 if off + 1 < n else 0)
    return out, padded, cu


def reference_unshard(lengths, padded, cp, layout):
    """Where each real token (back to back) sits in the rank-major gathered buffer."""
    local_len = sum(padded) // cp
    where = {}
    for rank in range(cp):
        for local, slot in enumerate(reference_slots(padded, cp, rank, layout)):
            where[slot] = rank * local_len + local
    starts = [sum(padded[:i]) for i in range(len(padded))]
    return [where[start + p] for start, n in zip(starts, lengths) for p in range(n)]


# ---- exactness -----------------------------------------------------------------------------------
sharding = st.tuples(
    st.sampled_from([1, 2, 3, 4]),  # cp
    st.sampled_from([1, 2]),  # tp
    st.sampled_from(["zigzag", "contiguous"]),
    st.booleans(),  # fp8 padding
    st.sampled_from([None, 1, 48, 100]),  # length bucket
)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=7), sharding, st.data())
def test_every_index_of_the_plan_equals_the_per_sequence_loop(lengths, shard, data):
    cp, tp, layout, fp8, bucket = shard
    rank = data.draw(st.integers(0, cp - 1))
    gaps = data.draw(st.lists(st.integers(0, 3), min_size=len(lengths), max_size=len(lengths)))
    # offline rows: each sequence after a gap of row padding in the flat source
    starts = [sum(lengths[:i]) + sum(gaps[: i + 1]) for i in range(len(lengths))]
    source_len = starts[-1] + lengths[-1] + data.draw(st.integers(0, 3))
    kwargs = dict(tp_size=tp, cp_size=cp, cp_rank=rank, cp_layout=layout, use_fp8_padding=fp8)
    plan = ThdPlan.from_lengths(
        torch.tensor(lengths),
        source_starts=torch.tensor(starts),
        source_len=source_len,
        pad_to_length_bucket=bucket,
        **kwargs,
    )
    want, padded, cu = reference_plan(lengths, starts, tp=tp, cp=cp, rank=rank, layout=layout, fp8=fp8, bucket=bucket)
    assert plan.global_index.tolist() == want["global_index"]
    assert plan.segment.tolist() == want["segment"]
    assert plan.offset_in_segment.tolist() == want["offset"]
    assert plan.position_ids.tolist() == [want["position"]]
    assert plan.padding_mask.tolist() == [want["padding"]]
    plan.padding_mask.logical_not_()  # the caller's copy: the plan's positions and shards stay as they were
    assert plan.padding_mask.tolist() == [want["padding"]] and plan.position_ids.tolist() == [want["position"]]
    assert plan.source_index().tolist() == want["source"]
    assert plan.source_index(need_roll=True).tolist() == want["source_roll"]
    assert plan.cu_seqlens_padded.tolist() == cu and plan.cu_seqlens_padded.dtype == torch.int32
    assert plan.padded_lengths.tolist() == padded and plan.padded_max_seqlen == max(padded)
    assert plan.lengths.tolist() == lengths and plan.source_starts.tolist() == starts
    assert (plan.total, plan.padded_total, plan.local_len) == (sum(lengths), cu[-1], cu[-1] // cp)
    assert plan.unshard_index().tolist() == reference_unshard(lengths, padded, cp, layout)


@given(st.lists(st.integers(1, 30), min_size=1, max_size=6), sharding, st.data())
def test_the_device_branch_one_copy_and_a_binary_search_gives_the_same_plan(lengths, shard, data):
    """What a GPU runs (one buffer copy, searchsorted), taken on the CPU and compared with the CPU branch."""
    cp, tp, layout, fp8, bucket = shard
    rank = data.draw(st.integers(0, cp - 1))
    kwargs = dict(tp_size=tp, cp_size=cp, cp_rank=rank, cp_layout=layout, pad_to_length_bucket=bucket)
    plans = []
    for on_host in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(thd_module, "_is_host", lambda device, on_host=on_host: on_host)
            plan = ThdPlan.from_lengths(torch.tensor(lengths), use_fp8_padding=fp8, **kwargs)
            ids = nested_ids(lengths)
            plans.append(
                [plan.shard(ids, need_roll=True), plan.position_ids, plan.global_index, plan.segment]
                + [plan.unshard_index(), plan.cu_seqlens_padded, plan.lengths, plan.padded_lengths, plan.source_starts]
            )
    assert all(torch.equal(a, b) for a, b in zip(*plans))


@given(st.lists(st.integers(0, 30), min_size=1, max_size=7), sharding)
def test_cp_indices_equal_the_loop_with_empty_sequences_too(lengths, shard):
    """The CP helpers on the device and on the host, with 0-length rows (the plan refuses those)."""
    cp, tp, layout, fp8, bucket = shard
    padded, _ = reference_padding(lengths, tp=tp, cp=cp, layout=layout, fp8=fp8, bucket=bucket)
    cu = torch.tensor([0, *np.cumsum(padded)])
    local_len = int(cu[-1]) // cp
    for rank in range(cp):
        assert shard_index(cu, local_len, cp, rank, layout).tolist() == reference_slots(padded, cp, rank, layout)
    want = reference_unshard(lengths, padded, cp, layout)
    assert unshard_index(cu, torch.tensor(lengths), sum(lengths), local_len, cp, layout).tolist() == want
    # the host (numpy) path of the same derivation gives the same pieces and chunks
    host = real_token_pieces(cu.numpy(), np.array(lengths), local_len, cp, layout)
    device = real_token_pieces(cu, torch.tensor(lengths), local_len, cp, layout)
    assert all(np.array_equal(h, d.numpy()) for h, d in zip(host, device))
    for rank in range(cp):
        host = rank_chunks(cu.numpy(), local_len, cp, rank, layout)
        device = rank_chunks(cu, local_len, cp, rank, layout)
        assert all(np.array_equal(h, d.numpy()) for h, d in zip(host, device))
        # a slot's chunk: by repeating chunk ids (CPU) or by binary search (GPU), the same
        slots = torch.arange(local_len)
        by_search = run_of_each(slots, ends=torch.as_tensor(host[0]))
        by_repeat = run_of_each(slots, sizes=torch.as_tensor(run_sizes(host[0], local_len)))
        assert torch.equal(by_search, by_repeat)


@given(st.lists(st.integers(1, 30), min_size=1, max_size=6), sharding, st.booleans())
def test_preprocess_of_a_nested_batch_reads_the_token_the_loop_names(lengths, shard, need_roll):
    cp, tp, layout, fp8, bucket = shard
    ids = nested_ids(lengths)
    kwargs = dict(tp_size=tp, cp_size=cp, cp_layout=layout, use_fp8_padding=fp8, pad_to_length_bucket=bucket)
    for rank in range(cp):
        tokens, params, positions = preprocess_thd(ids, cp_rank=rank, need_roll=need_roll, **kwargs)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        want, _, cu = reference_plan(lengths, starts, tp=tp, cp=cp, rank=rank, layout=layout, fp8=fp8, bucket=bucket)
        step = int(need_roll)
        expected = [
            seq * 1000 + off + step + 1 if off + step < lengths[seq] else 0
            for seq, off in zip(want["segment"], want["offset"])
        ]
        assert tokens.tolist() == [expected]
        assert positions.tolist() == [want["position"]] and params.cu_seqlens_q.tolist() == cu
        plan = ThdPlan.from_lengths(torch.tensor(lengths), cp_rank=rank, **kwargs)
        assert torch.equal(plan.shard(ids, need_roll=need_roll), tokens)


def test_the_plan_copies_the_host_facts_it_reads_and_never_changes_its_input():
    lengths = torch.tensor([3, 5, 2])
    ids = nested_ids([3, 5, 2])
    before = (lengths.clone(), ids.offsets().clone(), ids.values().clone())
    plan = ThdPlan.from_lengths(lengths, cp_size=2)
    preprocess_thd(ids, cp_size=2, need_roll=True)
    lengths[0] = 7  # the plan made its own copy: a later change of the caller's tensor does not reach it
    assert plan.lengths.tolist() == [3, 5, 2]
    lengths[0] = 3
    assert all(torch.equal(a, b) for a, b in zip(before, (lengths, ids.offsets(), ids.values())))


# ---- near-valid inputs: one field off ------------------------------------------------------------
@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), st.data())
def test_one_short_sequence_is_refused_naming_its_row(lengths, data):
    row = data.draw(st.integers(0, len(lengths) - 1))
    bad = data.draw(st.integers(-3, 0))
    lengths[row] = bad
    with pytest.raises(ValueError, match=f"lengths row {row}: expected a sequence of >= 1 token, got length {bad}"):
        ThdPlan.from_lengths(torch.tensor(lengths), cp_size=2)


@given(st.lists(st.integers(1, 20), min_size=2, max_size=6), st.data())
def test_one_source_start_off_by_one_is_refused_naming_its_row(lengths, data):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    source_len = sum(lengths)
    row = data.draw(st.integers(0, len(lengths) - 1))
    starts[row] += data.draw(st.sampled_from([-(starts[row] + 1), source_len - starts[row] - lengths[row] + 1]))
    with pytest.raises(ValueError, match=f"source_starts row {row}: expected a sequence inside the {source_len}"):
        ThdPlan.from_lengths(torch.tensor(lengths), source_starts=torch.tensor(starts), source_len=source_len)


BAD_INPUT = [
    (
        lambda: ThdPlan.from_nested(torch.nested.nested_tensor_from_jagged(torch.zeros(0), torch.tensor([0]))),
        "non-empty",
    ),
    (lambda: ThdPlan.from_lengths(torch.tensor([2.0, 3.0])), "lengths: expected a 1-D tensor or sequence of integers"),
    (
        lambda: ThdPlan.from_lengths(torch.tensor([2, 3]), source_starts=torch.tensor([0])),
        r"source_starts: expected shape",
    ),
    (
        lambda: ThdPlan.from_lengths(torch.tensor([2, 3]), cp_size=2, cp_rank=2),
        r"cp_rank: expected an int in \[0, cp_size",
    ),
    (
        lambda: ThdPlan.from_lengths(torch.tensor([2, 3]), pad_to_length_bucket=-1),
        "pad_to_length_bucket: expected an int >= 1",
    ),
    (lambda: ThdPlan.from_lengths(torch.tensor([2, 0]), cp_size=2), "lengths row 1: expected a sequence of >= 1 token"),
]


@pytest.mark.parametrize(("call", "message"), BAD_INPUT)
def test_bad_plan_input_raises_value_error_naming_the_field(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- op counts -----------------------------------------------------------------------------------
def _counted(fn, batch, device="cpu"):
    lengths = torch.randint(1, 60, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    ids = nested_ids(lengths, device)
    fn(ids)  # warm up: lazy imports and nested-tensor metadata caches
    with OpCounter() as counter:
        fn(ids)
    return counter


STANDARD_CALLS = {
    "cp1": dict(cp_size=1),
    "cp2-zigzag": dict(cp_size=2, cp_rank=0),
    "cp2-zigzag-rank1-tp2": dict(cp_size=2, cp_rank=1, tp_size=2),
    "cp2-contiguous": dict(cp_size=2, cp_rank=1, cp_layout="contiguous"),
}


@pytest.mark.filterwarnings("ignore:cp_layout='contiguous'")
@pytest.mark.parametrize("kwargs", STANDARD_CALLS.values(), ids=STANDARD_CALLS.keys())
def test_preprocess_thd_is_at_most_40_ops_with_one_host_read_whatever_the_batch(kwargs):
    run = lambda ids: preprocess_thd(ids, need_roll=True, **kwargs)  # noqa: E731
    small, large = _counted(run, 8), _counted(run, 1024)
    assert small.by_op == large.by_op
    assert small.ops <= 40, small.by_op
    assert small.syncs == large.syncs == 1


@pytest.mark.filterwarnings("ignore:cp_layout='contiguous'")
@pytest.mark.parametrize("kwargs", STANDARD_CALLS.values(), ids=STANDARD_CALLS.keys())
def test_what_a_gpu_runs_counted_on_the_cpu_is_at_most_40_ops_whatever_the_batch(kwargs, monkeypatch):
    """The device branch (one staged copy of the host arrays, a binary search for the runs) taken on a
    CPU: its host<->device copies are ops on every device, so this is the count a GPU makes."""
    monkeypatch.setattr(thd_module, "_is_host", lambda device: False)
    run = lambda ids: preprocess_thd(ids, need_roll=True, **kwargs)  # noqa: E731
    small, large = _counted(run, 8), _counted(run, 1024)
    assert small.by_op == large.by_op
    assert small.ops <= 40 and small.syncs == large.syncs == 1, small.by_op


@pytest.mark.parametrize("kwargs", [dict(), dict(tp_size=2)], ids=["tp1", "tp2"])
def test_postprocess_thd_given_the_plan_is_two_ops_and_reads_nothing_on_the_host(kwargs):
    counts = []
    for batch in (8, 1024):
        ids = nested_ids(torch.randint(1, 60, (batch,), generator=torch.Generator().manual_seed(batch)).tolist())
        plan = ThdPlan.from_nested(ids, **kwargs)
        tokens, params = plan.shard(ids).float(), plan.packed_seq_params()
        postprocess_thd(tokens, params, ids, plan=plan)  # the plan's way back is computed once, here
        with OpCounter() as counter:
            back = postprocess_thd(tokens, params, ids, plan=plan)
        assert torch.equal(back.values(), ids.values().float()) and back.offsets() is ids.offsets()
        counts.append(counter)
    small, large = counts
    assert small.by_op == large.by_op and small.ops <= 2, small.by_op
    assert small.syncs == 0 and not small.host_reads


def test_a_plan_made_from_host_lengths_shards_with_no_host_read(device_path):
    lengths = torch.tensor([5, 3, 9])
    plan = ThdPlan.from_lengths(lengths, cp_size=2, cp_rank=1)  # the one read: of a CPU tensor, no device sync
    ids = nested_ids([5, 3, 9])
    with OpCounter() as counter:
        tokens = plan.shard(ids, need_roll=True)
        positions = plan.position_ids
        plan.packed_seq_params()
    assert counter.syncs == 0 and not counter.host_reads
    want_tokens, _, want_positions = preprocess_thd(ids, cp_size=2, cp_rank=1, need_roll=True)
    assert torch.equal(tokens, want_tokens) and torch.equal(positions, want_positions)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_host_plan_needs_no_sync_and_preprocess_reads_once():
    lengths = [5, 3, 9, 1, 12]
    ids = nested_ids(lengths, "cuda")
    plan = ThdPlan.from_lengths(torch.tensor(lengths), cp_size=2, device="cuda")
    assert plan.cu_seqlens_padded.device.type == "cuda"
    with OpCounter() as counter:
        tokens = plan.shard(ids, need_roll=True)
    assert counter.syncs == 0
    want, _, _ = preprocess_thd(ids, cp_size=2, need_roll=True)
    assert torch.equal(tokens, want)
    run = lambda ids: preprocess_thd(ids, cp_size=2, need_roll=True)  # noqa: E731
    small, large = _counted(run, 8, "cuda"), _counted(run, 1024, "cuda")
    assert small.by_op == large.by_op and small.ops <= 40 and small.syncs == 1


@pytest.mark.parametrize(
    ("dtype", "pad_value"),
    [
        (torch.int64, -100),
        (torch.int64, 7.0),
        (torch.float16, -1.5),
        (torch.bool, 0),
        (torch.int32, 5),
    ],
)
def test_shard_puts_the_pad_value_as_the_dtype_holds_it(dtype, pad_value):
    lengths = [4, 1, 6]
    plan = ThdPlan.from_lengths(torch.tensor(lengths), cp_size=2, cp_rank=1, tp_size=2)
    values = (torch.arange(11) % 3).to(dtype)
    for need_roll in (False, True):
        out = plan.shard(values, need_roll=need_roll, pad_value=pad_value)
        index = plan.source_index(need_roll)
        want, _, _ = reference_plan(lengths, [0, 4, 5], tp=2, cp=2, rank=1, layout="zigzag")
        step = int(need_roll)
        reads = torch.tensor([o + step < lengths[s] for s, o in zip(want["segment"], want["offset"])])
        expected = torch.where(reads, values[index], torch.as_tensor(pad_value, dtype=dtype))
        assert out.dtype == dtype and torch.equal(out, expected.unsqueeze(0))


@pytest.mark.parametrize(("dtype", "pad_value"), [(torch.int64, 0.7), (torch.int32, 2.5), (torch.bool, 3)])
def test_a_pad_value_the_dtype_cannot_hold_is_refused_not_cast(dtype, pad_value):
    plan = ThdPlan.from_lengths(torch.tensor([4, 1, 6]), cp_size=2, cp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match=rf"pad_value: expected .* for a {dtype} tensor, got {pad_value}"):
        plan.shard((torch.arange(11) % 3).to(dtype), pad_value=pad_value)
