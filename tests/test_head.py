"""The chunked output head: equal to the logits path in values and gradients, bounded memory, and
real models (plain, biased, soft-capped, scaled, tied) served end to end or refused by name."""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from nopad import left_right_2_no_padding, no_padding_2_padding
from nopad.diagnostics import OpCounter
from nopad.engines import (
    chunked_head,
    packed_logprobs,
    padded_logprobs,
    prepare_model_inputs,
    prepare_model_outputs,
)
from nopad.modeling import head_log_probs, token_log_probs

# private: the head's kernel loaders and dispatch are replaced to test the choice
from nopad.modeling._logprobs import run_head
from tests.dist_utils import run_distributed
from tests.models import VOCAB, make_padded_batch, tiny_llama, tiny_qwen2

TOL = 1e-5


def _logits(hidden, weight, bias=None, scale=1.0, softcap=None):
    x = hidden @ weight.T + (0 if bias is None else bias)
    x = x * scale
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def _case(T, V, H, seed, *, bias=False, per_token=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=dtype) / H**0.5).requires_grad_()
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (T,), generator=g)
    labels[0], labels[-1] = 0, V - 1  # the vocabulary's two ends
    temperature = torch.rand(T, generator=g, dtype=torch.float32) + 0.5 if per_token else 0.7
    weights = torch.randn(2, T, generator=g, dtype=torch.float32)
    return hidden, weight, b, labels, temperature, weights


def _values_and_grads(fn, hidden, weight, bias, weights, with_entropy):
    """(log-probs, entropy, grads of hidden / weight / bias) of ``sum(w1 lp) + sum(w2 entropy)``."""
    lp, ent = fn()
    loss = (lp * weights[0].to(lp)).sum() + ((ent * weights[1].to(ent)).sum() if with_entropy else 0)
    params = [p for p in (hidden, weight, bias) if p is not None]
    grads = torch.autograd.grad(loss, params)
    return lp.detach(), None if ent is None else ent.detach(), grads


def _assert_close(ours, ref, tol=TOL):
    for a, b in zip(ours, ref):
        if a is None or b is None:
            assert a is None and b is None
        elif isinstance(a, tuple):
            _assert_close(a, b, tol)
        else:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert (a - b).abs().max() <= tol, (a - b).abs().max()


# ---- the head alone equals the logits path ------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    T=st.integers(1, 9),
    V=st.integers(2, 40),
    H=st.integers(1, 8),
    rows=st.integers(1, 10),
    cols=st.integers(1, 45),
    bias=st.booleans(),
    per_token=st.booleans(),
    entropy=st.booleans(),
    softcap=st.sampled_from([None, 1.5, 30.0]),
    scale=st.sampled_from([1.0, 0.25]),
    seed=st.integers(0, 2**16),
)
def test_head_equals_the_logits_path_in_values_and_gradients(
    T, V, H, rows, cols, bias, per_token, entropy, softcap, scale, seed
):
    """Any tile (tokens x vocabulary, dividing T and V or not), float or per-token temperature,
    bias, soft-capping and a scaled head: log-probs, entropy and every gradient within 1e-5."""
    hidden, weight, b, labels, temperature, weights = _case(T, V, H, seed, bias=bias, per_token=per_token)
    ours = _values_and_grads(
        lambda: run_head(
            hidden, weight, b, labels, temperature, entropy, scale=scale, softcap=softcap, tile=(rows, cols)
        ),
        hidden,
        weight,
        b,
        weights,
        entropy,
    )
    ref = _values_and_grads(
        lambda: token_log_probs(_logits(hidden, weight, b, scale, softcap), labels, temperature, entropy),
        hidden,
        weight,
        b,
        weights,
        entropy,
    )
    _assert_close(ours, ref)


@pytest.mark.parametrize(
    "T, chunk_size, single_label",
    [(1, None, 0), (1, 1, 300), (12, 4, None), (12, 5, None), (12, 12, None), (12, 100, None)],
)
@pytest.mark.parametrize("per_token", [False, True])
def test_head_log_probs_at_vocabulary_ends_any_chunk_size_and_single_token(T, chunk_size, single_label, per_token):
    hidden, weight, b, labels, temperature, weights = _case(
        T, 301, 16, T + (chunk_size or 0), bias=True, per_token=per_token
    )
    if single_label is not None:  # one token: its label at one end of the vocabulary, then the other
        labels[:] = single_label
    ours = _values_and_grads(
        lambda: head_log_probs(hidden, weight, labels, temperature, True, chunk_size, bias=b),
        hidden,
        weight,
        b,
        weights,
        True,
    )
    ref = _values_and_grads(
        lambda: token_log_probs(_logits(hidden, weight, b), labels, temperature, True), hidden, weight, b, weights, True
    )
    _assert_close(ours, ref)
    assert {int(labels[0]), int(labels[-1])} <= {0, 300}


def test_only_the_gradients_asked_for_are_computed_and_log_prob_alone_needs_no_entropy():
    hidden, weight, _, labels, temperature, weights = _case(6, 50, 8, 3)
    frozen = weight.detach()
    lp, ent = head_log_probs(hidden, frozen, labels, temperature)
    assert ent is None
    (grad,) = torch.autograd.grad((lp * weights[0]).sum(), hidden)
    lp_ref, _ = token_log_probs(hidden @ frozen.T, labels, temperature)
    (ref,) = torch.autograd.grad((lp_ref * weights[0]).sum(), hidden)
    assert (grad - ref).abs().max() <= TOL and (lp - lp_ref).abs().max() <= TOL
    # entropy computed but only the log-prob used (a None gradient for the entropy)
    lp, ent = head_log_probs(hidden, weight, labels, temperature, True)
    got = torch.autograd.grad(lp.sum(), (hidden, weight))
    lp_ref, _ = token_log_probs(hidden @ weight.T, labels, temperature, True)
    want = torch.autograd.grad(lp_ref.sum(), (hidden, weight))
    _assert_close(got, want)


def test_float64_inputs_keep_float64_and_match_tightly():
    hidden, weight, b, labels, temperature, weights = _case(7, 40, 6, 5, bias=True, dtype=torch.float64)
    ours = _values_and_grads(
        lambda: run_head(hidden, weight, b, labels, temperature, True, softcap=3.0, tile=(3, 7)),
        hidden,
        weight,
        b,
        weights,
        True,
    )
    ref = _values_and_grads(
        lambda: token_log_probs(_logits(hidden, weight, b, softcap=3.0), labels, temperature.double(), True),
        hidden,
        weight,
        b,
        weights,
        True,
    )
    assert ours[0].dtype == torch.float64
    _assert_close(ours, ref, tol=1e-12)


def test_bfloat16_inputs_round_the_logits_like_the_model_and_stay_close():
    hidden, weight, _, labels, temperature, weights = _case(16, 300, 32, 7, dtype=torch.bfloat16)
    lp, ent = run_head(hidden, weight, None, labels, temperature, True, tile=(5, 64))
    lp_ref, ent_ref = token_log_probs(hidden @ weight.T, labels, temperature, True)
    assert lp.dtype == ent.dtype == torch.float32
    assert (lp - lp_ref).abs().max() <= 2e-2 and (ent - ent_ref).abs().max() <= 2e-2
    (gh, gw) = torch.autograd.grad((lp * weights[0]).sum() + (ent * weights[1]).sum(), (hidden, weight))
    (rh, rw) = torch.autograd.grad((lp_ref * weights[0]).sum() + (ent_ref * weights[1]).sum(), (hidden, weight))
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert torch.allclose(gh.float(), rh.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(gw.float(), rw.float(), atol=2e-2, rtol=2e-2)


class _BigAllocations(TorchDispatchMode):
    """The largest new tensor (in elements) any op allocates (not an in-place result)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tokens_by_vocabulary_tensor_exists_forward_or_backward_and_no_host_sync():
    T, V, H = 96, 1024, 8
    hidden, weight, b, labels, temperature, weights = _case(T, V, H, 1, bias=True)
    with _BigAllocations() as big, OpCounter() as counter:
        lp, ent = run_head(hidden, weight, b, labels, temperature, True, tile=(16, 128))
        ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    assert big.largest == max(16 * 128, V * H)  # one tile buffer, or the weight's own gradient
    assert counter.syncs == 0


# ---- real models through packed_logprobs --------------------------------------------------------


def _tiny(family: str, seed: int, vocab: int, **config: object) -> torch.nn.Module:
    """A 2-layer ``<family>ForCausalLM`` built like the tiny models of tests/models.py, with ``config``."""
    import transformers

    from tests.models import _finish, _tiny_kwargs

    torch.manual_seed(seed)
    kwargs = {k: v for k, v in _tiny_kwargs(vocab).items() if k != "rms_norm_eps"} | config
    config_class, model_class = (getattr(transformers, f"{family}{kind}") for kind in ("Config", "ForCausalLM"))
    return _finish(model_class(config_class(**kwargs)), "sdpa")


def tiny_gemma2(seed: int = 0, vocab: int = VOCAB, softcap: float = 1.5) -> torch.nn.Module:
    """Gemma2 with final-logit soft-capping (tight, so it really bends the logits)."""
    model = _tiny(
        "Gemma2",
        seed,
        vocab,
        head_dim=8,
        final_logit_softcapping=softcap,
        attn_logit_softcapping=None,
        sliding_window=128,  # longer than any test row: every layer sees its whole sequence
        tie_word_embeddings=True,
    )
    with torch.no_grad():  # logits of a few units (random init gives ~0.1), so the cap really bends them
        model.lm_head.weight.mul_(30.0)
    return model


def tiny_cohere(seed: int = 0, vocab: int = VOCAB) -> torch.nn.Module:
    """Cohere: its forward multiplies the logits by ``logit_scale``."""
    return _tiny("Cohere", seed, vocab, logit_scale=0.5, tie_word_embeddings=True)


def tiny_granite(seed: int = 0, vocab: int = VOCAB) -> torch.nn.Module:
    """Granite: its forward divides the logits by ``logits_scaling``."""
    return _tiny("Granite", seed, vocab, logits_scaling=4.0)


def tiny_qwen2_biased(seed: int = 0) -> torch.nn.Module:
    """A tiny Qwen2 whose lm_head has a bias (a random one): the head must add it."""
    model = tiny_qwen2(seed)
    old = model.lm_head
    model.lm_head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(old.weight)
        model.lm_head.bias.normal_()
    return model


def tiny_llama_tied(seed: int = 0) -> torch.nn.Module:
    model = _tiny("Llama", seed, VOCAB, rms_norm_eps=1e-6, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


MODELS = {
    "llama": tiny_llama,
    "qwen2": tiny_qwen2,
    "gemma2": tiny_gemma2,
    "cohere": tiny_cohere,
    "granite": tiny_granite,
    "qwen2_biased": tiny_qwen2_biased,
    "llama_tied": tiny_llama_tied,
}


@functools.cache
def model(name: str) -> torch.nn.Module:
    return MODELS[name]()


def _packed(m, td, temperature, head, entropy=False, **kw):
    micro = left_right_2_no_padding(td)
    out = packed_logprobs(m, micro, temperature, calculate_entropy=True, head=head, **kw)
    return no_padding_2_padding(out["log_probs"], micro), out["entropy"].values(), micro


@pytest.mark.parametrize("name", list(MODELS))
def test_models_through_the_chunked_head_equal_the_padded_forward_and_the_logits_path(name):
    """log-probs against the padded forward (the model's own logits, soft-capping and scaling
    included), entropy and every parameter's gradient against the logits path."""
    m = model(name)
    td = make_padded_batch(4, 7, 6, seed=11, prompt_lens=[1, 7, 3, 5], resp_lens=[6, 1, 4, 6])
    temperature = torch.tensor([0.7, 1.0, 1.3, 2.0])
    results = {}
    for head in ("chunked", "logits"):
        m.zero_grad()
        lp, ent, micro = _packed(m, td, temperature, head)
        (lp.sum() + ent.sum()).backward()
        results[head] = (lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in m.named_parameters()})
    m.zero_grad()
    with torch.no_grad():
        padded = padded_logprobs(m, td, temperature)
    lp, ent, grads = results["chunked"]
    assert (lp - padded).abs().max() <= TOL
    assert (lp - results["logits"][0]).abs().max() <= TOL
    assert (ent - results["logits"][1]).abs().max() <= TOL
    for n, g in grads.items():  # relative for the large ones (Gemma2's scaled head gives gradients of ~10)
        assert torch.allclose(g, results["logits"][2][n], rtol=TOL, atol=TOL), n
    head = dict(m.named_parameters(remove_duplicate=False))
    name = next(n for n, p in head.items() if p is m.get_output_embeddings().weight)
    assert grads[name].abs().max() > 1e-3  # the head's weight (tied or not) really got its gradient


def test_the_softcap_and_the_scale_really_change_the_result():
    """The models above are not trivially equal: a head that ignored soft-capping or the scale would differ."""
    td = make_padded_batch(3, 6, 5, seed=3)
    micro = left_right_2_no_padding(td)
    for name in ("gemma2", "cohere", "granite"):
        m = model(name)
        with torch.no_grad():
            inputs, args = prepare_model_inputs(micro, temperature=1.0)
            hidden = m.model(**inputs).last_hidden_state[0]
            ignored, _ = head_log_probs(hidden, m.lm_head.weight, args.labels)
            served = prepare_model_outputs(m(**inputs), args)["log_probs"].values()
        assert (ignored[args.label_mask] - served[args.label_mask[: served.shape[0]]]).abs().max() > 1e-2, name


def test_tied_embedding_gets_one_gradient_from_the_embedding_and_the_head():
    m = model("llama_tied")
    td = make_padded_batch(3, 6, 5, seed=8)
    grads = {}
    for head in ("chunked", "logits"):
        m.zero_grad()
        lp, _, _ = _packed(m, td, 0.9, head)
        lp.sum().backward()
        grads[head] = m.model.embed_tokens.weight.grad.clone()
    m.zero_grad()
    assert (grads["chunked"] - grads["logits"]).abs().max() <= TOL
    # both uses reach it: the head alone would leave the rows of tokens never predicted untouched
    assert grads["chunked"].abs().max() > 1e-3


def test_head_auto_is_chunked_for_a_served_model_and_no_logits_are_made():
    m = model("llama")
    micro = left_right_2_no_padding(make_padded_batch(3, 6, 5, seed=1))
    inputs, args = prepare_model_inputs(micro)
    seen = []
    hook = m.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(tuple(out.shape)))
    try:
        with torch.no_grad(), chunked_head(m, args, "auto", calculate_entropy=True):
            out = m(**inputs)
    finally:
        hook.remove()
    L = args.labels.shape[0]
    assert out.log_probs.shape == out.entropy.shape == (1, L)
    assert seen == [(1, L, 3)]  # what the output layer handed on: log-prob, entropy, probe; not (1, L, V)
    ref = prepare_model_outputs(m(**inputs), args, calculate_entropy=True)
    got = prepare_model_outputs(out, args, calculate_entropy=True)
    for key in ("log_probs", "entropy"):
        assert (got[key].values() - ref[key].values()).abs().max() <= TOL


class _PostProcessed(torch.nn.Module):
    """A causal LM whose forward does something to the logits that no config says: nopad must notice."""

    def __init__(self, inner, post):
        super().__init__()
        self.inner, self.post = inner, post
        self.config = inner.config
        self.lm_head = inner.lm_head

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, **kwargs):
        hidden = self.inner.model(**kwargs).last_hidden_state
        return SimpleNamespace(logits=self.post(self.lm_head(hidden)))


@pytest.mark.parametrize(
    "post, reason",
    [
        (lambda x: x + 1.0, "changes its output layer's result"),
        (lambda x: x * 0.5, "changes its output layer's result"),
        (lambda x: 8.0 * torch.tanh(x / 8.0), "changes its output layer's result"),  # a softcap no config names
    ],
)
def test_an_unknown_change_to_the_logits_is_refused_by_chunked_and_avoided_by_auto(post, reason):
    m = _PostProcessed(tiny_llama(), post)
    td = make_padded_batch(3, 6, 5, seed=2)
    micro = left_right_2_no_padding(td)
    with pytest.raises(ValueError, match=f"head: expected a model the chunked head can serve.*{reason}"):
        packed_logprobs(m, micro, head="chunked")
    m = _PostProcessed(tiny_llama(), post)  # a fresh model: auto learns it on its first forward
    with torch.no_grad():
        auto = packed_logprobs(m, micro)
        logits = packed_logprobs(m, micro, head="logits")
        assert torch.equal(auto.values(), logits.values())
        # remembered: the next forward runs the logits path directly
        calls = []
        hook = m.lm_head.register_forward_hook(lambda mod, inp, out: calls.append(out.shape[-1]))
        packed_logprobs(m, micro)
        hook.remove()
        assert calls == [VOCAB]


def test_an_output_layer_that_is_not_a_plain_linear_is_refused_by_name():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    m = tiny_llama()
    old = m.lm_head
    m.lm_head = Scaled(old.in_features, old.out_features, bias=False)
    micro = left_right_2_no_padding(make_padded_batch(2, 4, 3, seed=0))
    with pytest.raises(ValueError, match="not a plain torch.nn.Linear"):
        packed_logprobs(m, micro, head="chunked")
    with torch.no_grad():
        assert torch.equal(packed_logprobs(m, micro).values(), packed_logprobs(m, micro, head="logits").values())


def test_bad_head_arguments_fail_loudly_naming_the_field():
    hidden, weight, b, labels, temperature, _ = _case(4, 10, 3, 0, bias=True)
    with pytest.raises(ValueError, match=r"weight: expected \(vocab, 3\)"):
        head_log_probs(hidden, weight.T, labels)
    with pytest.raises(ValueError, match=r"hidden: expected \(tokens, hidden\) matching labels \(3,\)"):
        head_log_probs(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match="labels: expected token ids"):
        head_log_probs(hidden, weight, labels.float())
    with pytest.raises(ValueError, match=r"bias: expected \(10,\)"):
        head_log_probs(hidden, weight, labels, bias=b[:5])
    with pytest.raises(ValueError, match="chunk_size: expected an int >= 1"):
        head_log_probs(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="softcap: expected"):
        head_log_probs(hidden, weight, labels, softcap=-1.0)
    with pytest.raises(ValueError, match="temperature row 1"):
        head_log_probs(hidden, weight, labels, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    micro = left_right_2_no_padding(make_padded_batch(2, 4, 3, seed=0))
    with pytest.raises(ValueError, match="head: expected one of"):
        packed_logprobs(model("llama"), micro, head="fused")
    _, args = prepare_model_inputs(micro)
    with pytest.raises(ValueError, match=r"entropy: expected per-token entropy"):
        prepare_model_outputs(
            SimpleNamespace(log_probs=torch.zeros(1, args.labels.shape[0])), args, calculate_entropy=True
        )
    with pytest.raises(ValueError, match=r"log_probs: expected \(1, "):
        prepare_model_outputs(SimpleNamespace(log_probs=torch.zeros(2)), args)


# ---- FSDP2 and Ulysses -----------------------------------------------------------------------


def _fsdp2_head_worker(rank, world_size, shard_head_alone, tied):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    m = tiny_llama_tied() if tied else tiny_llama()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in m.model.layers:
        fully_shard(layer, mesh=mesh)
    if shard_head_alone:
        fully_shard(m.lm_head, mesh=mesh)
    fully_shard(m, mesh=mesh)
    assert type(m.lm_head.weight).__name__ == "DTensor"  # sharded outside the forward
    td = make_padded_batch(3, 6, 5, seed=100 + rank)
    micro = left_right_2_no_padding(td)
    out = packed_logprobs(m, micro, 0.9, calculate_entropy=True, head="chunked")
    (no_padding_2_padding(out["log_probs"], micro).sum() + out["entropy"].values().sum()).backward()
    grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    return out["log_probs"].values().detach(), out["entropy"].values().detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("shard_head_alone, tied", [(False, False), (True, False), (False, True)])
def test_fsdp2_chunked_head_on_two_processes_equals_the_logits_path_on_one(shard_head_alone, tied):
    results = run_distributed(_fsdp2_head_worker, 2, shard_head_alone, tied)
    m = tiny_llama_tied() if tied else tiny_llama()
    expected = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
    for rank, (lp, ent, _) in enumerate(results):
        micro = left_right_2_no_padding(make_padded_batch(3, 6, 5, seed=100 + rank))
        m.zero_grad()
        out = packed_logprobs(m, micro, 0.9, calculate_entropy=True, head="logits")
        (no_padding_2_padding(out["log_probs"], micro).sum() + out["entropy"].values().sum()).backward()
        assert (lp - out["log_probs"].values()).abs().max() <= TOL
        assert (ent - out["entropy"].values()).abs().max() <= TOL
        for n, p in m.named_parameters():
            expected[n] += p.grad / len(results)  # FSDP averages gradients over its ranks
    for _, _, grads in results:
        assert set(grads) == set(expected)
        for n, g in grads.items():
            assert torch.allclose(g, expected[n], atol=TOL), n


def _ulysses_head_worker(rank, world_size):
    import torch.distributed as dist

    from nopad.parallel import enable_ulysses

    torch.set_num_threads(1)
    out = {}
    for name in ("llama", "gemma2"):
        m = enable_ulysses(MODELS[name]())
        micro = left_right_2_no_padding(make_padded_batch(3, 6, 5, seed=4))
        res = packed_logprobs(
            m, micro, torch.tensor([0.5, 1.0, 2.0]), calculate_entropy=True, head="chunked", sp_group=dist.group.WORLD
        )
        (no_padding_2_padding(res["log_probs"], micro).sum() + res["entropy"].values().sum()).backward()
        grads = {}
        for n, p in m.named_parameters():
            dist.all_reduce(p.grad)
            grads[n] = p.grad / world_size
        out[name] = (res["log_probs"].values().detach(), res["entropy"].values().detach(), grads)
    return out


@pytest.mark.slow
def test_ulysses_sp2_chunked_head_equals_one_process_logits_path():
    results = run_distributed(_ulysses_head_worker, 2)
    for name in ("llama", "gemma2"):
        m = MODELS[name]()
        micro = left_right_2_no_padding(make_padded_batch(3, 6, 5, seed=4))
        ref = packed_logprobs(m, micro, torch.tensor([0.5, 1.0, 2.0]), calculate_entropy=True, head="logits")
        (no_padding_2_padding(ref["log_probs"], micro).sum() + ref["entropy"].values().sum()).backward()
        assert micro["input_ids"].values().shape[0] % 2 == 1  # the row really needed a pad token
        for rank, result in enumerate(results):
            lp, ent, grads = result[name]
            assert (lp - ref["log_probs"].values()).abs().max() <= TOL, (name, rank)
            assert (ent - ref["entropy"].values()).abs().max() <= TOL, (name, rank)
            for n, p in m.named_parameters():
                assert torch.allclose(grads[n], p.grad, rtol=1e-4, atol=TOL), (name, n)


# ---- on a GPU --------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("per_token", [False, True])
def test_on_cuda_in_bf16_the_head_is_as_close_as_the_logits_path_and_never_waits_for_the_device(per_token):
    cpu = _case(1000, 32000, 256, 0, per_token=per_token)
    hidden, weight = (t.detach().cuda().requires_grad_() for t in cpu[:2])
    labels, weights = cpu[3].cuda(), cpu[5].cuda()
    temperature = cpu[4].cuda() if per_token else cpu[4]

    def run(fn, h, w):
        lp, ent = fn(h, w)
        grads = torch.autograd.grad((lp * weights[0]).sum() + (ent * weights[1]).sum(), (h, w))
        return (lp, ent, *grads)

    logits_path = lambda h, w: token_log_probs(h @ w.T, labels, temperature, True)  # noqa: E731
    exact = run(logits_path, hidden, weight)
    low = [t.detach().bfloat16().requires_grad_() for t in (hidden, weight)]
    bf16_logits = run(logits_path, *low)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any call that waits for the GPU raises
    try:
        bf16_head = run(lambda h, w: head_log_probs(h, w, labels, temperature, True), *low)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for ref, theirs, ours in zip(exact, bf16_logits, bf16_head):
        assert ours.dtype == theirs.dtype
        their_error = (theirs.float() - ref).abs().max()
        assert (ours.float() - ref).abs().max() <= 1.5 * their_error + 1e-3


def test_under_autocast_auto_takes_the_logits_path_for_that_call_only():
    m = tiny_llama()
    micro = left_right_2_no_padding(make_padded_batch(2, 4, 3, seed=0))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with pytest.raises(ValueError, match="mixes dtypes"):
                packed_logprobs(m, micro, head="chunked")
            auto = packed_logprobs(m, micro)
            assert torch.equal(auto.values(), packed_logprobs(m, micro, head="logits").values())
        inputs, args = prepare_model_inputs(micro)
        with chunked_head(m, args):  # not remembered: without autocast the head serves the model again
            assert hasattr(m(**inputs), "log_probs")


# ---- a fused kernel where it is installed: wired to the exact kernel, the tiles as reference -----


def _cut_cross_entropy_standin(calls, with_bias):
    """cut_cross_entropy.linear_cross_entropy's signature (PyPI 25.1.1, or its later one with a bias),
    computed the plain way (CPU, exact): a keyword the release lacks raises TypeError as it would."""

    def release(
        e, c, targets, ignore_index=-100, softcap=None, reduction="mean", shift=False, filter_eps="high", impl="cce"
    ):
        return later(e, c, targets, None, ignore_index, softcap, reduction, shift, filter_eps, impl=impl)

    def later(
        e, c, targets, bias=None, ignore_index=-100, softcap=None, reduction="mean", shift=0, filter_eps="auto",
        accum_e_fp32=False, accum_c_fp32=False, filter_e_grad=True, filter_c_grad=True, impl="cce",
        vocab_parallel_options=None,
    ):  # fmt: skip
        calls.append({"impl": impl, "reduction": reduction, "softcap": softcap, "bias": bias is not None})
        calls[-1]["filter_eps"] = filter_eps
        logits = e @ c.T + (0 if bias is None else bias)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return -logits.float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    return later if with_bias else release


def _install_standin(monkeypatch, with_bias):
    """The stand-in installed as cut_cross_entropy, and the CPU taken for CUDA: the calls it gets."""
    import nopad.modeling._logprobs as head

    calls: list[dict] = []
    monkeypatch.setitem(head._LOADERS, "cut_cross_entropy", lambda: _cut_cross_entropy_standin(calls, with_bias))
    monkeypatch.setattr(head, "_on_cuda", lambda device: True)
    _backward_in_float32(monkeypatch)
    _clear_kernel_caches()
    head._probe_failure("cut_cross_entropy", "cpu")  # the once-per-process probe, run and passed now
    calls.clear()
    return calls


def _backward_in_float32(monkeypatch):
    """The stand-ins are plain torch: their backward takes float32 too (the real kernel's, bf16 or fp16
    only: tests/test_kernels_triton.py)."""
    import nopad.modeling._logprobs as head

    monkeypatch.setitem(head.BACKWARD_DTYPES, "cut_cross_entropy", (torch.float32, torch.bfloat16, torch.float16))


def _clear_kernel_caches():
    import nopad.modeling._logprobs as head

    head._kernel_function.cache_clear()
    head._probe_failure.cache_clear()


@pytest.fixture
def fused(monkeypatch):
    yield _install_standin(monkeypatch, with_bias=True)
    _clear_kernel_caches()


@pytest.fixture
def fused_release(monkeypatch):
    yield _install_standin(monkeypatch, with_bias=False)
    _clear_kernel_caches()


@pytest.mark.parametrize(
    ("bias", "per_token", "softcap", "scale"),
    [(False, True, None, 1.0), (True, False, None, 0.5), (False, False, None, 2.0), (True, False, 3.0, 1.0)],
)
def test_auto_takes_the_fused_kernel_where_it_serves_and_equals_the_tiles(fused, bias, per_token, softcap, scale):
    hidden, weight, b, labels, temperature, weights = _case(7, 23, 5, 3, bias=bias, per_token=per_token)
    if softcap is not None:
        temperature = 1.0  # the kernel caps the logits itself: only an unscaled temperature folds in

    def run(kernel):
        return lambda: head_log_probs(
            hidden, weight, labels, temperature, bias=b, logit_scale=scale, softcap=softcap, kernel=kernel
        )

    ours = _values_and_grads(run("auto"), hidden, weight, b, weights, False)
    assert fused and fused[-1]["impl"] == "cce" and fused[-1]["reduction"] == "none"
    assert fused[-1]["filter_eps"] is None  # exact gradients: no block filtered out
    assert fused[-1]["softcap"] == softcap and fused[-1]["bias"] == bias
    _assert_close(ours, _values_and_grads(run("tiles"), hidden, weight, b, weights, False))


@pytest.mark.parametrize(
    ("with_entropy", "bias", "per_token", "softcap", "why"),
    [
        (True, False, False, None, "gives log-probs only, not the entropy"),
        (False, False, False, 3.0, "caps the logits before a temperature could divide them"),
        (False, True, True, None, "a per-token temperature cannot scale it"),
    ],
)
def test_calls_the_fused_kernel_cannot_serve_take_the_tiles_and_a_forced_kernel_says_why(
    fused, with_entropy, bias, per_token, softcap, why
):
    hidden, weight, b, labels, temperature, _ = _case(5, 11, 4, 1, bias=bias, per_token=per_token)
    args = (hidden, weight, labels, temperature, with_entropy)
    auto = head_log_probs(*args, bias=b, softcap=softcap)
    assert not fused  # the tiles ran
    tiles = head_log_probs(*args, bias=b, softcap=softcap, kernel="tiles")
    assert torch.equal(auto[0], tiles[0])
    with pytest.raises(ValueError, match=why):
        head_log_probs(*args, bias=b, softcap=softcap, kernel="cut_cross_entropy")


def test_without_the_fused_kernel_installed_auto_runs_the_tiles_and_forcing_it_says_so():
    hidden, weight, _, labels, temperature, _ = _case(4, 9, 3, 2)
    lp, _ = head_log_probs(hidden, weight, labels, temperature)  # on a CPU, never the fused kernel
    assert lp.shape == (4,)
    with pytest.raises(ValueError, match="kernel: expected a head kernel that serves this call"):
        head_log_probs(hidden, weight, labels, temperature, kernel="cut_cross_entropy")
    with pytest.raises(ValueError, match=r"kernel: expected one of \['auto', 'cut_cross_entropy', 'tiles'\]"):
        head_log_probs(hidden, weight, labels, temperature, kernel="liger")


def test_the_pypi_release_without_a_bias_serves_a_head_without_one_and_a_bias_takes_the_tiles(fused_release):
    hidden, weight, b, labels, temperature, weights = _case(6, 13, 4, 2, bias=True, per_token=True)

    def run(kernel, bias):
        return lambda: head_log_probs(hidden, weight, labels, temperature, bias=bias, kernel=kernel)

    ours = _values_and_grads(run("auto", None), hidden, weight, None, weights, False)
    assert len(fused_release) == 1 and fused_release[0]["filter_eps"] is None
    _assert_close(ours, _values_and_grads(run("tiles", None), hidden, weight, None, weights, False))
    head_log_probs(hidden, weight, labels, temperature, bias=b)
    assert len(fused_release) == 1  # the tiles ran
    with pytest.raises(ValueError, match=r"takes no bias \(its PyPI release 25.1.1 has none\)"):
        head_log_probs(hidden, weight, labels, temperature, bias=b, kernel="cut_cross_entropy")


def test_no_tokens_launch_no_fused_kernel_and_give_empty_results(fused):
    hidden, weight, _, labels, _, _ = _case(3, 9, 4, 5)
    lp, ent = head_log_probs(hidden[:0], weight, labels[:0], 0.7, kernel="cut_cross_entropy")
    assert lp.shape == (0,) and ent is None and not fused


def _broken(kind):
    """A cut_cross_entropy whose install fails at run time, or computes something else."""

    def linear_cross_entropy(e, c, targets, ignore_index=-100, softcap=None, reduction="mean", shift=False,
                             filter_eps="high", impl="cce"):  # fmt: skip
        if kind == "raises":
            raise RuntimeError("triton: unsupported target")
        logits = e @ c.T
        loss = -logits.float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return loss + 0.5 if kind == "values" else loss.detach() + 0 * e.sum(-1)  # "grads": no gradient to c

    return linear_cross_entropy


@pytest.mark.parametrize(
    ("kind", "why"),
    [("raises", r"RuntimeError: triton: unsupported target"), ("values", "differ"), ("grads", "differ")],
)
def test_an_install_that_fails_its_probe_is_never_used_and_says_why(monkeypatch, kind, why):
    import nopad.modeling._logprobs as head

    monkeypatch.setitem(head._LOADERS, "cut_cross_entropy", lambda: _broken(kind))
    monkeypatch.setattr(head, "_on_cuda", lambda device: True)
    _backward_in_float32(monkeypatch)
    _clear_kernel_caches()
    try:
        hidden, weight, _, labels, temperature, _ = _case(5, 11, 4, 3)
        with pytest.warns(RuntimeWarning, match=f"failed its probe here.*{why}.*the head runs the tiles"):
            lp, _ = head_log_probs(hidden, weight, labels, temperature)
        expected, _ = head_log_probs(hidden, weight, labels, temperature, kernel="tiles")
        assert torch.equal(lp, expected)
        with pytest.raises(ValueError, match=f"failed its probe here.*{why}"):
            head_log_probs(hidden, weight, labels, temperature, kernel="cut_cross_entropy")
    finally:
        _clear_kernel_caches()


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_the_probe_runs_when_the_first_call_comes_without_autograd(monkeypatch, context):
    import nopad.modeling._logprobs as head

    calls: list[dict] = []
    monkeypatch.setitem(head._LOADERS, "cut_cross_entropy", lambda: _cut_cross_entropy_standin(calls, False))
    monkeypatch.setattr(head, "_on_cuda", lambda device: True)
    _clear_kernel_caches()
    try:
        hidden, weight, _, labels, temperature, _ = _case(5, 11, 4, 3)
        with context(), warnings.catch_warnings():
            warnings.simplefilter("error")  # a failed probe would warn
            lp, _ = head_log_probs(hidden, weight, labels, temperature)
        assert len(calls) == 2  # the probe's call and this one
        assert torch.allclose(lp, head_log_probs(hidden, weight, labels, temperature, kernel="tiles")[0], atol=1e-5)
    finally:
        _clear_kernel_caches()
