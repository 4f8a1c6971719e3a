"""Packed forwards of the model families that carry state along the sequence, against each sequence alone.

Tiny random-weight models of every family nopad serves (gated delta nets, Mamba2 mixers, short
convs), a packed row that mixes a sequence of length 1, ones shorter than the conv kernel and than a
chunk, ones exactly a chunk long (64 for the delta rule, 32 for these Mamba2 mixers) and longer:
log-probs and the gradient of every parameter equal the per-sequence runs; the route is scoped to
the model and undone; what nopad cannot keep apart is refused, naming the module.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tensordict import TensorDict  # noqa: E402
from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_fn  # noqa: E402

from nopad import left_right_2_no_padding, no_padding_2_padding  # noqa: E402
from nopad.engines import (  # noqa: E402
    check_isolation,  # noqa: E402
    packed_logprobs,
    padded_logprobs,
    prepare_model_inputs,
    prepare_model_outputs,
)
from nopad.modeling import PackedRow, causal_conv1d, packed_attention, register_packed_module, use_packed_attention  # noqa: E402  # noqa: E402

# private: the route each module takes and the survey of a model
from nopad.modeling._routing import route, route_of, survey  # noqa: E402
from nopad.synthetic import tiny_causal_lm  # noqa: E402
from tests.models import make_padded_batch  # noqa: E402

VOCAB = 97
TOL = 1e-5
FAMILIES = ["qwen3_5", "qwen3_next", "olmo_hybrid", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "lfm2"]
MIXED = (70, 1, 3, 64, 9, 32, 2)


def _model(arch: str, **kwargs) -> torch.nn.Module:
    return tiny_causal_lm(arch, vocab=VOCAB, hidden=32, layers=4, **kwargs)


def _micro(lengths=MIXED, seed=0) -> dict:
    from nopad.core import IndexPlan

    plan = IndexPlan.from_lengths(torch.tensor(lengths))
    ids = torch.randint(1, VOCAB, (plan.total,), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": plan.to_nested(ids), "position_ids": plan.to_nested(plan.position_ids)}


def _alone(model, micro) -> torch.Tensor:
    """(T,) each sequence run alone: log-prob of its next token, 0 at its last token (nopad's convention)."""
    out = []
    for seq in micro["input_ids"].unbind():
        logits = model(input_ids=seq[None], position_ids=torch.arange(len(seq))[None], use_cache=False).logits[0]
        lp = logits.float().log_softmax(-1)[:-1].gather(-1, seq[1:, None])[:, 0]
        out.append(torch.cat([lp, lp.new_zeros(1)]))
    return torch.cat(out)


def _from_logits(logits, micro) -> torch.Tensor:
    ids = micro["input_ids"].values()
    lp = logits[0].float().log_softmax(-1).gather(-1, ids.roll(-1)[:, None])[:, 0]
    last = micro["input_ids"].offsets()[1:] - 1
    return lp.index_fill(0, last, 0.0)


def _weights(n: int) -> torch.Tensor:
    return torch.linspace(-1, 1, n)


def _param_grads(model, log_probs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (log_probs * _weights(log_probs.numel())).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(a, b, what, tol=TOL):
    diff, scale = (a.double() - b.double()).abs().max().item(), max(1.0, b.abs().max().item())
    assert diff <= tol * scale, f"{what}: max abs diff {diff:.3g} > {tol} x {scale:.3g}"


# ---- every family: exact, gradients of every parameter too ------------------------------------------


@pytest.mark.parametrize("head", ["logits", "auto"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_packed_logprobs_equal_each_sequence_alone_with_every_gradient(arch, head):
    model, micro = _model(arch), _micro()
    packed = packed_logprobs(model, micro, head=head).values()
    alone = _alone(model, micro)
    _assert_close(packed, alone, f"{arch} log-probs")
    grads_packed = _param_grads(model, packed)
    grads_alone = _param_grads(model, alone)
    assert grads_packed.keys() == grads_alone.keys() == {n for n, _ in model.named_parameters()} - _unused(model)
    for name, grad in grads_alone.items():
        _assert_close(grads_packed[name], grad, f"{arch} grad of {name}")
    assert route_of(model) is None  # packed_logprobs routed the model for its forward only


# the other families nopad serves (the sweep's tiny models), in training mode: transformers 5.10's
# mixers would take a fused training kernel on CUDA, which a packed forward does not take
OTHER_FAMILIES = ["qwen3_5_moe", "mamba2", "zamba2", "mamba", "falcon_mamba", "jamba", "zamba", "lfm2_moe"]


@pytest.mark.parametrize("model_type", OTHER_FAMILIES)
def test_every_other_family_is_exact_with_every_gradient_in_training_mode(model_type):
    from tests.archs import tiny_model

    model, micro = tiny_model(model_type), _micro()
    if isinstance(model, str):
        pytest.skip(f"{model_type} on transformers {transformers.__version__}: {model}")
    model.train()
    packed = packed_logprobs(model, micro, head="logits").values()
    alone = _alone(model, micro)
    _assert_close(packed, alone, f"{model_type} log-probs")
    grads_packed, grads_alone = _param_grads(model, packed), _param_grads(model, alone)
    assert grads_packed.keys() == grads_alone.keys()
    for name, grad in grads_alone.items():
        _assert_close(grads_packed[name], grad, f"{model_type} grad of {name}")


@pytest.mark.parametrize("model_type", FAMILIES + OTHER_FAMILIES + ["falcon_mamba"])
def test_under_checkpointing_every_family_is_exact_with_every_gradient_or_refused_by_name(model_type):
    """A checkpointed layer is recomputed in backward from its own arguments: a state layer that is not
    handed the boundaries there (transformers 5.10's falcon_h1 and mamba2 decoder layers hand their
    mixers none; Mamba's never) is refused by name, never recomputed as one sequence."""
    from tests.archs import tiny_model

    model, micro = tiny_model(model_type), _micro()
    if isinstance(model, str):
        pytest.skip(f"{model_type} on transformers {transformers.__version__}: {model}")
    alone = _param_grads(model, _alone(model, micro))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    use_packed_attention(model)
    try:
        packed = packed_logprobs(model, micro, head="logits").values()
    except ValueError as refusal:
        assert "boundaries (cu_seq_lens_q) among its kwargs when its layers are checkpointed" in str(refusal)
        assert f"of transformers {transformers.__version__} does not hand them to" in str(refusal)
        return
    for name, grad in _param_grads(model, packed).items():
        _assert_close(grad, alone[name], f"{model_type} checkpointed grad of {name}")


def _unused(model) -> set[str]:
    """Parameters no forward of this tiny model reaches (MoE experts no token was routed to)."""
    return {n for n, p in model.named_parameters() if "experts" in n or "gate" in n and p.grad is None} - {
        n for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_model_called_with_nopad_varlen_is_exact_and_the_probe_finds_it_isolated(arch):
    import nopad.modeling  # noqa: F401 - registers nopad_varlen

    model, micro = _model(arch, attn_implementation="nopad_varlen"), _micro()
    alone = _alone(model, micro)
    inputs, _ = prepare_model_inputs(micro, attn_implementation="nopad_varlen")
    try:
        unrouted = check_isolation(model)
        assert unrouted.leaked, f"{arch}: the unrouted model should leak: {unrouted}"
    except ValueError as refusal:  # transformers' own fallback refuses boundaries it cannot keep apart, or nopad
        assert "can't keep packed sequences apart" in str(refusal) or "use_packed_attention(model)" in str(refusal)
    use_packed_attention(model)
    report = check_isolation(model)
    assert not report.leaked, f"{arch}: {report}"
    with torch.no_grad():
        _assert_close(_from_logits(model(**inputs).logits, micro), alone, f"{arch} under nopad_varlen")


@pytest.mark.parametrize("arch", ["qwen3_5", "bamba", "lfm2"])
def test_restarting_position_ids_alone_give_the_boundaries(arch):
    model, micro = use_packed_attention(_model(arch)), _micro()
    ids = micro["input_ids"].values()[None]
    positions = micro["position_ids"].values()[None]
    with torch.no_grad():  # a padding-free collator's batch: no cu_seq_lens, no attention mask, use_cache default
        logits = model(input_ids=ids, position_ids=positions).logits
    _assert_close(_from_logits(logits, micro), _alone(model, micro), arch)


@pytest.mark.parametrize("arch", ["qwen3_5", "granitemoehybrid"])
def test_gradient_checkpointing_recomputes_each_layer_with_the_boundaries(arch):
    model, micro = _model(arch), _micro()
    alone_grads = _param_grads(model, _alone(model, micro))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing runs in training mode; these tiny models have no dropout
    # switched for one call only, the backward would recompute the layers unswitched: refused
    with pytest.raises(ValueError, match="a model switched once with use_packed_attention"):
        packed_logprobs(model, micro, head="logits")
    use_packed_attention(model)
    packed = packed_logprobs(model, micro, head="logits").values()
    for name, grad in _param_grads(model, packed).items():
        _assert_close(grad, alone_grads[name], f"{arch} checkpointed grad of {name}")


@pytest.mark.parametrize("model_type", ["qwen3_5", "olmo_hybrid", "bamba", "lfm2", "mamba"])
def test_generation_with_a_routed_model_is_unchanged_bit_for_bit(model_type):
    from tests.archs import tiny_model

    model = tiny_model(model_type)
    prompt = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    options = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():  # the cache's step kernels and the prefill as transformers runs them
        before = model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
        route(model)  # the layers' route alone: nopad_varlen itself refuses a KV cache
        after = model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
    assert route_of(model) is not None and torch.equal(before.sequences, after.sequences)
    assert all(torch.equal(a, b) for a, b in zip(before.scores, after.scores))


@pytest.mark.parametrize("arch", ["qwen3_5", "bamba"])
def test_a_padded_forward_of_a_routed_model_is_unchanged_bit_for_bit(arch):
    import nopad.modeling  # noqa: F401 - registers nopad_varlen

    # the attention is nopad_varlen on both sides: the route alone must change no bit of a padded
    # forward (its adapters hand a call that is not packed to transformers' own primitives)
    td = make_padded_batch(4, 10, 8, seed=3, vocab=VOCAB)
    model = _model(arch, attn_implementation="nopad_varlen")
    with torch.no_grad():
        before = padded_logprobs(model, td)
        use_packed_attention(model)
        assert route_of(model) is not None
        after = padded_logprobs(model, td)
    assert torch.equal(before, after)


@pytest.mark.parametrize("arch", ["qwen3_5", "bamba"])
def test_switching_a_padded_forward_to_nopad_varlen_keeps_it_to_rounding(arch):
    # sdpa over the (B, S, S) padded mask and nopad_varlen over the unpadded sequences sum in another
    # order: equal to rounding, not bit for bit (which bits differ depends on the CPU's kernels)
    td = make_padded_batch(4, 10, 8, seed=3, vocab=VOCAB)
    model = _model(arch)
    with torch.no_grad():
        before = padded_logprobs(model, td)
        use_packed_attention(model)
        after = padded_logprobs(model, td)
    _assert_close(after, before, f"{arch} padded, sdpa against nopad_varlen")


@pytest.mark.parametrize("arch", ["qwen3_5", "bamba"])
def test_a_padded_rl_batch_through_the_conversions_equals_the_padded_forward(arch):
    td = make_padded_batch(5, 12, 40, seed=7, vocab=VOCAB)
    model = _model(arch)
    micro = left_right_2_no_padding(td)
    with torch.no_grad():
        packed = no_padding_2_padding(packed_logprobs(model, micro), micro)
        padded = padded_logprobs(model, td)
    _assert_close(packed, padded, arch)


# ---- the route: one model, undone, and loud ----------------------------------------------------------


def test_the_route_is_scoped_to_one_model_and_undone_on_leaving_the_block():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    primitive = module.causal_conv1d_fn
    model, other = _model("qwen3_5"), _model("qwen3_5")
    layer = model.model.layers[0].linear_attn
    with packed_attention(model):
        assert "forward" in vars(layer) and route_of(model) is not None
        assert model.config._attn_implementation == "nopad_varlen"
        assert not any("forward" in vars(m) for m in other.modules())  # another model of the class: untouched
        assert module.causal_conv1d_fn is primitive  # transformers' module: untouched
    assert "forward" not in vars(layer) and route_of(model) is None
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert model.config._attn_implementation == "sdpa"


def test_use_packed_attention_is_idempotent_and_serves_every_state_layer():
    model = _model("qwen3_5")
    assert use_packed_attention(use_packed_attention(model)) is model
    found = route_of(model).survey
    assert [cls for _, cls in found.rebound] == ["Qwen3_5GatedDeltaNet"] * 3
    assert "Qwen3_5Attention" in {cls for _, cls in found.attention}
    assert not found.refused


def test_a_packed_forward_with_a_cache_is_refused():
    model, micro = use_packed_attention(_model("qwen3_5")), _micro()
    inputs, _ = prepare_model_inputs(micro, attn_implementation="nopad_varlen")
    with pytest.raises(ValueError, match=r"Qwen3_5ForCausalLM use_cache: expected False or None in a packed forward"):
        model(**{**inputs, "use_cache": True})


def _tiny(config_name: str, model_name: str, **fields) -> torch.nn.Module:
    import transformers

    config = getattr(transformers, config_name)(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, **fields)
    return getattr(transformers, model_name)(config).float().eval()


def test_a_state_layer_without_a_packed_form_is_refused_by_name_before_anything_runs():
    rwkv = _tiny("RwkvConfig", "RwkvForCausalLM", attention_hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError) as refusal:
        use_packed_attention(rwkv)
    message = str(refusal.value)
    assert "RwkvForCausalLM, whose RwkvSelfAttention (rwkv.blocks.0.attention) carries a state along" in message
    assert "time-mixing recurrence" in message and "register_packed_module" in message
    assert route_of(rwkv) is None and not any("forward" in vars(m) for m in rwkv.modules())  # nothing changed


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "jamba", "kimi_linear", "bailing_hybrid"])
def test_mamba_and_kimi_scans_run_one_row_per_sequence_inside_the_layer(model_type):
    from tests.archs import tiny_model

    model, micro = tiny_model(model_type), _micro()
    if isinstance(model, str):  # kimi_linear and bailing_hybrid come with transformers 5.20
        pytest.skip(f"{model_type} on transformers {transformers.__version__}: {model}")
    with torch.no_grad():
        _assert_close(packed_logprobs(model, micro, head="logits").values(), _alone(model, micro), model_type)


def test_an_attention_that_bypasses_the_attention_interface_is_refused_by_name():
    bloom = _tiny("BloomConfig", "BloomForCausalLM", n_head=4)
    with pytest.raises(ValueError, match=r"BloomAttention \(transformer.h.0.self_attention\) computes its attention"):
        packed_logprobs(bloom, _micro())


class TokenShift(torch.nn.Module):
    """A layer of one's own that mixes positions: each token plus the one before it (a causal conv of kernel 2)."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = torch.nn.Conv1d(width, width, 2, groups=width, padding=1, bias=False)

    def forward(self, hidden, **kwargs):
        return self.conv(hidden.transpose(1, 2))[..., : hidden.shape[1]].transpose(1, 2)


class ShiftLM(torch.nn.Module):
    """Embedding, a TokenShift, an output layer: a custom model with no attention at all."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.shift = TokenShift(8)
        self.head = torch.nn.Linear(8, VOCAB)
        self.config = type("Config", (), {"_attn_implementation": "sdpa", "vocab_size": VOCAB})()

    def forward(self, input_ids, position_ids=None, use_cache=None, **kwargs):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.head(self.shift(self.embed(input_ids), **kwargs)))


def packed_token_shift(module: TokenShift, row: PackedRow, hidden, **kwargs):
    weight = module.conv.weight[:, 0]  # (C, 2)
    return causal_conv1d(hidden[0].t(), weight, None, row).t()[None]


def test_a_layer_of_ones_own_is_refused_until_its_packed_form_is_registered(monkeypatch):
    import nopad.modeling._layers as layers

    monkeypatch.setattr(layers, "REGISTERED", {})
    model, micro = ShiftLM(), _micro()
    with pytest.raises(ValueError, match=r"Conv1d \(shift.conv\) \(kernel 2\) convolves along the sequence"):
        packed_logprobs(model, micro, head="logits")
    register_packed_module(TokenShift, packed_token_shift)
    assert [cls for _, cls in survey(model).registered] == ["TokenShift"]
    with torch.no_grad():
        _assert_close(packed_logprobs(model, micro, head="logits").values(), _alone(model, micro), "registered form")
    with pytest.raises(ValueError, match="packed_forward: expected a callable"):
        register_packed_module(TokenShift, "not a function")


class ConvWithoutKwargs(torch.nn.Module):
    """A layer that calls transformers' conv primitive but does not hand on the model's kwargs."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, 3))

    def forward(self, hidden, **kwargs):
        return causal_conv1d_fn(hidden.transpose(1, 2), self.weight, None).transpose(1, 2)


@pytest.mark.skipif(causal_conv1d_fn is None, reason="transformers before 5.20 wraps no conv primitive to call")
def test_a_layer_not_handed_the_boundaries_gets_the_forwards_row_but_not_under_checkpointing():
    model, micro = ShiftLM(), _micro()
    model.shift = ConvWithoutKwargs(8)
    assert [cls for _, cls in survey(model).rebound] == ["ConvWithoutKwargs"]  # it calls a served primitive
    with torch.no_grad():
        _assert_close(packed_logprobs(model, micro, head="logits").values(), _alone(model, micro), "from the forward")
    model.shift.gradient_checkpointing = True  # recomputed in backward, where the forward's row is gone
    use_packed_attention(model)
    with pytest.raises(
        ValueError,
        match=r"ConvWithoutKwargs: expected the packed row's boundaries \(cu_seq_lens_q\) "
        r"among its kwargs when its layers are checkpointed",
    ):
        packed_logprobs(model, micro, head="logits")


def test_a_batch_that_is_not_packed_runs_the_layers_as_transformers_wrote_them():
    model = use_packed_attention(_model("bamba"))
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # two plain rows: positions 0.. in each, no boundaries to keep
        routed = model(input_ids=ids, use_cache=False).logits
    plain = _model("bamba")
    with torch.no_grad():  # the same but for the attention kernel's summation order
        _assert_close(routed, plain(input_ids=ids, use_cache=False).logits, "two plain rows", tol=1e-6)


def test_the_conversions_feed_a_routed_model_from_a_tensordict_too():
    td = make_padded_batch(3, 6, 9, seed=2, vocab=VOCAB)
    model = use_packed_attention(_model("nemotron_h"))
    micro = left_right_2_no_padding(td)
    inputs, args = prepare_model_inputs(micro, attn_implementation=model.config._attn_implementation)
    with torch.no_grad():
        out = prepare_model_outputs(model(**inputs), args)
    assert isinstance(micro, TensorDict) and out["log_probs"].is_nested


def test_a_model_loaded_with_nopad_varlen_but_never_routed_is_refused_at_its_first_packed_forward():
    import nopad.modeling  # noqa: F401 - registers nopad_varlen

    model, micro = _model("bamba", attn_implementation="nopad_varlen"), _micro()
    inputs, _ = prepare_model_inputs(micro, attn_implementation="nopad_varlen")
    with pytest.raises(ValueError, match=r"bamba model: expected a model given to nopad.modeling.use_packed_atte"):
        model(**inputs)
    use_packed_attention(model)
    with torch.no_grad():
        _assert_close(_from_logits(model(**inputs).logits, micro), _alone(model, micro), "once routed")


@pytest.mark.parametrize(
    ("arch", "where"),
    [
        ("qwen3_5", "model.layers.0.linear_attn (Qwen3_5GatedDeltaNet)"),
        ("bamba", "model.layers.0.mamba (BambaMixer)"),
        ("lfm2", "model.layers.0.conv (Lfm2ShortConv)"),
    ],
)
def test_the_leak_probe_names_the_first_module_that_lets_one_sequence_see_another(arch, where):
    model = _model(arch)
    report = check_isolation(model)  # as transformers runs it
    assert report.leaked and report.leaking_module == where, str(report)
    assert str(report).endswith(f"first in {where}")
    use_packed_attention(model)
    assert check_isolation(model).leaking_module is None


def test_the_leak_probe_names_the_attention_when_use_cache_is_left_on():
    from tests.models import tiny_llama

    report = check_isolation(tiny_llama(), use_cache=None)
    assert report.leaked and report.leaking_module == "model.layers.0.self_attn (LlamaAttention)"
