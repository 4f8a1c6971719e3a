"""The speed contract: a fixed number of aten ops whatever B, and the documented host syncs."""

import pytest
import torch

import nopad
import nopad.batches
import nopad.core
from nopad.diagnostics import OpCounter
from tests.batches import make_batch


def _batch(B, mrope=0):
    g = torch.Generator().manual_seed(B)
    prompt = torch.randint(1, 9, (B,), generator=g).tolist()
    resp = torch.randint(0, 9, (B,), generator=g).tolist()
    return make_batch(prompt, resp, 8, 8, mrope=mrope)


def _count(fn, *args, **kw):
    fn(*args, **kw)  # warm-up: torch caches some nested-tensor metadata on first use
    with OpCounter() as counter:
        fn(*args, **kw)
    return counter


@pytest.mark.parametrize("mrope", [0, 4])
def test_left_right_2_no_padding_op_count_is_independent_of_batch_size(mrope):
    small, large = (_count(nopad.left_right_2_no_padding, _batch(B, mrope)) for B in (8, 1024))
    assert small.by_op == large.by_op
    assert small.syncs == large.syncs == 1


def _standard_batch(B):
    """input_ids, attention_mask, position_ids, response_mask: what every trainer hands over."""
    return _batch(B).select("input_ids", "attention_mask", "position_ids", "response_mask")


@pytest.mark.parametrize("B", [8, 1024])
def test_the_standard_batch_converts_within_the_op_budget(B):
    """Issue 15's budgets: 24 ops and one sync there, 8 ops and none back. Every op counts, views
    included; the two copies between host and device count on a CPU too, so these are the GPU's counts."""
    there = _count(nopad.left_right_2_no_padding, _standard_batch(B))
    # torch 2.9's nested tensors (the declared floor) take one op more: 25
    budget = 24 if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13) else 25
    assert there.ops <= budget and there.syncs == 1, there.by_op
    logp, out = _model_output(B)
    back = _count(nopad.no_padding_2_padding, logp, out)
    assert back.ops <= 8 and back.syncs == 0, back.by_op


def test_a_host_plan_leaves_only_the_gathers_and_one_copy():
    from nopad.batches import plan_left_right

    data = _standard_batch(64)
    masks = data["attention_mask"], data["response_mask"]
    plan = plan_left_right(*masks)
    same_device = _count(nopad.left_right_2_no_padding, data, plan=plan)
    assert same_device.syncs == 0 and same_device.ops <= 8, same_device.by_op
    with OpCounter() as made_on_host:  # the plan itself: the one host read is of a host tensor
        plan_left_right(*masks, device="meta")
    assert made_on_host.syncs == 1 and made_on_host.by_op["aten.copy_.default"] == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_counts_are_the_cpus_and_a_host_plan_never_waits_for_the_device():
    from nopad.batches import plan_left_right

    host = _standard_batch(64)
    data = host.to("cuda")
    on_cpu, on_cuda = _count(nopad.left_right_2_no_padding, host), _count(nopad.left_right_2_no_padding, data)
    assert on_cuda.by_op == on_cpu.by_op and on_cuda.syncs == 1, (on_cpu.by_op, on_cuda.by_op)
    expected = nopad.left_right_2_no_padding(host)
    logp = torch.randn(expected["input_ids"].values().shape[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any call that waits for the GPU raises
    try:
        plan = plan_left_right(host["attention_mask"], host["response_mask"], device="cuda")
        out = nopad.left_right_2_no_padding(data, plan=plan)
        nested_logp = torch.nested.nested_tensor_from_jagged(
            logp.to("cuda", non_blocking=True), out["input_ids"].offsets()
        )
        back = nopad.no_padding_2_padding(nested_logp, out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for key in ("input_ids", "position_ids"):
        assert torch.equal(out[key].values().cpu(), expected[key].values())
        assert torch.equal(out[key].offsets().cpu(), expected[key].offsets())
    want = nopad.no_padding_2_padding(
        torch.nested.nested_tensor_from_jagged(logp, expected["input_ids"].offsets()), expected
    )
    assert torch.equal(back.cpu(), want)


def _model_output(B):
    out = nopad.left_right_2_no_padding(_batch(B))
    ids = out["input_ids"]
    logp = torch.nested.nested_tensor_from_jagged(torch.randn(ids.values().shape[0]), ids.offsets())
    return logp, out


def test_no_padding_2_padding_op_count_is_independent_of_batch_size_and_sync_free():
    small, large = (_count(nopad.no_padding_2_padding, *_model_output(B)) for B in (8, 1024))
    assert small.by_op == large.by_op
    assert small.syncs == large.syncs == 0


def test_response_round_trip_is_sync_free(device_path):
    counts = []
    for B in (8, 1024):
        logp, out = _model_output(B)
        resp_mask = nopad.response_to_nested(
            out["response_mask"],
            torch.nested.nested_tensor_from_jagged(
                torch.ones(int(out["response_mask"].sum())), nopad.core.prepare_offsets(out["response_mask"].sum(-1))
            ),
        )
        with OpCounter() as c:
            nopad.response_from_nested(logp, resp_mask)
            nopad.response_to_nested(torch.zeros(B, 8), resp_mask)
        counts.append(c)
    assert counts[0].by_op == counts[1].by_op and counts[0].syncs == 0


def test_the_reference_loop_does_grow_with_batch_size():
    """The counter itself works: a per-row loop is caught."""

    def per_row(data):
        return [data["input_ids"][b][data["attention_mask"][b].bool()] for b in range(data.batch_size[0])]

    small, large = (_count(per_row, _batch(B)) for B in (8, 64))
    assert large.ops > 4 * small.ops and large.syncs == 64


@pytest.mark.parametrize(
    "read",
    [
        lambda x: x.tolist(),
        lambda x: x.sum().item(),
        lambda x: bool(x.any()),
        lambda x: int(x[0]),
        lambda x: float(x[0]),
        lambda x: x.cpu(),
        lambda x: x.numpy(),
        lambda x: x.to("cpu"),
        lambda x: [0, 1, 2][x[0]],
        lambda x: x.nonzero(),
    ],
    ids=["tolist", "item", "bool", "int", "float", "cpu", "numpy", "to_cpu", "index", "nonzero"],
)
def test_the_counter_sees_a_planted_host_read_on_a_cpu_tensor(read):
    x = torch.tensor([1, 0, 2])
    with OpCounter() as clean:
        x + 1
    with OpCounter() as planted:
        x + 1
        read(x)
    assert clean.syncs == 0 and planted.syncs == 1


def test_a_planted_tolist_breaks_the_sync_free_contract():
    logp, out = _model_output(8)
    with OpCounter() as c:
        nopad.no_padding_2_padding(logp, out)
    assert c.syncs == 0
    with OpCounter() as c:
        nopad.no_padding_2_padding(logp, out)
        out["input_ids"].offsets().tolist()
    assert c.syncs == 1


def test_the_counter_leaves_out_metadata_queries_which_some_releases_dispatch_and_others_do_not():
    # torch 2.9 dispatches a nested tensor's dim() to the mode and 2.13 does not: counted, the op counts
    # of the no-loops tests would differ by release rather than by work
    x = torch.ones(3, 4)
    with OpCounter() as counter:
        torch.ops.aten.dim.default(x)
        torch.ops.aten.sym_size.int(x, 0)
        x + 1
    assert counter.by_op == {"aten.add.Tensor": 1} and counter.syncs == 0
