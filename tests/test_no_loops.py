"""The speed contract: a fixed number of aten ops whatever B, and the documented host syncs."""

import pytest
import torch

import nopad
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
    assert small.ops < 150
    assert small.syncs == large.syncs == 1


def _model_output(B):
    out = nopad.left_right_2_no_padding(_batch(B))
    ids = out["input_ids"]
    logp = torch.nested.nested_tensor_from_jagged(torch.randn(ids.values().shape[0]), ids.offsets())
    return logp, out


def test_no_padding_2_padding_op_count_is_independent_of_batch_size_and_sync_free():
    small, large = (_count(nopad.no_padding_2_padding, *_model_output(B)) for B in (8, 1024))
    assert small.by_op == large.by_op
    assert small.syncs == large.syncs == 0


def test_response_round_trip_is_sync_free():
    counts = []
    for B in (8, 1024):
        logp, out = _model_output(B)
        resp_mask = nopad.response_to_nested(
            out["response_mask"],
            torch.nested.nested_tensor_from_jagged(
                torch.ones(int(out["response_mask"].sum())), nopad.prepare_offsets(out["response_mask"].sum(-1))
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
