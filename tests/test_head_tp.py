"""The vocabulary-parallel head: each rank holds a (V / tp, H) shard of the output layer; log-probs,
entropy and gradients equal one process with the whole layer, and megatron-core's
``vocab_parallel_cross_entropy`` on the same shards; memory per rank stays flat in T."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

# private: the vocabulary-parallel shard and the head's runner are what is tested
import nopad.core._errors
from nopad.diagnostics import OpCounter
from nopad.modeling import head_log_probs
from nopad.modeling._logprobs import VocabShard, run_head
from tests.dist_utils import run_distributed
from tests.live_bytes import LiveBytes

TOL = 1e-5
T, H, V = 37, 16, 240  # V divides by 2 and 4
TILE = (8, 16)  # several token tiles, several vocabulary tiles on every rank


def _case(seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    b = torch.randn(V, generator=g) if bias else None
    labels = torch.randint(0, V, (T,), generator=g)
    labels[:4] = torch.tensor([0, V - 1, V // 2 - 1, V // 2])  # both ends and the shard edges
    temperature = torch.rand(T, generator=g) + 0.5  # per token
    weights = torch.randn(2, T, generator=g)
    return hidden, weight, b, labels, temperature, weights


def _run(hidden, weight, b, labels, temperature, weights, shard=None, **head):
    """(log-probs, entropy, grad hidden, grad weight, grad bias) of ``sum(w1 lp + w2 entropy)``."""
    params = [x.clone().requires_grad_() for x in (hidden, weight) + ((b,) if b is not None else ())]
    h, w, *rest = params
    lp, ent = run_head(h, w, rest[0] if rest else None, labels, temperature, True, tile=TILE, shard=shard, **head)
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    return [lp.detach(), ent.detach()] + [p.grad for p in params]


CONFIGS = {
    "plain": {},
    "softcap, scaled": {"softcap": 2.5, "scale": 0.5},
}


def _tp_worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    hidden, weight, b, labels, temperature, weights = _case()
    rows = slice(rank * V // world, (rank + 1) * V // world)
    part = slice(rank * T // world, (rank + 1) * T // world) if T % world == 0 else None
    errors = {}
    for name, head in CONFIGS.items():
        ref = _run(hidden, weight, b, labels, temperature, weights, **head)
        ref_shard = ref[:3] + [ref[3][rows], ref[4][rows]]
        for sp in (False, True):
            if sp and part is None:
                continue
            shard = VocabShard(group, rank, world, sequence_parallel=sp)
            h = hidden[part] if sp else hidden
            ours = _run(h, weight[rows], b[rows], labels, temperature, weights, shard, **head)
            expected = ref_shard if not sp else ref_shard[:2] + [ref_shard[2][part]] + ref_shard[3:]
            errors[f"{name}, sp={sp}"] = [float((a - e).abs().max()) for a, e in zip(ours, expected)]
    # the public entry: a ProcessGroup, a float temperature, no bias, the default tiles
    ref_lp, ref_ent = head_log_probs(hidden, weight, labels, 0.8, True)
    h, w = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
    nopad.core._errors.HOST_VALUES_CHECKED = False  # the CPU takes a device's path: the labels are not read
    try:
        with OpCounter() as counter:  # forward and backward: collectives, no host read
            lp, ent = head_log_probs(h, w, labels, 0.8, True, tp_group=group)
            (lp.sum() + ent.sum()).backward()
    finally:
        nopad.core._errors.HOST_VALUES_CHECKED = True
    errors["head_log_probs(tp_group)"] = [float((lp - ref_lp).abs().max()), float((ent - ref_ent).abs().max())]
    errors["host syncs"] = [float(counter.syncs)]
    if importlib.util.find_spec("megatron") is not None:
        errors["megatron"] = _against_megatron(rank, world, hidden, weight, b, labels, temperature, weights, rows)
    return errors


def _against_megatron(rank, world, hidden, weight, b, labels, temperature, weights, rows) -> list[float]:
    """megatron-core's vocab_parallel_cross_entropy on the (T, V / tp) logits of the same shards (the
    logits divided by the per-token temperature), its gradients taken back through the shard's matmul
    and the hidden one all-reduced as its ColumnParallelLinear does."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        h, w, bb = (x.clone().requires_grad_() for x in (hidden, weight[rows], b[rows]))
        logits = (h @ w.T + bb) / temperature.unsqueeze(-1)
        loss = vocab_parallel_cross_entropy(logits.unsqueeze(1), labels.unsqueeze(1)).squeeze(1)
        (-loss * weights[0]).sum().backward()
        dist.all_reduce(h.grad, group=mpu.get_tensor_model_parallel_group())
        ref = [-loss.detach(), h.grad, w.grad, bb.grad]
        h2, w2, b2 = (x.clone().requires_grad_() for x in (hidden, weight[rows], b[rows]))
        lp, _ = head_log_probs(h2, w2, labels, temperature, bias=b2, tp_group=mpu.get_tensor_model_parallel_group())
        (lp * weights[0]).sum().backward()
        return [float((a - e).abs().max()) for a, e in zip([lp.detach(), h2.grad, w2.grad, b2.grad], ref)]
    finally:
        mpu.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tp_head_on_gloo_ranks_equals_one_process_and_megatron_core(world):
    """With per-token temperature, bias, soft-capping and a scale, with and without sequence parallelism:
    log-probs, entropy and the gradients of hidden (summed over ranks), of the weight shard and of the
    bias shard within 1e-5 of one process holding the whole layer; and megatron-core's
    vocab_parallel_cross_entropy on the same shards (log-probs, gradients) within 1e-5; no host sync."""
    results = run_distributed(_tp_worker, world)
    for rank, errors in enumerate(results):
        assert ("megatron" in errors) == (importlib.util.find_spec("megatron") is not None)
        assert any("sp=True" in name for name in errors) == (T % world == 0)
        for name, errs in errors.items():
            assert max(errs) <= TOL, (world, rank, name, errs)


def _memory_worker(rank: int, world: int, sizes: tuple[int, ...], hidden: int, vocab: int) -> list[int]:
    """Peak live bytes above the inputs of one forward + backward (log-prob and entropy) per T."""
    torch.manual_seed(0)
    peaks = []
    for tokens in sizes:
        h = torch.randn(tokens, hidden).requires_grad_()
        w = (torch.randn(vocab // world, hidden) / hidden**0.5).requires_grad_()
        labels = torch.randint(0, vocab, (tokens,))
        with LiveBytes().ignore(h, w, labels) as live:
            lp, ent = head_log_probs(h, w, labels, 0.9, True, tp_group=dist.group.WORLD)
            (lp.sum() + ent.sum()).backward()
        peaks.append(live.peak)
    return peaks


@pytest.mark.slow
def test_tp_head_memory_per_rank_is_flat_in_tokens_at_a_real_vocabulary():
    """V = 151,936 over 2 ranks (75,968 rows each), T = 2,048 and 8,192: the live tensor memory above
    the inputs (tracked storage by storage, tests/live_bytes.py; gradients included) grows by far less
    than one (T, V / tp) float32 logits buffer (2.3 GiB at T = 8,192): only the O(T) statistics, the
    (T, H) gradient of hidden and the collectives' O(T) buffers grow."""
    hidden, vocab, sizes = 16, 151_936, (2048, 8192)
    results = run_distributed(_memory_worker, 2, sizes, hidden, vocab)
    for peaks in results:
        grew = peaks[1] - peaks[0]
        per_token = 4 * hidden + 256  # the (T, H) hidden gradient and a few dozen (T,) vectors
        assert grew <= (sizes[1] - sizes[0]) * per_token, (peaks, grew)
        logits = 4 * sizes[1] * vocab // 2
        assert peaks[1] < logits / 8, peaks  # a few tiles and the weight's gradient, never the logits


def test_bad_tp_arguments_fail_loudly_naming_the_field():
    hidden, weight, b, labels, temperature, weights = _case()
    with pytest.raises(ValueError, match=r"tp_group: expected a torch.distributed ProcessGroup or None, got str"):
        head_log_probs(hidden, weight, labels, tp_group="tp")
    with pytest.raises(ValueError, match=r"sequence_parallel: expected a tp_group to gather the sequence over"):
        head_log_probs(hidden, weight, labels, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel: expected True or False \(a bool\)"):
        head_log_probs(hidden, weight, labels, sequence_parallel="false")
