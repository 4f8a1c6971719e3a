"""verl's fused Triton head, ``verl.utils.kernel.linear_cross_entropy``, under ``install()``: called as
verl's HF and Megatron fused forwards call it, on a CPU (where verl's kernel cannot run), it gives the
logits path's log-probs, entropy and gradients, vocabulary-parallel on 2 gloo ranks too.

These tests need verl and run in CI's verl leg (its own venv); without verl they are skipped.
"""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import pytest
import torch

try:
    import verl.utils.kernel.linear_cross_entropy as vkernel
except Exception as exc:  # noqa: BLE001 - any failure to import verl means this leg cannot run
    if os.environ.get("NOPAD_REQUIRE_VERL") == "1":
        raise
    pytest.skip(f"verl is not importable here ({exc!r}); these tests run in CI's verl leg", allow_module_level=True)

# private: verl's fused head route and its installer are what is tested
import nopad.integrations.verl._head as vh  # noqa: E402
from nopad.integrations.verl import _install as nv  # noqa: E402
from nopad.modeling import token_log_probs  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402

TOL = 1e-5


@pytest.fixture
def clean():
    if nv.active() is not None:
        nv.active().uninstall()
    yield
    if nv.active() is not None:
        nv.active().uninstall()
    vh.use_kernel("auto")


def _case(S=37, H=16, V=240, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, 1, H, generator=g)  # Megatron's [s, b, h] with b = 1 (a THD row)
    weight = torch.randn(V, H, generator=g) / H**0.5
    labels = torch.randint(0, V, (1, S), generator=g)
    weights = torch.randn(2, S, generator=g)
    return hidden, weight, labels, weights


def _reference(hidden, weight, labels, temperature, weights):
    """The logits path: (T, V) logits, token_log_probs, autograd."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = token_log_probs(h.reshape(-1, h.shape[-1]) @ w.T, labels.reshape(-1), temperature, True)
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def test_install_rebinds_it_where_verl_binds_it_and_uninstall_puts_it_back(clean):
    import verl.models.mcore.model_forward_1f1b_overlap as overlap
    import verl.models.mcore.model_forward_fused as fused

    theirs = vkernel.linear_cross_entropy
    assert fused.linear_cross_entropy is theirs and overlap.linear_cross_entropy is theirs
    with nv.install() as handle:
        for module in (vkernel, fused, overlap):  # the HF forwards import it from vkernel at call time
            assert module.linear_cross_entropy is nv.REPLACEMENTS[nv.KERNEL_MODULE]["linear_cross_entropy"]
            assert (module.__name__, "linear_cross_entropy") in handle.bindings
    assert fused.linear_cross_entropy is theirs and vkernel.linear_cross_entropy is theirs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_verls_hf_fused_triton_forward_runs_on_a_cpu_with_the_logits_paths_values(clean, temperature):
    """verl's own ``forward_with_triton_backend`` (use_fused_kernels with the Triton backend) on a tiny
    Qwen2: without install() it cannot run here; with it, log-probs, entropy and every gradient equal
    the model's logits through the logits path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.models.transformers.dense_common import forward_with_triton_backend

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).float()
    input_ids = torch.randint(0, 300, (1, 40))
    position_ids = torch.cat([torch.arange(25), torch.arange(15)]).unsqueeze(0)  # two packed sequences
    kwargs = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False, return_dict=True)

    with pytest.raises(Exception):  # noqa: B017, PT011 - verl's kernel: no Triton / no CUDA on this machine
        forward_with_triton_backend(model, temperature=temperature, **kwargs)

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return out

    with nv.install():
        out = forward_with_triton_backend(model, temperature=temperature, **kwargs)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        ours = (out.log_probs.detach(), out.entropy.detach(), grads())
    logits = model(**kwargs).logits[0]
    lp, ent = token_log_probs(logits, torch.roll(input_ids[0], -1), temperature, True)
    (lp.sum() + ent.sum()).backward()
    ref = (lp.detach(), ent.detach(), grads())
    assert ours[0].shape == ref[0].shape and ours[0].dtype == torch.float32
    assert (ours[0] - ref[0]).abs().max() <= TOL and (ours[1] - ref[1]).abs().max() <= TOL
    assert set(ours[2]) == set(ref[2])
    for n in ref[2]:
        assert (ours[2][n] - ref[2][n]).abs().max() <= TOL, n


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_called_as_verls_megatron_forward_calls_it_with_each_reduction(clean, reduction):
    """(S, 1, H) hidden states, (1, S) labels, a float temperature, no process group: verl's outputs'
    shapes, float32, the logits path's values; the gradient of hidden in its own shape."""
    import verl.models.mcore.model_forward_fused as fused

    hidden, weight, labels, weights = _case()
    ref = _reference(hidden, weight, labels, 0.8, weights)
    with nv.install():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fused.linear_cross_entropy(h, w, labels, 0.8, reduction, None)
    assert ent.shape == (hidden.shape[0],) and ent.dtype == torch.float32
    expected = {"none": ref[0], "sum": ref[0].sum(), "mean": ref[0].mean()}[reduction]
    assert lp.shape == expected.shape and lp.dtype == torch.float32
    assert torch.allclose(lp.detach(), expected, rtol=TOL, atol=TOL)
    assert (ent.detach() - ref[1]).abs().max() <= TOL
    if reduction == "none":
        ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
        assert h.grad.shape == hidden.shape
        assert (h.grad - ref[2]).abs().max() <= TOL and (w.grad - ref[3]).abs().max() <= TOL


def test_its_arguments_are_checked_and_head_kernel_verl_keeps_verls_own(clean):
    hidden, weight, labels, _ = _case()
    with nv.install():
        with pytest.raises(ValueError, match=r"reduction: expected one of \['none', 'sum', 'mean'\]"):
            vkernel.linear_cross_entropy(hidden, weight, labels, 1.0, "max")
    with nv.install(head_kernel="verl"):  # verl's own kernel, which needs CUDA and Triton
        with pytest.raises(Exception):  # noqa: B017, PT011 - verl's own failure on this machine
            vkernel.linear_cross_entropy(hidden, weight, labels, 1.0, "none")
    with pytest.raises(ValueError, match=r"head_kernel: expected one of \['auto', 'verl', 'nopad'\]"):
        nv.install(head_kernel="triton")


def test_the_probe_keeps_a_kernel_that_agrees_and_drops_one_that_does_not_saying_why():
    """The probe's verdict on two stand-ins for verl's kernel (on this CPU): one computing the same
    results is kept; one a little off is dropped, with a warning naming why; each is probed once."""

    def agrees(h, w, labels, temperature, reduction, group):
        return vh.checked_head(h, w, labels, temperature, True)

    def off(h, w, labels, temperature, reduction, group):
        lp, ent = vh.checked_head(h, w, labels, temperature, True)
        return lp * 1.1, ent

    assert vh._verl_probe(agrees, "cpu") is None
    with pytest.warns(RuntimeWarning, match="failed its probe here .its results differ"):
        assert "differ" in vh._verl_probe(off, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "differ" in vh._verl_probe(off, "cpu")  # remembered: no second probe, no second warning


class _GatherSequence(torch.autograd.Function):
    """Megatron's ``gather_from_sequence_parallel_region`` on a CPU (its own allocates on CUDA): the
    ranks' parts of the sequence gathered in the forward, the gradient reduce-scattered back."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist

        out = x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        out = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous())
        return out


def _tp_worker(rank, world):
    """verl's ``fused_output_processor`` (its Megatron postprocess hook) with a TP 2 output layer shard."""
    import verl.models.mcore.model_forward_fused as fused
    from megatron.core import parallel_state as mpu
    from verl.models.mcore.model_forward_fused import FusedOutputProcessorContext, fused_output_processor

    fused.gather_from_sequence_parallel_region = _GatherSequence.apply  # a fresh process: nothing to restore
    mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        return {
            sp: _tp_errors(rank, world, sp, fused_output_processor, FusedOutputProcessorContext) for sp in (False, True)
        }
    finally:
        mpu.destroy_model_parallel()


def _tp_errors(rank, world, sequence_parallel, fused_output_processor, FusedOutputProcessorContext) -> list[float]:
    """Max errors of (log-probs, entropy, grad hidden, grad weight shard) against the logits path."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    hidden, weight, labels, weights = _case(S=38)  # the ranks' parts of the sequence are equal
    S, V = hidden.shape[0], weight.shape[0]
    rows = slice(rank * V // world, (rank + 1) * V // world)
    part = slice(rank * S // world, (rank + 1) * S // world)
    h = (hidden[part] if sequence_parallel else hidden).clone().requires_grad_()
    w = weight[rows].clone().requires_grad_()
    with nv.install():
        out = fused_output_processor(
            hidden_states=h,
            output_layer=SimpleNamespace(weight=w),
            output_weight=None,
            labels=labels,
            context=FusedOutputProcessorContext(temperature=0.8),
            config=SimpleNamespace(sequence_parallel=sequence_parallel),
        )
    ((out.log_probs * weights[0]).sum() + (out.entropy * weights[1]).sum()).backward()
    grad_h = h.grad.clone()
    if not sequence_parallel:  # verl's kernel leaves the sum over ranks to its caller, and so do we
        dist.all_reduce(grad_h, group=mpu.get_tensor_model_parallel_group())
    lp, ent, ref_h, ref_w = _reference(hidden, weight, labels, 0.8, weights)
    ref_h = ref_h[part] if sequence_parallel else ref_h
    return [
        float((a - b).abs().max())
        for a, b in zip((out.log_probs.detach(), out.entropy.detach(), grad_h, w.grad), (lp, ent, ref_h, ref_w[rows]))
    ]


@pytest.mark.slow
def test_verls_megatron_fused_output_processor_on_two_gloo_ranks_equals_the_logits_path():
    """TP 2, each rank a (V/2, H) shard of the output layer, labels global, with and without sequence
    parallelism (verl gathers the sequence itself): log-probs, entropy, the weight shard's gradient and
    the hidden gradient summed as verl's callers sum it, within 1e-5 of one process's logits path."""
    for rank, by_sp in enumerate(run_distributed(_tp_worker, 2)):
        for sequence_parallel, errors in by_sp.items():
            assert max(errors) <= TOL, (rank, sequence_parallel, errors)
