"""Ulysses sequence parallelism for the layers that carry state along the sequence: SP 2 and 4 equal one process.

The gated delta rule's and the Mamba2 scan's heads are independent, so the all-to-all that serves
attention (sequence-sharded -> head-sharded) serves them; the short conv reads the K - 1 inputs
before each rank's slice from the other ranks. One spawn of 4 gloo ranks: the world is the SP-4
group and ranks {0, 1} / {2, 3} the SP-2 groups. Sequences up to 80 tokens, so the scans cross
chunks (64 for the delta rule, 32 for these Mamba2 mixers) and the convs cross rank slices.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from nopad import left_right_2_no_padding, no_padding_2_padding  # noqa: E402
from nopad.engines import packed_logprobs  # noqa: E402
from nopad.parallel import enable_ulysses  # noqa: E402
from nopad.synthetic import tiny_causal_lm  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.models import make_padded_batch  # noqa: E402

ARCHS = ["qwen3_5", "bamba", "lfm2"]
VOCAB = 97


def _batch():
    return make_padded_batch(3, 20, 60, seed=4, vocab=VOCAB)


def _run(arch: str, group=None):
    model = tiny_causal_lm(arch, vocab=VOCAB, hidden=32, layers=4)
    if group is not None:
        enable_ulysses(model)
    micro = left_right_2_no_padding(_batch())
    out = packed_logprobs(model, micro, torch.tensor([0.5, 1.0, 2.0]), calculate_entropy=True, sp_group=group)
    no_padding_2_padding(out["log_probs"], micro).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if group is not None:  # averaged over the SP group: the one-process gradient
        size = dist.get_world_size(group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
            g /= size
    return out["log_probs"].values().detach(), out["entropy"].values().detach(), grads


def _fsdp_batch(rank):
    return make_padded_batch(2, 10, 40, seed=200 + rank, vocab=VOCAB)


def _fsdp2(arch: str, rank: int):
    """The model routed, then sharded by FSDP2 over the 4 ranks (as a trainer builds it); each rank its
    own batch: its log-probs and the full gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nopad.modeling import use_packed_attention

    model = use_packed_attention(tiny_causal_lm(arch, vocab=VOCAB, hidden=32, layers=4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    micro = left_right_2_no_padding(_fsdp_batch(rank))
    lp = packed_logprobs(model, micro, head="logits")
    no_padding_2_padding(lp, micro).sum().backward()
    return lp.values().detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank, world_size):
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    out = {(sp, arch): _run(arch, groups[sp]) for sp in (2, 4) for arch in ARCHS}
    out.update({("fsdp2", arch): _fsdp2(arch, rank) for arch in ("qwen3_5", "bamba")})
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_worker, 4)


@functools.cache
def _one_process(arch):
    return _run(arch)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_ulysses_state_layers_equal_one_process(four_ranks, arch, sp):
    ref_lp, ref_ent, ref_grads = _one_process(arch)
    assert ref_lp.shape[0] % sp != 0 or sp == 2  # the row needs padding for SP 4: a pad segment at its end
    for rank, result in enumerate(four_ranks):
        lp, ent, grads = result[(sp, arch)]
        assert (lp - ref_lp).abs().max() <= 1e-5, f"{arch} SP {sp} rank {rank}: {(lp - ref_lp).abs().max()}"
        assert (ent - ref_ent).abs().max() <= 1e-5
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            scale = max(1.0, ref_grads[name].abs().max().item())
            assert (grad - ref_grads[name]).abs().max() <= 1e-5 * scale, f"{arch} SP {sp} rank {rank}: {name}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "bamba"])
def test_a_routed_model_under_fsdp2_equals_one_process(four_ranks, arch):
    model = tiny_causal_lm(arch, vocab=VOCAB, hidden=32, layers=4)
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for rank, result in enumerate(four_ranks):
        lp, _ = result[("fsdp2", arch)]
        micro = left_right_2_no_padding(_fsdp_batch(rank))
        model.zero_grad()
        ref = packed_logprobs(model, micro, head="logits")
        no_padding_2_padding(ref, micro).sum().backward()
        assert (lp - ref.values().detach()).abs().max() <= 1e-5, f"{arch} rank {rank}"
        for n, p in model.named_parameters():
            if p.grad is not None:
                expected[n] += p.grad / len(four_ranks)  # FSDP averages gradients over its ranks
    for rank, result in enumerate(four_ranks):
        _, grads = result[("fsdp2", arch)]
        for n, g in grads.items():
            scale = max(1.0, expected[n].abs().max().item())
            assert (g - expected[n]).abs().max() <= 1e-5 * scale, f"{arch} rank {rank}: {n}"
