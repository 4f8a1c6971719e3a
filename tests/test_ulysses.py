"""Ulysses sequence parallelism: index math, autograd collectives, and SP 2 / 4 == one process exactly.

The multi-process part runs ONCE on 4 gloo ranks (a module fixture): the world is the SP-4 group
and ranks {0, 1} / {2, 3} form two SP-2 groups, so both sizes are checked in one spawn.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from nopad import left_right_2_no_padding, no_padding_2_padding
from nopad.engines import check_isolation, packed_logprobs, padded_logprobs, prepare_model_inputs
from nopad.modeling import use_packed_attention

# private: Ulysses' all-to-all pieces are tested on their own
from nopad.parallel._ulysses import (
    _heads_view,
    all_to_all,
    block_causal_mask,
    enable_ulysses,
    gather_seq,
    local_range,
    padded_length,
    slice_for_rank,
)
from tests.dist_utils import run_distributed
from tests.models import make_padded_batch, tiny_llama, tiny_qwen2_vl_text

TEMPERATURE = (0.5, 1.0, 2.0)
A2A_DIMS = [(1, 2), (2, 1), (0, 3)]

# ---- index math -------------------------------------------------------------------------------


@given(total=st.integers(0, 500), sp=st.integers(1, 8), multiple=st.integers(1, 16))
def test_padded_length_is_the_smallest_common_multiple_at_or_above_total(total, sp, multiple):
    padded = padded_length(total, sp, multiple)
    assert padded >= total and padded % sp == 0 and padded % multiple == 0
    assert not any(n % sp == 0 and n % multiple == 0 for n in range(total, padded))


@given(total=st.integers(0, 200), sp=st.integers(1, 8))
def test_rank_slices_partition_the_padded_row_in_rank_order(total, sp):
    padded = padded_length(total, sp)
    row = torch.arange(padded)
    pieces = [slice_for_rank(row, sp, r) for r in range(sp)]
    assert torch.equal(torch.cat(pieces), row)
    assert [local_range(padded, sp, r) for r in range(sp)] == [
        (r * padded // sp, (r + 1) * padded // sp) for r in range(sp)
    ]


def test_index_math_rejects_bad_sizes():
    with pytest.raises(ValueError, match="padded_total: expected a multiple of sp_size 4, got 6"):
        local_range(6, 4, 0)
    with pytest.raises(ValueError, match="sp_rank: expected 0 <= rank < 2, got 2"):
        local_range(6, 2, 2)
    with pytest.raises(ValueError, match="sp_size: expected an int >= 1, got 0"):
        padded_length(5, 0)
    assert padded_length(5, 2, pad_to_multiple=3) == 6


@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=5))
def test_block_causal_mask_allows_exactly_earlier_tokens_of_the_same_segment(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = int(cu[-1])
    mask = block_causal_mask(cu, total)
    segment = [s for s, n in enumerate(lengths) for _ in range(n)]
    expected = [[segment[i] == segment[j] and j <= i for j in range(total)] for i in range(total)]
    assert mask.shape == (1, 1, total, total) and mask[0, 0].tolist() == expected
    additive = block_causal_mask(cu, total, additive_dtype=torch.float32)
    assert torch.equal(additive == 0, mask)


# ---- the 4-rank run ---------------------------------------------------------------------------


def _rank_tensor(rank, shape, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _simulated_all_to_all(xs, scatter_dim, gather_dim):
    world = len(xs)
    return [torch.cat([xs[q].chunk(world, scatter_dim)[r] for q in range(world)], dim=gather_dim) for r in range(world)]


def _sp_batch():
    return make_padded_batch(3, 6, 5, seed=4)


def _run_model(builder, td, sp_group=None, **input_kwargs):
    m = builder()
    if sp_group is not None:
        enable_ulysses(m)
    micro = left_right_2_no_padding(td)
    out = packed_logprobs(
        m, micro, torch.tensor(TEMPERATURE), calculate_entropy=True, sp_group=sp_group, **input_kwargs
    )
    no_padding_2_padding(out["log_probs"], micro).sum().backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    return out["log_probs"].values().detach(), out["entropy"].values().detach(), grads


def _ulysses_worker(rank, world_size):
    torch.set_num_threads(1)
    world = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {"collectives": {}, "sp": {}}

    for salt, (scatter, gather) in enumerate(A2A_DIMS):
        x = _rank_tensor(rank, (4, 8, 4, 4), salt).requires_grad_()
        y = all_to_all(x, world, scatter, gather)
        weight = _rank_tensor(rank, y.shape, salt + 50)
        (y * weight).sum().backward()
        results["collectives"][("a2a", scatter, gather)] = (
            y.detach(),
            x.grad,
            all_to_all(y.detach(), world, gather, scatter),
        )
    x = _rank_tensor(rank, (3, 5), 9).requires_grad_()
    y = gather_seq(x, world, dim=1)
    (y * _rank_tensor(rank, y.shape, 10)).sum().backward()
    results["collectives"]["gather"] = (y.detach(), x.grad)

    td = _sp_batch()
    try:  # a model whose attention was not wrapped would silently attend within its slice only
        prepare_model_inputs(left_right_2_no_padding(td), sp_group=world, attn_implementation="sdpa")
        results["unwrapped"] = "no error"
    except ValueError as err:
        results["unwrapped"] = str(err)
    for sp, group in ((2, pairs[rank // 2]), (4, world)):
        inputs, _ = prepare_model_inputs(left_right_2_no_padding(td), sp_group=group)
        for name, builder in (("llama", tiny_llama), ("qwen2_vl_text", tiny_qwen2_vl_text)):
            batch = make_padded_batch(3, 6, 5, seed=4, mrope=True) if name == "qwen2_vl_text" else td
            lp, ent, grads = _run_model(builder, batch, group)
            for g in grads.values():
                dist.all_reduce(g, group=group)
                g /= sp
            results["sp"][(sp, name)] = (lp, ent, grads, inputs["input_ids"], inputs["position_ids"])
    results["sp_bucket"] = _run_model(tiny_llama, td, world, pad_to_multiple=6)  # row padded to lcm(4, 6) = 12
    results["sp_eager"] = _run_model(functools.partial(tiny_llama, attn_implementation="eager"), td, pairs[rank // 2])
    for sp, group in ((2, pairs[rank // 2]), (4, world)):
        lp, ent, grads = _run_model(_varlen_llama, td, group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
            g /= sp
        results[("sp_varlen", sp)] = (lp, ent, grads)
    return results


def _varlen_llama():
    return use_packed_attention(tiny_llama())


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_ulysses_worker, 4)


@pytest.mark.slow
@pytest.mark.parametrize("dims", A2A_DIMS)
def test_all_to_all_moves_every_chunk_and_its_backward_is_the_reverse(four_ranks, dims):
    scatter, gather = dims
    xs = [_rank_tensor(r, (4, 8, 4, 4), A2A_DIMS.index(dims)).requires_grad_() for r in range(4)]
    ys = _simulated_all_to_all(xs, scatter, gather)
    weights = [_rank_tensor(r, ys[r].shape, A2A_DIMS.index(dims) + 50) for r in range(4)]
    sum((y * w).sum() for y, w in zip(ys, weights)).backward()
    for r, result in enumerate(four_ranks):
        y, grad, back = result["collectives"][("a2a", scatter, gather)]
        assert torch.equal(y, ys[r].detach()) and torch.equal(grad, xs[r].grad)
        assert torch.equal(back, xs[r].detach())  # the reverse all-to-all undoes it


@pytest.mark.slow
def test_gather_seq_concatenates_in_rank_order_and_backward_sums_each_slice(four_ranks):
    xs = [_rank_tensor(r, (3, 5), 9) for r in range(4)]
    gathered = torch.cat(xs, dim=1)
    weight_sum = sum(_rank_tensor(r, gathered.shape, 10) for r in range(4))
    for r, result in enumerate(four_ranks):
        y, grad = result["collectives"]["gather"]
        assert torch.equal(y, gathered)
        assert torch.allclose(grad, weight_sum[:, 5 * r : 5 * (r + 1)], atol=1e-12)


@pytest.fixture(scope="module")
def single_process():
    out = {}
    for name, builder, mrope in (("llama", tiny_llama, False), ("qwen2_vl_text", tiny_qwen2_vl_text, True)):
        out[name] = _run_model(builder, make_padded_batch(3, 6, 5, seed=4, mrope=mrope))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name", ["llama", "qwen2_vl_text"])
def test_ulysses_log_probs_equal_one_process_exactly(four_ranks, single_process, sp, name):
    total = single_process[name][0].shape[0]
    assert total % sp != 0  # the row really needed padding
    ref_lp, ref_ent, ref_grads = single_process[name]
    for rank, result in enumerate(four_ranks):
        lp, ent, grads, _, _ = result["sp"][(sp, name)]
        assert torch.equal(lp, ref_lp), f"rank {rank}: max diff {(lp - ref_lp).abs().max()}"
        # Logits differ from one process by <= ~2e-7 (CPU matmuls block L tokens differently from T); the
        # log-probs above still round to the same floats, the entropy may move by an ulp.
        assert torch.allclose(ent, ref_ent, rtol=0, atol=2e-6)
        # Averaged over the SP group, the parameter gradients are the one-process ones.
        for n, g in grads.items():
            assert torch.allclose(g, ref_grads[n], rtol=1e-4, atol=1e-5), n


def test_sp_refuses_an_attention_that_is_not_wrapped(four_ranks):
    for result in four_ranks:
        assert result["unwrapped"].startswith("attn_implementation: expected a Ulysses wrapper"), result["unwrapped"]


def test_ulysses_with_bucket_padding_pads_to_a_common_multiple_and_still_equals_one_process(four_ranks, single_process):
    for result in four_ranks:
        assert torch.equal(result["sp_bucket"][0], single_process["llama"][0])


def test_ulysses_wraps_eager_attention_too(four_ranks):
    ref_lp, _, _ = _run_model(functools.partial(tiny_llama, attn_implementation="eager"), _sp_batch())
    for result in four_ranks:
        lp = result["sp_eager"][0]
        assert torch.equal(lp, ref_lp), (lp - ref_lp).abs().max()


@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_around_nopad_varlen_equals_one_process(four_ranks, single_process, sp):
    ref_lp, ref_ent, ref_grads = single_process["llama"]
    for rank, result in enumerate(four_ranks):
        lp, ent, grads = result[("sp_varlen", sp)]
        assert torch.allclose(lp, ref_lp, rtol=0, atol=1e-6), f"rank {rank}: max diff {(lp - ref_lp).abs().max()}"
        assert torch.allclose(ent, ref_ent, rtol=0, atol=2e-6)
        for n, g in grads.items():  # averaged over the SP group: the one-process gradient
            assert torch.allclose(g, ref_grads[n], rtol=1e-4, atol=1e-5), n


def test_nopad_varlen_and_ulysses_compose_in_either_order_and_stay_isolated():
    first_varlen = enable_ulysses(use_packed_attention(tiny_llama()))
    first_ulysses = use_packed_attention(enable_ulysses(tiny_llama()))
    for m in (first_varlen, first_ulysses):
        assert m.config._attn_implementation == "nopad_ulysses_nopad_varlen"
        assert not check_isolation(m)
    td = _sp_batch()
    micro = left_right_2_no_padding(td)
    with torch.no_grad():
        assert torch.allclose(
            packed_logprobs(first_varlen, micro).values(),
            packed_logprobs(tiny_llama(), micro).values(),
            rtol=0,
            atol=1e-6,
        )


def test_a_wrapped_model_without_a_group_computes_exactly_what_it_did_before():
    td = _sp_batch()
    micro = left_right_2_no_padding(td)
    plain, wrapped = tiny_llama(), enable_ulysses(tiny_llama())
    with torch.no_grad():
        assert torch.equal(packed_logprobs(wrapped, micro).values(), packed_logprobs(plain, micro).values())
        assert torch.equal(padded_logprobs(wrapped, td), padded_logprobs(plain, td))  # its 2-D mask still applies
    assert not check_isolation(wrapped)


def test_the_base_kernel_sees_its_own_implementation_and_the_split_head_groups():
    m = enable_ulysses(tiny_llama())
    attention = m.model.layers[0].self_attn
    assert attention.config._attn_implementation == "nopad_ulysses_sdpa"
    view = _heads_view(attention, 1, "flash_attention_2")
    assert view.config._attn_implementation == "flash_attention_2" and view.num_key_value_groups == 1
    assert view.q_proj is attention.q_proj and view.config.hidden_size == attention.config.hidden_size
    assert enable_ulysses(m) is m and attention.config._attn_implementation == "nopad_ulysses_sdpa"


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
def test_each_rank_gets_its_slice_of_the_padded_row(four_ranks, sp):
    micro = left_right_2_no_padding(_sp_batch())
    full, _ = prepare_model_inputs(micro, pad_to_multiple=sp)
    groups = [[0, 1], [2, 3]] if sp == 2 else [[0, 1, 2, 3]]
    for ranks in groups:
        ids = torch.cat([four_ranks[r]["sp"][(sp, "llama")][3] for r in ranks], dim=-1)
        positions = torch.cat([four_ranks[r]["sp"][(sp, "llama")][4] for r in ranks], dim=-1)
        assert torch.equal(ids, full["input_ids"]) and torch.equal(positions, full["position_ids"])
