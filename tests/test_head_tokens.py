"""Only the tokens a loss reads: ``tokens="response"`` (the positions ``no_padding_2_padding`` reads)
and ``score_mask`` (an SFT loss's positions) run the head on those hidden rows only, and give the
all-token head's values there, 0 elsewhere, and the all-token head's gradients."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# private: the switch that makes the CPU take a device's path through every value check
import nopad.core._errors
from nopad import left_right_2_no_padding, no_padding_2_padding
from nopad.batches import select_rows
from nopad.diagnostics import OpCounter
from nopad.engines import chunked_head, packed_logprobs, prepare_model_inputs, prepare_model_outputs
from nopad.losses import sft_loss
from tests.dist_utils import run_distributed
from tests.models import make_padded_batch, tiny_llama
from tests.test_head import MODELS, model

TOL = 1e-5


def _run(m, micro, tokens, head, temperature=None, **kw):
    """Nested log-probs and entropy, and the gradients of every parameter and of the hidden states
    entering the output layer, of a loss over the RESPONSE log-probs and entropy (what PPO reads)."""
    m.zero_grad()
    seen = {}

    def keep(_module, args):
        seen["hidden"] = args[0]
        args[0].retain_grad()

    hook = m.get_output_embeddings().register_forward_pre_hook(keep)
    try:
        out = packed_logprobs(m, micro, temperature, calculate_entropy=True, head=head, tokens=tokens, **kw)
    finally:
        hook.remove()
    lp, ent = no_padding_2_padding(out["log_probs"], micro), no_padding_2_padding(out["entropy"], micro)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, *lp.shape, generator=g)
    ((lp * w[0]).sum() + (ent * w[1]).sum()).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    grads["<hidden entering the head>"] = seen["hidden"].grad.clone()
    return out, grads


def _read_positions(micro) -> torch.Tensor:
    """(T,) True where no_padding_2_padding reads the row (the test's own derivation, from the batch's
    response mask and the shift by one)."""
    lengths = micro["input_ids"].offsets().diff()
    response = micro["response_mask"].sum(-1)
    read = []
    for length, r in zip(lengths.tolist(), response.tolist()):
        row = torch.zeros(length, dtype=torch.bool)
        row[length - r - 1 : length - 1] = True
        read.append(row)
    return torch.cat(read)


@pytest.mark.parametrize("name", ["qwen2_biased", "gemma2", "llama_tied"])
@pytest.mark.parametrize("head", ["chunked", "logits"])
def test_response_only_equals_the_all_token_head_where_read_and_is_zero_elsewhere(name, head):
    """Bias, soft-capping, a tied embedding; per-row temperatures: log-probs and entropy at the read
    positions, and the gradients of every parameter (the head's weight and bias included) and of the
    hidden states entering the head, within 1e-5 of scoring every token; 0 at every other position."""
    m = model(name)
    micro = left_right_2_no_padding(make_padded_batch(4, 7, 6, seed=3))
    temperature = torch.tensor([0.5, 1.0, 1.5, 0.8])
    ours, our_grads = _run(m, micro, "response", head, temperature)
    ref, ref_grads = _run(m, micro, "all", head, temperature)
    read = _read_positions(micro)
    assert 0 < int(read.sum()) < read.numel()
    for key in ("log_probs", "entropy"):
        a, b = ours[key].values().detach(), ref[key].values().detach()
        assert ours[key].offsets() is micro["input_ids"].offsets()
        assert (a[read] - b[read]).abs().max() <= TOL, key
        assert torch.equal(a[~read], torch.zeros_like(a[~read])), key
    assert set(our_grads) == set(ref_grads)
    for n in ref_grads:
        assert (our_grads[n] - ref_grads[n]).abs().max() <= TOL, n


class _HeadMatmuls(TorchDispatchMode):
    """The matmuls that read the output layer's weight (forward and backward), and their row counts."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.ptr, self.rows = weight.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "linear", "matmul"):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(t.untyped_storage().data_ptr() == self.ptr for t in tensors):
                self.rows.append(min(t.shape[0] for t in tensors if t.dim() == 2) if tensors else 0)
        return func(*args, **(kwargs or {}))


def test_the_head_runs_on_the_scored_rows_only_and_not_at_all_without_any():
    """The head's matmuls read as many hidden rows as there are response positions; a micro-batch
    whose rows have no response token runs no head matmul at all (forward or backward), and every
    gradient is still there (zero at the head), as an engine that reduces gradients needs."""
    m = tiny_llama(0)
    td = make_padded_batch(4, 7, 6, seed=3)
    micro = left_right_2_no_padding(td)
    n = int(td["response_mask"].sum())
    with _HeadMatmuls(m.lm_head.weight) as seen:
        out = packed_logprobs(m, micro, tokens="response", head="chunked", chunk_size=1024)
        no_padding_2_padding(out, micro).sum().backward()
    assert seen.rows and max(seen.rows) == n < micro["input_ids"].values().shape[0]

    empty = make_padded_batch(4, 7, 6, seed=3, resp_lens=[0, 0, 0, 0])
    micro = left_right_2_no_padding(empty)
    m.zero_grad()
    with _HeadMatmuls(m.lm_head.weight) as seen:
        out = packed_logprobs(m, micro, tokens="response", head="chunked")
        out.values().sum().backward()
    assert seen.rows == []
    assert torch.equal(out.values(), torch.zeros_like(out.values()))
    assert m.lm_head.weight.grad is not None and not m.lm_head.weight.grad.any()


@pytest.mark.parametrize("way_back", [True, False], ids=["the conversion's own batch", "rows picked again"])
def test_response_only_makes_no_host_sync(way_back):
    """From the conversion's way back (exactly the response positions) or, for rows picked again, from
    the micro-batch's response fields (one row per slot of the (B, R) frame): no host sync, the same
    values where read."""
    m = tiny_llama(0)
    micro = left_right_2_no_padding(make_padded_batch(4, 7, 6, seed=5))
    if not way_back:
        micro = select_rows(micro, [2, 0, 3])
    ref = no_padding_2_padding(packed_logprobs(m, micro, 0.7), micro)
    syncs, outs = {}, {}
    nopad.core._errors.HOST_VALUES_CHECKED = False  # the CPU takes a device's path: no value is read
    try:
        for tokens in ("all", "response"):
            with OpCounter() as counter, torch.no_grad():
                inputs, args = prepare_model_inputs(micro, temperature=0.7)
                with chunked_head(m, args, "chunked", tokens=tokens) as served:
                    output = served(**inputs)
                outs[tokens] = prepare_model_outputs(output, args, micro, tokens=tokens)
            syncs[tokens] = counter.syncs
    finally:
        nopad.core._errors.HOST_VALUES_CHECKED = True
    # the model's own forward makes its syncs (HF's sdpa looks for packed rows in the position ids);
    # scoring the responses adds none
    assert syncs["response"] == syncs["all"] <= 1
    assert (no_padding_2_padding(outs["response"]["log_probs"], micro) - ref).abs().max() <= TOL


def test_an_sft_score_mask_gives_the_sft_loss_and_its_gradients_of_every_token():
    """The positions that predict a per-token loss mask's tokens (moved by next_token_labels) as score_mask:
    sft_loss and every gradient equal scoring every token; the head reads only those rows."""
    from nopad.core import IndexPlan

    m = tiny_llama(0)
    conversations = [([3, 4, 5, 6, 7], [0, 0, 1, 1, 1]), ([8, 9, 10], [0, 1, 1]), ([11, 12, 13, 14], [0, 0, 0, 1])]
    plan = IndexPlan.from_lengths(torch.tensor([len(ids) for ids, _ in conversations]))
    micro = {
        "input_ids": plan.to_nested(torch.tensor([t for ids, _ in conversations for t in ids])),
        "position_ids": plan.to_nested(plan.position_ids),
        "loss_mask": plan.to_nested(torch.tensor([v for _, mask in conversations for v in mask])),
    }
    score_mask = plan.next_token_labels(micro["loss_mask"].values())
    results = []
    for kw in ({}, {"score_mask": score_mask}):
        m.zero_grad()
        with _HeadMatmuls(m.lm_head.weight) as seen:
            lp = packed_logprobs(m, micro, head="chunked", **kw)
            loss, _ = sft_loss({}, {"log_probs": lp}, micro)
            loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}, max(seen.rows)))
    (loss_all, grads_all, rows_all), (loss_mask, grads_mask, rows_mask) = results
    assert rows_mask == int(score_mask.sum()) < rows_all
    assert (loss_mask - loss_all).abs() <= TOL
    for n in grads_all:
        assert (grads_mask[n] - grads_all[n]).abs().max() <= TOL, n


def test_the_output_args_of_another_micro_batch_are_refused():
    """Two micro-batches of the same token count: the forward of one under the other's output args
    would score the wrong labels. On the CPU it is a ValueError; where the ids cannot be read for free
    (a device), the results are NaN instead of plausible numbers."""
    m = tiny_llama(0)
    a = left_right_2_no_padding(make_padded_batch(3, 5, 4, seed=1, prompt_lens=[5, 3, 2], resp_lens=[4, 2, 1]))
    b = left_right_2_no_padding(make_padded_batch(3, 5, 4, seed=2, prompt_lens=[5, 3, 2], resp_lens=[4, 2, 1]))
    inputs_a, args_a = prepare_model_inputs(a)
    inputs_b, _ = prepare_model_inputs(b)
    assert inputs_a["input_ids"].shape == inputs_b["input_ids"].shape
    assert not torch.equal(inputs_a["input_ids"], inputs_b["input_ids"])
    with chunked_head(m, args_a) as served, pytest.raises(ValueError, match=r"output_args: expected the OutputArgs"):
        served(**inputs_b)
    with chunked_head(m, args_a) as served, torch.no_grad():  # the same ids in another tensor pass
        same = served(**{**inputs_a, "input_ids": inputs_a["input_ids"].clone()})
        assert not same.log_probs.isnan().any()
    nopad.core._errors.HOST_VALUES_CHECKED = False
    try:
        with chunked_head(m, args_a) as served, torch.no_grad():
            out = prepare_model_outputs(served(**inputs_b), args_a)
    finally:
        nopad.core._errors.HOST_VALUES_CHECKED = True
    lp = out["log_probs"].values()
    assert lp[args_a.label_mask[: lp.shape[0]]].isnan().all()


def test_bad_token_arguments_fail_loudly_naming_the_field():
    m = tiny_llama(0)
    micro = left_right_2_no_padding(make_padded_batch(3, 5, 4, seed=1))
    total = micro["input_ids"].values().shape[0]
    with pytest.raises(ValueError, match=r"tokens: expected one of \['all', 'response'\], got 'prompt'"):
        packed_logprobs(m, micro, tokens="prompt")
    with pytest.raises(ValueError, match=r"tokens: expected 'all' with a score_mask"):
        packed_logprobs(m, micro, tokens="response", score_mask=torch.ones(total, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"score_mask: expected a \({total},\) or nested"):
        packed_logprobs(m, micro, score_mask=torch.ones(total + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"score_mask: expected a 0/1 mask"):
        packed_logprobs(m, micro, score_mask=torch.full((total,), 2))
    from nopad.core import IndexPlan

    plan = IndexPlan.from_lengths(torch.tensor([4, 3]))  # rows without responses: nothing says which to read
    rows = {"input_ids": plan.to_nested(torch.arange(7)), "position_ids": plan.to_nested(plan.position_ids)}
    with pytest.raises(ValueError, match=r"data: expected nested responses, or attention_mask with"):
        packed_logprobs(m, rows, tokens="response")
    inputs, args = prepare_model_inputs(micro)
    with chunked_head(m, args, tokens="response") as served, torch.no_grad():
        output = served(**inputs)
    with pytest.raises(ValueError, match=r"tokens: expected the tokens the head scored \(response\)"):
        prepare_model_outputs(output, args, micro)


def _ulysses_tokens_worker(rank, world_size):
    import torch.distributed as dist

    from nopad.parallel import enable_ulysses

    torch.set_num_threads(1)
    m = enable_ulysses(MODELS["llama"]())
    micro = left_right_2_no_padding(make_padded_batch(3, 6, 5, seed=4))
    res = packed_logprobs(m, micro, 0.9, calculate_entropy=True, tokens="response", sp_group=dist.group.WORLD)
    (no_padding_2_padding(res["log_probs"], micro).sum() + no_padding_2_padding(res["entropy"], micro).sum()).backward()
    grads = {}
    for n, p in m.named_parameters():
        dist.all_reduce(p.grad)
        grads[n] = p.grad / world_size
    return res["log_probs"].values().detach(), res["entropy"].values().detach(), grads


@pytest.mark.slow
def test_response_only_under_ulysses_sp2_equals_one_process_scoring_every_token():
    results = run_distributed(_ulysses_tokens_worker, 2)
    m = MODELS["llama"]()
    micro = left_right_2_no_padding(make_padded_batch(3, 6, 5, seed=4))
    ref = packed_logprobs(m, micro, 0.9, calculate_entropy=True, head="logits")
    (no_padding_2_padding(ref["log_probs"], micro).sum() + no_padding_2_padding(ref["entropy"], micro).sum()).backward()
    read = _read_positions(micro)
    for lp, ent, grads in results:
        assert (lp[read] - ref["log_probs"].values()[read]).abs().max() <= TOL
        assert (ent[read] - ref["entropy"].values()[read]).abs().max() <= TOL
        assert not lp[~read].any() and not ent[~read].any()
        for n, p in m.named_parameters():
            assert torch.allclose(grads[n], p.grad, rtol=1e-4, atol=TOL), n
