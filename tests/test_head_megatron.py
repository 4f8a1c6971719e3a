"""The Megatron adapter's head: from a THD/CP-sharded decoder output and the vocabulary-parallel output
layer's weight, nested log-probs and entropy through postprocess_thd's plan, equal to megatron-core's
``vocab_parallel_cross_entropy`` on the full logits (TP 2 x CP 2 on 4 gloo ranks, with and without
sequence parallelism)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nopad import no_padding_2_padding
from nopad.core import IndexPlan
from nopad.engines import ThdPlan, preprocess_thd, thd_logprobs
from nopad.modeling import token_log_probs
from tests.dist_utils import run_distributed

TOL = 1e-5
LENGTHS = [5, 9, 4]
H, V = 16, 64


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    plan = IndexPlan.from_lengths(torch.tensor(LENGTHS))
    ids = plan.to_nested(torch.randint(0, V, (plan.total,), generator=g))
    hidden = torch.randn(plan.total, H, generator=g)  # the decoder's output at every real token
    weight = torch.randn(V, H, generator=g) / H**0.5
    temperature = torch.tensor([0.7, 1.0, 1.3])
    weights = torch.randn(2, plan.total, generator=g)
    return ids, hidden, weight, temperature, weights


def test_one_rank_equals_the_logits_path_and_reads_as_responses():
    """No TP, no CP: the head's nested log-probs and entropy (and their gradients) equal the logits
    path's next-token results; a sequence's last token holds 0; the padding is never in the output."""
    ids, hidden, weight, temperature, weights = _batch()
    plan = ThdPlan.from_nested(ids, cp_size=1)
    tokens, params, _ = preprocess_thd(ids)
    h = hidden.clone().requires_grad_()
    local = plan.shard(_nested_like(ids, h))[0].unsqueeze(1)  # (local_len, 1, H)
    out = thd_logprobs(local, weight, ids, plan, params, temperature=temperature, calculate_entropy=True)
    assert out["log_probs"].offsets() is ids.offsets()
    ((out["log_probs"].values() * weights[0]).sum() + (out["entropy"].values() * weights[1]).sum()).backward()

    r = hidden.clone().requires_grad_()
    labels = IndexPlan.from_nested(ids).next_token_labels(ids.values())
    per_token = temperature[IndexPlan.from_nested(ids).row_ids]
    lp, ent = token_log_probs(r @ weight.T, labels, per_token, True)
    lp = torch.where(IndexPlan.from_nested(ids).last_token_mask, 0.0, lp)
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    assert (out["log_probs"].values().detach() - lp.detach()).abs().max() <= TOL
    assert (out["entropy"].values().detach() - ent.detach()).abs().max() <= TOL
    assert (h.grad - r.grad).abs().max() <= TOL
    # responses of 2, 3 and 1 tokens: no_padding_2_padding reads their log-probs (t - 1 for token t)
    responses = IndexPlan.from_lengths(torch.tensor([2, 3, 1])).to_nested(torch.zeros(6, dtype=torch.int64))
    read = no_padding_2_padding(out["log_probs"], {"input_ids": ids, "responses": responses})
    ends = ids.offsets()[1:]
    assert torch.equal(read[1], out["log_probs"].values()[ends[1] - 4 : ends[1] - 1])
    assert tokens.shape[1] == plan.local_len


def _nested_like(ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return IndexPlan.from_nested(ids).to_nested(values)


def _megatron_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from nopad.engines import from_parallel_state, postprocess_thd

    mpu.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    try:
        dims = from_parallel_state()
        tp_group, tp_rank = mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_rank()
        ids, hidden, weight, temperature, weights = _batch()
        plan = ThdPlan.from_nested(ids, tp_size=2, cp_size=2, cp_rank=dims.cp_rank)
        _, params, _ = preprocess_thd(ids, **dims.preprocess_kwargs())
        rows = slice(tp_rank * V // 2, (tp_rank + 1) * V // 2)
        last = IndexPlan.from_nested(ids).last_token_mask

        # megatron-core: the column-parallel layer's (local_len, V/2) logits, vocab_parallel_cross_entropy
        rh, rw = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
        x = copy_to_tensor_model_parallel_region(plan.shard(_nested_like(ids, rh))[0])  # all-reduce in backward
        logits = (x @ rw.T) / temperature[plan.segment].unsqueeze(-1)
        labels = plan.shard(ids, need_roll=True)[0]
        loss = vocab_parallel_cross_entropy(logits.unsqueeze(1).clone(), labels.unsqueeze(1)).squeeze(1)
        whole = [torch.empty_like(logits) for _ in range(2)]
        dist.all_gather(whole, logits.detach(), group=tp_group)
        entropy = torch.distributions.Categorical(logits=torch.cat(whole, -1)).entropy()
        ref = postprocess_thd(
            torch.stack([-loss, entropy], -1).unsqueeze(0), params, ids, plan=plan, cp_group=dims.cp_group
        )
        ref_lp, ref_ent = torch.where(last, 0.0, ref.values()[:, 0]), ref.values()[:, 1]
        (ref_lp * weights[0]).sum().backward()

        errors = {}
        for sp in (False, True):
            # ours: the rank's decoder output (its CP shard; under SP its TP part of that), the weight shard
            h, w = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
            local = plan.shard(_nested_like(ids, h))[0].unsqueeze(1)  # (local_len, 1, H)
            if sp:
                part = local.shape[0] // 2
                local = local[tp_rank * part : (tp_rank + 1) * part]
            out = thd_logprobs(
                local,
                w,
                ids,
                plan,
                params,
                temperature=temperature,
                calculate_entropy=True,
                tp_group=tp_group,
                sequence_parallel=sp,
                cp_group=dims.cp_group,
            )
            lp, ent = out["log_probs"].values(), out["entropy"].values()
            (lp * weights[0]).sum().backward()  # megatron's loss has the log-probs' gradient only
            if sp:  # each TP rank's gradient covers its own part of the rows: together, the whole
                dist.all_reduce(h.grad, group=tp_group)
            errors[f"sp={sp}"] = [
                float((lp.detach() - ref_lp.detach()).abs().max()),
                float((ent.detach() - ref_ent).abs().max()),
                float((h.grad - rh.grad).abs().max()),
                float((w.grad - rw.grad).abs().max()),
            ]
        return errors
    finally:
        mpu.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_tp2_cp2_on_four_gloo_ranks_equals_megatron_cores_vocab_parallel_cross_entropy():
    """Each rank: its zigzag CP shard of the row, a (V/2, H) output-layer shard, per-sequence
    temperatures; with and without sequence parallelism. Log-probs (and the gradients of the decoder's
    output and of the weight shard, the hidden one reduced by megatron's column-parallel copy) equal
    vocab_parallel_cross_entropy's on the full logits; entropy equals the gathered logits' within 1e-5."""
    for rank, errors in enumerate(run_distributed(_megatron_worker, 4)):
        for name, errs in errors.items():
            assert max(errs) <= TOL, (rank, name, errs)
