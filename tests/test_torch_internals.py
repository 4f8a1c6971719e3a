"""nopad's fast paths through private torch and tensordict APIs equal the public ones: every helper
of nopad.core._torch_internals checked on both paths against torch's and tensordict's own constructors,
and whole conversions and row operations equal with the internals switched off."""

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch._subclasses.fake_tensor import FakeTensorMode

import nopad
from nopad.batches import micro_batches, select_rows

# private: the torch internals and their public fallbacks are what is tested
from nopad.core import _torch_internals as internals
from tests.batches import make_batch
from tests.rows_batches import assert_rows, nested_batch, rows_of


@pytest.fixture(params=[True, False], ids=["internals", "public"])
def path(request, monkeypatch):
    monkeypatch.setattr(internals, "USE_INTERNALS", request.param)
    return request.param


@pytest.mark.parametrize(("shape", "ragged_dim"), [((7,), 1), ((7, 3), 1), ((4, 7), 2)])
@pytest.mark.parametrize("seqlens", [None, (1, 4)])
def test_wrap_jagged_equals_torchs_public_constructor(path, shape, ragged_dim, seqlens):
    values, offsets = torch.arange(torch.Size(shape).numel()).reshape(shape), torch.tensor([0, 1, 5, 7])
    min_len, max_len = seqlens or (None, None)
    records = internals.seqlen_records(*seqlens) if seqlens else None
    ragged_size = internals.ragged_size_of(offsets)  # shared by the fields of a micro-batch
    ours = internals.wrap_jagged(
        values, offsets, ragged_dim, min_seqlen=min_len, max_seqlen=max_len, records=records, ragged_size=ragged_size
    )
    public = torch.nested.nested_tensor_from_jagged(
        values, offsets, jagged_dim=ragged_dim, min_seqlen=min_len, max_seqlen=max_len
    )
    assert ours.shape == public.shape and ragged_dim == internals.ragged_dim(ours) == internals.ragged_dim(public)
    assert ours.stride() == public.stride() and type(ours) is type(public)
    assert ours.offsets() is offsets and torch.equal(ours.values(), public.values())
    assert [torch.equal(a, b) for a, b in zip(ours.unbind(), public.unbind())] == [True] * 3
    assert (ours._maybe_min_seqlen, ours._maybe_max_seqlen) == (public._maybe_min_seqlen, public._maybe_max_seqlen)
    assert internals.cached_seqlens(ours) == ((min_len, max_len) if path else (None, None))
    # values that need a gradient take torch's own path, so the nested tensor stays their view
    grad_values = values.float().requires_grad_()
    nested = internals.wrap_jagged(grad_values, offsets, ragged_dim)
    nested.values().sum().backward()
    assert torch.equal(grad_values.grad, torch.ones_like(grad_values))


def test_the_fast_jagged_constructor_is_taken_on_this_torch():
    """The constructor check passes on the torches of CI's main leg (2.13) and vLLM's (2.14), so the
    tests above exercise nopad's own constructor and not only torch's fallback. On the declared floor
    (torch 2.9) the check finds a difference and torch's constructor is taken: the tests above then
    prove the fallback."""
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13):
        assert not internals._constructor_agrees.__wrapped__()
        return
    assert internals._constructor_agrees.__wrapped__()


def test_jagged_values_is_the_values_tensor_and_keeps_every_gradient_path(path):
    offsets = torch.tensor([0, 2, 5])
    values = torch.randn(5, 3, requires_grad=True)
    nested = torch.nested.nested_tensor_from_jagged(values, offsets)
    assert torch.equal(internals.jagged_values(nested), nested.values())
    (internals.jagged_values(nested) * 2).sum().backward()  # through a view built from values
    assert torch.equal(values.grad, torch.full_like(values, 2.0))
    leaf = torch.nested.nested_tensor_from_jagged(torch.randn(5, 3), offsets).requires_grad_()
    internals.jagged_values(leaf).sum().backward()  # a nested leaf: the dispatched view, so its grad arrives
    assert torch.equal(leaf.grad.values(), torch.ones(5, 3))
    with warnings.catch_warnings():  # torch warns (once) that the strided layout is a prototype
        warnings.simplefilter("ignore", UserWarning)
        strided = torch.nested.nested_tensor([torch.ones(2)], layout=torch.strided)
    assert internals.is_nested(nested) and internals.is_nested(strided)
    assert internals.is_jagged(nested) and not internals.is_jagged(strided)
    assert not internals.is_nested(values) and not internals.is_nested(None) and not internals.is_jagged(values)


def test_put_checked_is_tensordicts_own_set(path):
    nested = torch.nested.nested_tensor_from_jagged(torch.arange(5), torch.tensor([0, 2, 5]))
    ours, theirs = TensorDict({}, batch_size=[2]), TensorDict({}, batch_size=[2])
    internals.put_checked(ours, "ids", nested)
    theirs["ids"] = nested
    assert ours.keys() == theirs.keys() and ours["ids"] is theirs["ids"]
    two_dims = TensorDict({}, batch_size=[2, 3])  # another batch rank: always the checked way
    internals.put_checked(two_dims, "x", torch.zeros(2, 3))
    assert two_dims["x"].shape == (2, 3)


def test_seqlen_records_are_marked_like_torchs_and_made_once_per_length():
    public = torch.nested.nested_tensor_from_jagged(
        torch.arange(7), torch.tensor([0, 1, 5, 7]), min_seqlen=1, max_seqlen=4
    )
    ours, again = internals.seqlen_records(1, 4), internals.seqlen_records(1, 4)
    for key in ("min_seqlen", "max_seqlen"):
        record, theirs = ours[key], public._metadata_cache[key]
        assert record is again[key] and record.shape == theirs.shape and record.numel() == 0
        assert record._dynamo_dynamic_indices == theirs._dynamo_dynamic_indices == {0}
    with torch.device("meta"):  # a default device does not reach a record
        assert internals.seqlen_records(2, 9)["max_seqlen"].device.type == "cpu"
    kept = internals.seqlen_records(3, 11)["max_seqlen"]
    with FakeTensorMode():  # while tracing, each record is the mode's own: none kept, none handed in
        traced = internals.seqlen_records(3, 11)["max_seqlen"]
        assert traced is not kept and traced is not internals.seqlen_records(3, 11)["max_seqlen"]
    assert internals.seqlen_records(3, 11)["max_seqlen"] is kept


def test_conversions_and_row_operations_are_equal_with_the_internals_off(monkeypatch):
    data = make_batch([3, 2, 1, 4], [2, 0, 3, 1], 4, 4, mrope=4)
    batch = nested_batch([3, 0, 5, 2, 7], register=False)
    fast_out = nopad.left_right_2_no_padding(data)
    fast_rows = rows_of(select_rows(batch, [4, 0, 0, 2]))
    fast_micro = [rows_of(m) for m in micro_batches(batch, 8)[0]]
    monkeypatch.setattr(internals, "USE_INTERNALS", False)
    public_out = nopad.left_right_2_no_padding(data)
    for key in ("input_ids", "position_ids", "routed_experts", "teacher_logprobs"):
        assert torch.equal(fast_out[key].values(), public_out[key].values())
        assert torch.equal(fast_out[key].offsets(), public_out[key].offsets())
        assert internals.ragged_dim(fast_out[key]) == internals.ragged_dim(public_out[key])
    assert_rows(select_rows(batch, [4, 0, 0, 2]), fast_rows)
    for part, want in zip(micro_batches(batch, 8)[0], fast_micro):
        assert_rows(part, want)
