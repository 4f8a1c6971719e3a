"""verl's row utilities under install(): the same TensorDicts, tensors and partitions as verl's own.

Run in CI's verl leg (verl 0.9.1, tensordict 0.10); skipped with the reason without verl.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, TensorDict

from tests.rows_batches import NOT_MONOTONE, nested_batch

try:
    import verl.utils.seqlen_balancing as sb
    import verl.utils.tensordict_utils as tu
    import verl.workers.engine.utils as engine_utils
except Exception as exc:  # noqa: BLE001 - any failure to import verl means this leg cannot run
    if os.environ.get("NOPAD_REQUIRE_VERL") == "1":
        raise
    pytest.skip(f"verl is not importable here ({exc!r}); these tests run in CI's verl leg", allow_module_level=True)

# private: the installer's row routes are compared with verl's own functions
from nopad.integrations.verl import _install as nv  # noqa: E402


@pytest.fixture
def installed():
    if nv.active() is not None:
        nv.active().uninstall()
    handle = nv.install()
    yield handle
    handle.uninstall()


def verls(module, name, *args, **kwargs):
    """verl's own function (uninstalled for the call), and nopad's through verl's name."""
    handle = nv.active()
    original = handle.originals[module.__name__, name]
    return original(*args, **kwargs), getattr(module, name)(*args, **kwargs)


def assert_same(a, b, where="result"):
    """Equal as a verl user sees them: kinds, dtypes, shapes, values, offsets, ragged dims, metadata."""
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, TensorDict):
        assert type(b) is TensorDict and a.batch_size == b.batch_size and a.device == b.device, where
        assert sorted(a.keys()) == sorted(b.keys()), where
        for key in a.keys():
            assert_same(a.get(key), b.get(key), f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.is_nested == b.is_nested and a.dtype == b.dtype, where
        if a.is_nested:
            assert a._ragged_idx == b._ragged_idx, where
            assert torch.equal(a.offsets(), b.offsets()) and torch.equal(a.values(), b.values()), where
            assert a.offsets().dtype == b.offsets().dtype and b.is_contiguous(), where
        else:
            assert a.shape == b.shape and torch.equal(a, b), where
    elif type(a).__name__ in ("NonTensorData", "NonTensorStack"):
        assert type(a).__name__ == type(b).__name__, where
        assert tu.get(TensorDict({"k": a}, batch_size=a.batch_size), "k") == tu.get(
            TensorDict({"k": b}, batch_size=b.batch_size), "k"
        ), where
    else:
        assert a == b, where


def verl_batch(lengths, seed=0, mrope=False):
    """A nested batch as verl's workers hold it (no sub-TensorDict: verl's utilities do not take one)."""
    td = nested_batch(lengths, seed=seed, register=False).exclude("extra")
    return td if mrope else td.exclude("position_ids")


LENGTHS = [[3, 2, 5, 1], [4] * 6, [1], [7, 0, 2, 9, 1, 1, 3, 8]]


@pytest.mark.parametrize("lengths", LENGTHS)
def test_index_select_and_make_iterator_equal_verls(installed, lengths):
    data = verl_batch(lengths, mrope=True)
    B = len(lengths)
    rng = random.Random(B)
    for index in ([B - 1], list(range(B))[::-1], [rng.randrange(B) for _ in range(2 * B)], torch.arange(B)):
        assert_same(*verls(tu, "index_select_tensor_dict", data, index))
    mini = max(1, B // 2) if B % 2 == 0 else 1
    with_install = list(tu.make_iterator(data, mini, epochs=2, seed=1, dataloader_kwargs={"shuffle": True}))
    installed.uninstall()
    without = list(tu.make_iterator(data, mini, epochs=2, seed=1, dataloader_kwargs={"shuffle": True}))
    nv.install()
    assert_same(without, with_install)


@pytest.mark.parametrize("lengths", LENGTHS)
def test_chunk_and_concat_equal_verls(installed, lengths):
    data = verl_batch(lengths, mrope=True)  # chunk_tensordict takes (B, 4, j) through its padded fallback
    for chunks in [c for c in (1, 2, 4) if len(lengths) % c == 0]:
        theirs, ours = verls(tu, "chunk_tensordict", data, chunks)
        assert_same(theirs, ours)
        assert_same(*verls(tu, "concat_tensordict", list(theirs)))
    flat = verl_batch(lengths)
    assert_same(*verls(tu, "concat_nested_tensors", [flat["input_ids"], flat["input_ids"]]))
    assert_same(*verls(tu, "concat_nested_tensors", [flat["routed_experts"], flat["routed_experts"]]))


def test_pad_and_unpad_equal_verls_where_verl_can_slice(installed):
    dense = TensorDict({"x": torch.arange(10).view(5, 2), "y": torch.randn(5)}, batch_size=[5])
    dense["meta"] = NonTensorData("m")
    for divisor in (1, 2, 3, 7, 12):
        theirs, ours = verls(tu, "pad_to_divisor", dense, divisor)
        assert_same(theirs, ours)
        assert_same(*verls(tu, "unpad", theirs[0], theirs[1]))
    # nested fields: tensordict 0.10 cannot slice them (verl's raises); nopad repeats and drops the rows
    data = verl_batch([3, 2, 5])
    padded, pad = tu.pad_to_divisor(data, 4)
    assert pad == 1 and padded["input_ids"].offsets().tolist() == [0, 3, 5, 10, 13]
    assert_same(tu.unpad(padded, pad), tu.index_select_tensor_dict(data, [0, 1, 2]))


@pytest.mark.parametrize("seed", range(6))
def test_rearrange_micro_batches_and_restore_equal_verls(installed, seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(4, 40))
    lengths = rng.integers(1, 300, B).tolist()
    data = verl_batch(lengths, seed=seed, mrope=seed % 2 == 1)
    options = [
        {},
        {"num_batches_divided_by": 2},
        {"min_num_micro_batch": 3, "use_dynamic_bsz_balance": False},
        {"force_group_size": 2} if B % 2 == 0 else {},
    ]
    for kwargs in options:
        budget = int(max(lengths) * 2 + rng.integers(0, 300))
        if kwargs.get("force_group_size"):
            budget += max(lengths)
        theirs, ours = verls(sb, "rearrange_micro_batches", data, budget, **kwargs)
        assert theirs[1] == ours[1]  # the partitions, identical
        assert_same(theirs[0], ours[0])
        joined = tu.concat_nested_tensors([m["log_probs"] for m in theirs[0]])
        assert_same(*verls(sb, "restore_dynamic_batch", joined, theirs[1]))
        assert_same(*verls(sb, "restore_dynamic_batch", data["advantages"][np.concatenate(theirs[1])], theirs[1]))


def test_partitions_equal_verls_ties_included(installed):
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 60)
        k = rng.randint(1, n)
        equal = rng.random() < 0.5
        if equal:
            n -= n % k
        values = [rng.randint(0, rng.choice([1, 3, 10**6])) for _ in range(n)]
        assert_same(*verls(sb, "karmarkar_karp", values, k, equal))
        assert_same(*verls(sb, "get_seqlen_balanced_partitions", values, k, equal))


def test_the_engines_micro_batch_path_equals_verls(installed):
    """prepare_micro_batches -> a model step per micro-batch -> postprocess_batch_func, as the engines run it."""
    data = verl_batch(np.random.default_rng(3).integers(1, 200, 24).tolist(), mrope=True)
    data["use_dynamic_bsz"] = NonTensorData(True)
    data["max_token_len_per_gpu"] = NonTensorData(700)

    def run():
        micro, indices = engine_utils.prepare_micro_batches(data, use_dynamic_bsz_balance=True)
        outputs = []
        for m in micro:
            log_probs = torch.nested.nested_tensor_from_jagged(m["log_probs"].values() * 2, m["input_ids"].offsets())
            outputs.append(
                {
                    "model_output": {"log_probs": log_probs, "entropy": log_probs + 1},
                    "loss": torch.tensor(1.0),
                    "metrics": {"n": len(m)},
                }
            )
        return micro, indices, engine_utils.postprocess_batch_func(outputs, indices, data)

    ours = run()
    installed.uninstall()
    theirs = run()
    nv.install()
    assert theirs[1] == ours[1]
    assert_same(theirs[0], ours[0])
    assert_same(theirs[2], ours[2])
    assert torch.equal(ours[2]["model_output"]["log_probs"].values(), data["log_probs"].values() * 2)


def test_restore_refuses_index_lists_that_are_not_a_permutation(installed):
    with pytest.raises(ValueError, match="a permutation of the 3 rows"):
        sb.restore_dynamic_batch(torch.arange(3), [[0, 0], [2]])


def _rearrange_on_two_ranks(rank, world_size, lengths_by_rank, budget):
    """On each rank: nopad's routed function, then verl's own, over the same group."""
    import torch.distributed as dist

    from nopad.integrations.verl import _install as nv_

    sb.get_device_name = lambda: "cpu"  # verl puts its counts on the accelerator; gloo takes them on the CPU
    data = verl_batch(lengths_by_rank[rank], seed=rank)
    with nv_.install():
        micro, ours = sb.rearrange_micro_batches(data, budget, dp_group=dist.group.WORLD)
    theirs_micro, theirs = sb.rearrange_micro_batches(data, budget, dp_group=dist.group.WORLD)
    assert_same(theirs_micro, micro)
    return ours, theirs


def test_over_a_dp_group_the_count_and_partitions_are_verls():
    from tests.dist_utils import run_distributed

    # rank 0 alone would cut 18 micro-batches, rank 1 needs 19: both cut 19, as verl does
    for ours, theirs in run_distributed(_rearrange_on_two_ranks, 2, [NOT_MONOTONE, [92] * 19], 92):
        assert ours == theirs and len(ours) == 19


def _infer_batch_output(rank: int, lengths) -> TensorDict:
    """What TrainingWorker.infer_batch returns on one DP rank: nested log-probs and entropy, and a
    metrics dict that differs between ranks (mfu, memory)."""
    offsets = torch.tensor([0, *np.cumsum(lengths)])
    out = TensorDict({}, batch_size=[len(lengths)])
    out["log_probs"] = torch.nested.nested_tensor_from_jagged(torch.randn(int(offsets[-1])), offsets)
    out["entropy"] = torch.nested.nested_tensor_from_jagged(torch.rand(int(offsets[-1])), offsets)
    out["metrics"] = NonTensorData({"mfu": 0.3 + rank / 10, "memory/allocated": [1.0 + rank]})
    out["temperature"] = NonTensorData(1.0)
    return out


def test_the_dp_collect_of_infer_batch_outputs_keeps_verls_metrics(installed):
    """Issue 27: verl's worker group joins its DP ranks' outputs with BatchData(output).concat();
    the trainer then reads tu.get(output, "metrics")["mfu"]. verl keeps the first rank's dict."""
    from verl.single_controller.base.decorator import _concat_data_proto_or_future

    outputs = [_infer_batch_output(rank, lengths) for rank, lengths in enumerate([[3, 1], [2, 5], [4, 4]])]
    joined = _concat_data_proto_or_future(outputs)
    assert tu.get(joined, "metrics")["mfu"] == 0.3  # rank 0's, as verl gives it
    assert tu.get(joined, "temperature") == 1.0
    assert joined["log_probs"].offsets().tolist() == [0, 3, 4, 6, 11, 15, 19]
    assert torch.equal(joined["entropy"].values(), torch.cat([o["entropy"].values() for o in outputs]))
    installed.uninstall()
    assert_same(_concat_data_proto_or_future(outputs), joined)
