"""Megatron THD adapter: preprocess_thd / postprocess_thd / companions, single- and multi-process."""

import dataclasses
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

# private: the fallback PackedSeqParams where megatron-core is absent, and the bench's reference
from nopad._apps.bench import bench_thd, reference_preprocess_thd
from nopad.core import IndexPlan, prepare_offsets
from nopad.diagnostics import OpCounter
from nopad.engines import ParallelDims, ThdPlan, from_parallel_state, postprocess_thd, preprocess_thd
from nopad.parallel import _thd as thd_module
from nopad.parallel._thd import FallbackPackedSeqParams, packed_seq_params_class
from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parent.parent


def encoded_ids(lengths, trailing=()):
    """Nested (B, j, *trailing) ids whose value says where the token is: seq * 1000 + pos + 1 (never 0)."""
    lengths = torch.as_tensor(lengths)
    offsets = prepare_offsets(lengths)
    row = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    values = row * 1000 + torch.arange(int(offsets[-1])) - offsets[row] + 1
    values = values.view(-1, *[1] * len(trailing)).expand(-1, *trailing).contiguous()
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def oracle_shard(lengths, *, tp, cp, rank, layout, need_roll=False, fp8=False, bucket=None):
    """Per-sequence reference: pad each sequence, fold the tail into the last, then cut rank's slots."""
    align = tp * cp * (2 if layout == "zigzag" else 1) if cp > 1 else tp
    total_multiple = align
    if fp8:
        align, total_multiple = math.lcm(16, align), align * 128
    if bucket:
        total_multiple = math.lcm(total_multiple, bucket)
    padded = [n + (-n) % align for n in lengths]
    padded[-1] += (-sum(padded)) % total_multiple
    tokens, positions, starts = [], [], [0]
    for seq, (n, p) in enumerate(zip(lengths, padded)):
        ids = [seq * 1000 + pos + 1 for pos in range(n)]
        if need_roll:
            ids = ids[1:] + [0]  # the label slot of the last token holds the pad id, like padding
        tokens += ids + [0] * (p - n)
        positions += list(range(n)) + [0] * (p - n)
        starts.append(starts[-1] + p)
    tokens, positions = torch.tensor(tokens), torch.tensor(positions)
    if layout == "contiguous" or cp == 1:
        slots = torch.arange(len(tokens)).chunk(cp)[rank]
    else:
        slots = torch.cat(
            [torch.arange(s, e).chunk(2 * cp)[k] for s, e in zip(starts, starts[1:]) for k in (rank, 2 * cp - 1 - rank)]
        )
    return tokens[slots], positions[slots], starts


lengths_st = st.lists(st.integers(1, 30), min_size=1, max_size=6)
sharding_st = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from(["zigzag", "contiguous"]))


@given(lengths_st, sharding_st, st.booleans(), st.booleans(), st.sampled_from([None, 1, 48]))
def test_preprocess_matches_the_per_sequence_reference_on_every_rank(lengths, sharding, need_roll, fp8, bucket):
    cp, tp, layout = sharding
    ids = encoded_ids(lengths)
    for rank in range(cp):
        tokens, params, positions = preprocess_thd(
            ids,
            tp_size=tp,
            cp_size=cp,
            cp_rank=rank,
            cp_layout=layout,
            need_roll=need_roll,
            use_fp8_padding=fp8,
            pad_to_length_bucket=bucket,
        )
        want_tokens, want_positions, starts = oracle_shard(
            lengths, tp=tp, cp=cp, rank=rank, layout=layout, need_roll=need_roll, fp8=fp8, bucket=bucket
        )
        assert torch.equal(tokens, want_tokens.unsqueeze(0))
        assert torch.equal(positions, want_positions.unsqueeze(0))
        # cu_seqlens: 1-D int32, global (ends at T, not T/cp), padded, shared by q and kv
        for cu in (params.cu_seqlens_q, params.cu_seqlens_kv, params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded):
            assert cu.dtype == torch.int32 and cu.tolist() == starts
        assert params.qkv_format == "thd"
        assert type(params.max_seqlen_q) is int and params.max_seqlen_q == max(torch.tensor(starts).diff().tolist())
        assert tokens.shape == (1, starts[-1] // cp)


@given(lengths_st, sharding_st)
def test_need_roll_label_is_the_next_token_of_the_same_sequence_on_every_rank(lengths, sharding):
    cp, tp, layout = sharding
    ids = encoded_ids(lengths)
    for rank in range(cp):
        tokens, _, positions = preprocess_thd(ids, tp_size=tp, cp_size=cp, cp_rank=rank, cp_layout=layout)
        labels, _, label_positions = preprocess_thd(
            ids, tp_size=tp, cp_size=cp, cp_rank=rank, cp_layout=layout, need_roll=True
        )
        assert torch.equal(positions, label_positions)  # one set of position ids serves tokens and labels
        real = tokens != 0
        seq, pos = (tokens - 1) // 1000, (tokens - 1) % 1000
        last = real & (pos == torch.tensor(lengths)[seq.clamp(min=0)] - 1)
        inner = real & ~last
        assert torch.equal(labels[inner], tokens[inner] + 1)  # true next token, even across a shard edge
        assert (labels[last] == 0).all()  # documented: the pad id, nopad's one convention for that slot
        assert (labels[~real] == 0).all()


@given(lengths_st, st.sampled_from([(), (3,), (2, 2)]), st.sampled_from([1, 2]), st.booleans())
def test_single_rank_round_trip_is_exact_for_any_trailing_shape(lengths, trailing, tp, fp8):
    ids = encoded_ids(lengths, trailing)
    tokens, params, _ = preprocess_thd(ids, tp_size=tp, use_fp8_padding=fp8)
    assert tokens.shape[2:] == trailing
    out = postprocess_thd(tokens, params, ids)
    assert out.offsets() is ids.offsets()  # same ragged structure as the input: lines up with other fields
    assert torch.equal(out.values(), ids.values())


def test_companion_tensors_share_the_plan_and_spread_experts_on_alignment_slots():
    lengths = [5, 3, 9]
    ids = encoded_ids(lengths)
    offsets = ids.offsets()
    total = int(offsets[-1])
    loss_mask = torch.nested.nested_tensor_from_jagged(torch.arange(total) % 3 != 0, offsets)
    experts = torch.randint(0, 8, (total, 2, 4), generator=torch.Generator().manual_seed(0))
    experts_nested = torch.nested.nested_tensor_from_jagged(experts, offsets)
    pads = []
    for rank in range(2):
        plan = ThdPlan.from_nested(ids, cp_size=2, cp_rank=rank)
        tokens = plan.shard(ids)
        real = ~plan.padding_mask
        assert torch.equal(real, tokens != 0)
        index = tokens[real] - 1  # encoded ids -> flat packed index of each real slot
        flat_index = offsets[index // 1000] + index % 1000
        mask = plan.shard(loss_mask)
        assert mask.dtype == torch.bool and not mask[~real].any()
        assert torch.equal(mask[real], loss_mask.values()[flat_index])
        routed = plan.shard_routed_experts(experts_nested, num_experts=8)
        assert routed.shape == (1, plan.local_len, 2, 4) and routed.dtype == experts.dtype
        assert torch.equal(routed[real], experts[flat_index])
        pads.append(routed[~real])  # (padding slots, layers, topk)
    pad = torch.cat(pads)
    assert len(pad) == 7 and len(pad.unique()) == 8  # spread over every expert, not piled on expert 0
    assert all(len(set(slot.tolist())) == 4 for slot in pad.flatten(0, 1))  # distinct experts per slot
    with pytest.raises(ValueError, match="num_experts: expected >= topk 4"):
        plan.shard_routed_experts(experts_nested, num_experts=3)


def test_offline_rows_reach_the_same_batch_through_lengths_and_source_starts():
    """Packed rows with row padding after each row: shard straight from the flat (N * L) buffer."""
    ids = encoded_ids([4, 7, 2])
    rows = torch.zeros(2, 10, dtype=torch.int64)  # row 0: sequence 0; row 1: sequences 1 and 2; zeros pad
    rows[0, :4], rows[1, :7], rows[1, 7:9] = ids[0], ids[1], ids[2]
    for rank in range(2):
        plan = ThdPlan.from_lengths(
            torch.tensor([4, 7, 2]), cp_size=2, cp_rank=rank, source_starts=torch.tensor([0, 10, 17]), source_len=20
        )
        for need_roll in (False, True):
            want, params, positions = preprocess_thd(ids, cp_size=2, cp_rank=rank, need_roll=need_roll)
            assert torch.equal(plan.shard(rows.flatten(), need_roll=need_roll), want)
        assert torch.equal(plan.position_ids, positions)
        assert torch.equal(plan.packed_seq_params().cu_seqlens_q, params.cu_seqlens_q)
    with pytest.raises(ValueError, match="source_starts row 2: expected a sequence inside the 20 source tokens"):
        ThdPlan.from_lengths(torch.tensor([4, 7, 2]), source_starts=torch.tensor([0, 10, 19]), source_len=20)


def test_autograd_reaches_the_values_through_shard_and_postprocess():
    ids = encoded_ids([3, 6])
    hidden = torch.randn(9, 4, requires_grad=True)
    plan = ThdPlan.from_nested(ids, tp_size=2)
    out = postprocess_thd(plan.shard(hidden) * 2, plan.packed_seq_params(), ids)
    out.values().sum().backward()
    assert torch.equal(hidden.grad, torch.full((9, 4), 2.0))


def _counts(fn, batch):
    ids = encoded_ids(torch.randint(1, 40, (batch,), generator=torch.Generator().manual_seed(batch)).tolist())
    fn(ids)  # warm up: lazy imports and nested-tensor metadata caches
    with OpCounter() as counter:
        fn(ids)
    return counter


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_preprocess_op_count_is_independent_of_batch_size_with_one_sync(layout):
    run = lambda ids: preprocess_thd(ids, cp_size=2, cp_rank=1, cp_layout=layout, need_roll=True, tp_size=2)
    small, large = _counts(run, 4), _counts(run, 300)
    assert small.by_op == large.by_op
    assert small.syncs == large.syncs == 1


def test_postprocess_op_count_is_independent_of_batch_size_and_sync_free():
    def run(ids):
        tokens, params, _ = preprocess_thd(ids, tp_size=2)
        with OpCounter() as counter:
            postprocess_thd(tokens.float(), params, ids)
        return counter

    small, large = _counts(run, 4), _counts(run, 300)
    assert small.by_op == large.by_op and small.ops > 0


def test_postprocess_itself_is_sync_free(device_path):
    ids = encoded_ids([3, 5, 8])
    tokens, params, _ = preprocess_thd(ids)
    with OpCounter() as counter:
        postprocess_thd(tokens, params, ids)
    assert counter.syncs == 0


def test_the_reference_loop_grows_with_batch_size():
    run = lambda ids: reference_preprocess_thd(ids, cp_size=2, cp_rank=0, need_roll=True)
    assert _counts(run, 64).ops > 4 * _counts(run, 8).ops


def _bad(*shape):
    return torch.zeros(*shape, dtype=torch.int64)


def _ids(*lengths):
    return encoded_ids(list(lengths))


def _params(*lengths):
    return preprocess_thd(_ids(*lengths))[1]


BAD_INPUT = [
    (
        lambda: preprocess_thd(_bad(2, 5)),
        r"input_ids: expected a jagged nested tensor .*got a dense tensor of shape \(2, 5\)",
    ),
    (lambda: preprocess_thd(_ids(2, 3), cp_size=2, cp_rank=2), r"cp_rank: expected an int in \[0, cp_size=2\), got 2"),
    (lambda: preprocess_thd(_ids(2, 3), cp_layout="ring"), "cp_layout: expected one of .*got 'ring'"),
    (
        lambda: preprocess_thd(_ids(2, 3), pad_to_length_bucket=0),
        "pad_to_length_bucket: expected an int >= 1, got 0",
    ),
    (
        lambda: preprocess_thd(_ids(2, 3), pad_to_length_bucket=-8),
        "pad_to_length_bucket: expected an int >= 1, got -8",
    ),
    (
        lambda: preprocess_thd(torch.nested.nested_tensor_from_jagged(_bad(4), torch.tensor([0, 2, 2, 4]))),
        "input_ids row 1: expected a sequence of >= 1 token, got length 0",
    ),
    (
        lambda: ThdPlan.from_lengths(torch.tensor([[1, 2]])),
        r"lengths: expected a non-empty 1-D tensor, got shape \(1, 2\)",
    ),
    (
        lambda: ThdPlan.from_nested(_ids(2, 3)).shard(torch.zeros(4)),
        r"tensor: expected 5 tokens on dim 0, got shape \(4,\)",
    ),
    (
        lambda: postprocess_thd(torch.zeros(4), _params(2), _ids(2)),
        r"output: expected shape \(1, T/cp, ...\), got \(4,\)",
    ),
    (
        lambda: postprocess_thd(torch.zeros(1, 2), _params(2), _ids(1, 1)),
        r"packed_seq_params.cu_seqlens_q_padded: expected shape \(3,\), got \(2,\)",
    ),
    (
        lambda: postprocess_thd(torch.zeros(1, 2), preprocess_thd(_ids(2), cp_size=2)[1], _ids(2), cp_size=2),
        "cp_size: expected torch.distributed to be initialised for cp_size=2",
    ),
    (
        lambda: postprocess_thd(torch.zeros(1, 2), _params(2), _ids(2), cp_size=2, cp_rank=5),
        r"cp_rank: expected an int in \[0, cp_size=2\), got 5",
    ),
]


@pytest.mark.parametrize(("call", "message"), BAD_INPUT)
def test_bad_input_raises_value_error_with_the_value_and_what_was_expected(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_packed_seq_params_is_megatron_cores_class_with_a_same_named_fallback():
    megatron_params = pytest.importorskip("megatron.core.packed_seq_params").PackedSeqParams
    assert packed_seq_params_class() is megatron_params
    assert isinstance(preprocess_thd(encoded_ids([3]))[1], megatron_params)
    names = lambda cls: [f.name for f in dataclasses.fields(cls)]
    assert names(FallbackPackedSeqParams) == names(megatron_params)


def test_without_megatron_core_the_fallback_params_carry_the_same_batch(monkeypatch):
    monkeypatch.setattr(thd_module, "packed_seq_params_class", lambda: FallbackPackedSeqParams)
    ids = encoded_ids([3, 6, 1])
    tokens, params, _ = preprocess_thd(ids, tp_size=2)
    assert isinstance(params, FallbackPackedSeqParams) and params.cu_seqlens_q.tolist() == [0, 4, 10, 12]
    assert torch.equal(postprocess_thd(tokens, params, ids).values(), ids.values())


def test_from_parallel_state_refuses_uninitialised_megatron():
    pytest.importorskip("megatron.core.parallel_state")
    with pytest.raises(ValueError, match="parallel_state: expected megatron-core model parallel groups"):
        from_parallel_state()


@given(lengths_st, st.sampled_from([1, 2, 4]), st.booleans(), st.data())
def test_benchmark_reference_agrees_with_preprocess(lengths, cp, need_roll, data):
    rank = data.draw(st.integers(0, cp - 1))
    ids = encoded_ids(lengths)
    ref_tokens, ref_positions = reference_preprocess_thd(ids, cp_size=cp, cp_rank=rank, need_roll=need_roll)
    tokens, _, positions = preprocess_thd(ids, cp_size=cp, cp_rank=rank, need_roll=need_roll)
    if need_roll:  # verl's roll puts a sequence's first token in its last label slot; nopad puts the pad id
        last = ThdPlan.from_nested(ids, cp_size=cp, cp_rank=rank).shard(IndexPlan.from_nested(ids).last_token_mask)
        ref_tokens = torch.where(last, 0, ref_tokens)
    assert torch.equal(tokens, ref_tokens) and torch.equal(positions, ref_positions)


def test_bench_thd_returns_rows_of_batch_and_times():
    rows = bench_thd((2, 16), max_len=32, repeats=1)
    assert [row[0] for row in rows] == [2, 16]
    assert all(ref > 0 and ours > 0 and ratio == pytest.approx(ref / ours) for _, ref, ours, ratio in rows)


# ---- multi-process -------------------------------------------------------------------------------
def _check_cp_round_trips(dims, seed):
    """ids round trip exactly, labels roll within sequences, a float output sends each rank its own gradient."""
    gen = torch.Generator().manual_seed(seed)  # same batches on every rank
    shards = {}
    for trial in range(3):
        batch = int(torch.randint(1, 6, (1,), generator=gen))
        lengths = torch.randint(1, 3 * dims.cp_size + 2, (batch,), generator=gen)
        ids = encoded_ids(lengths.tolist())
        total = int(lengths.sum())
        for layout in ("zigzag", "contiguous"):
            kwargs = dict(cp_layout=layout, pad_to_length_bucket=[None, 8, 5][trial])
            tokens, params, _ = preprocess_thd(ids, **dims.preprocess_kwargs(), **kwargs)
            back = postprocess_thd(tokens, params, ids, **dims.postprocess_kwargs(), cp_layout=layout)
            assert torch.equal(back.values(), ids.values()) and back.offsets() is ids.offsets()

            labels, _, _ = preprocess_thd(ids, **dims.preprocess_kwargs(), **kwargs, need_roll=True)
            rolled = postprocess_thd(labels, params, ids, **dims.postprocess_kwargs(), cp_layout=layout)
            next_index = torch.arange(total) + 1
            last = torch.isin(next_index, ids.offsets()[1:])
            next_index[last] = 0  # stays in range; the last token's label slot holds the pad id
            assert torch.equal(rolled.values(), torch.where(last, 0, ids.values()[next_index]))

            plan = ThdPlan.from_nested(ids, **dims.preprocess_kwargs(), **kwargs)
            hidden = torch.randn(total, 2, generator=gen)
            local = plan.shard(hidden).detach().requires_grad_()
            out = postprocess_thd(
                local * 3, plan.packed_seq_params(), ids, **dims.postprocess_kwargs(), cp_layout=layout
            )
            assert torch.equal(out.values(), hidden * 3)
            weight = torch.arange(total * 2, dtype=torch.float32).view(total, 2)
            (out.values() * weight).sum().backward()
            assert torch.equal(local.grad, plan.shard(weight) * 3)  # this rank's slice, zero on padding
            if trial == 0:
                shards[layout] = (tokens[0].tolist(), lengths.tolist())
    te_tokens, _, _ = preprocess_thd(encoded_ids([8, 8]), **dims.preprocess_kwargs())
    shards["te"] = te_tokens[0].tolist()
    return shards


def _cp_worker(rank, world):
    """Phase 1: megatron-core parallel_state with tp=2, cp=2. Phase 2: a plain gloo group, cp=4."""
    results = {}
    if importlib.util.find_spec("megatron") is not None:
        from megatron.core import parallel_state as mpu

        mpu.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
        try:
            dims = from_parallel_state()
            assert (dims.tp_size, dims.cp_size, dims.cp_rank) == (2, 2, rank // 2)  # order tp-cp: rank = tp + 2*cp
            results["megatron"] = (dims.cp_rank, _check_cp_round_trips(dims, seed=7))
            tokens, params, _ = preprocess_thd(encoded_ids([3]), **dims.preprocess_kwargs())
            with pytest.raises(ValueError, match="cp_group: expected a group of cp_size=2 ranks, got 4"):
                postprocess_thd(tokens, params, encoded_ids([3]), cp_size=2, cp_rank=dims.cp_rank)  # world group
        finally:
            mpu.destroy_model_parallel()
    group = dist.new_group(list(range(world)))
    dims = ParallelDims(cp_size=world, cp_rank=dist.get_rank(group), cp_group=group)
    results["plain"] = (dims.cp_rank, _check_cp_round_trips(dims, seed=8))
    return results


def _check_shards_partition_the_batch(shards_by_cp_rank):
    for layout in ("zigzag", "contiguous"):
        lengths = shards_by_cp_rank[0][layout][1]
        held = sorted(t for shards in shards_by_cp_rank for t in shards[layout][0] if t != 0)
        assert held == sorted(encoded_ids(lengths).values().tolist())  # every real token on exactly one rank


@pytest.mark.slow
def test_cp2_via_megatron_parallel_state_and_cp4_via_plain_groups_round_trip_ids_and_gradients():
    results = run_distributed(_cp_worker, 4)
    plain = [results[r]["plain"] for r in range(4)]
    assert [cp_rank for cp_rank, _ in plain] == [0, 1, 2, 3]
    _check_shards_partition_the_batch([shards for _, shards in plain])
    # TE's documented case cu=[0, 8, 16] at cp=4: each rank holds chunks r and 7-r of both sequences
    assert plain[0][1]["te"] == [1, 8, 1001, 1008] and plain[3][1]["te"] == [4, 5, 1004, 1005]

    if "megatron" not in results[0]:  # megatron-core is an optional extra; plain groups are checked above
        return
    megatron = [results[r]["megatron"] for r in range(4)]
    assert [cp_rank for cp_rank, _ in megatron] == [0, 0, 1, 1]
    assert megatron[0][1] == megatron[1][1] and megatron[2][1] == megatron[3][1]  # tp ranks agree
    _check_shards_partition_the_batch([megatron[0][1], megatron[2][1]])
    # TE's documented case cu=[0, 8, 16], cp=2: rank 0 slots [0,1,6,7,8,9,14,15], rank 1 [2,3,4,5,10,11,12,13]
    assert megatron[0][1]["te"] == [1, 2, 7, 8, 1001, 1002, 1007, 1008]
    assert megatron[2][1]["te"] == [3, 4, 5, 6, 1003, 1004, 1005, 1006]


@pytest.mark.slow
def test_example_runs_under_torchrun_on_two_cpu_processes():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / "megatron_thd.py"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[rank 0] tokens" in done.stdout and "[rank 1] tokens" in done.stdout
    assert "recovered batch equals the input: True" in done.stdout


def test_contiguous_layout_warns_when_megatron_core_cannot_honour_it():
    import warnings

    pytest.importorskip("megatron.core")
    ids = torch.nested.nested_tensor_from_jagged(torch.arange(12), torch.tensor([0, 5, 12]))
    with pytest.warns(UserWarning, match="assumes the zigzag layout"):
        preprocess_thd(ids, cp_size=2, cp_rank=0, cp_layout="contiguous")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preprocess_thd(ids, cp_size=2, cp_rank=0, cp_layout="zigzag")


def test_postprocess_takes_the_layout_from_the_plan_or_the_params():
    ids = encoded_ids([3, 5, 2])
    for layout in ("zigzag", "contiguous"):
        plan = ThdPlan.from_nested(ids, cp_layout=layout)
        tokens, params = plan.shard(ids), plan.packed_seq_params()
        for kwargs in ({"plan": plan}, {}):
            back = postprocess_thd(tokens, params, ids, **kwargs)
            assert torch.equal(back.values(), ids.values())
