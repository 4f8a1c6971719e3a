"""A window dropped inside each sequence: found by the leak probe, served by nopad_varlen where the
layer's type names it.

A packed row has no attention mask. A model that applies its sliding window only through that mask
(its attention call passes no ``sliding_window=``) loses the window inside every sequence of a
packed row, while no other sequence moves: the probe's leak test cannot see it, its comparison with
each sequence run alone does. PhiMoE (one window for every layer, in the mask only) and Qwen2-MoE
(the window of its "sliding_attention" layers, in the mask only) are such models in transformers
5.25; an attention function that drops the window it is handed stands for any of them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from nopad.engines import packed_logprobs  # noqa: E402

# private: the probe's batches and the attention function transformers calls
from nopad.engines._leak import PROBE_LENGTHS, check_isolation, probe_batch, probe_lengths  # noqa: E402
from nopad.modeling import _attention as _attention  # noqa: E402
from nopad.modeling._attention import IMPLEMENTATION, nopad_varlen_attention, register, use_packed_attention  # noqa: E402
from tests.models import VOCAB  # noqa: E402

WINDOW = 4  # bites inside the probe's 5- and 6-token sequences and its window + 3 one
_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _finish(model: torch.nn.Module, implementation: str = "sdpa") -> torch.nn.Module:
    model.config._attn_implementation = implementation
    return model.float().eval()


def mistral(window: int | None = WINDOW) -> torch.nn.Module:
    """Every layer slides, and its attention call hands the window on (served as it is)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return _finish(MistralForCausalLM(MistralConfig(**_TINY, sliding_window=window)))


def phimoe() -> torch.nn.Module:
    """Every layer slides, through the mask only (PhimoeAttention passes no sliding_window)."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    torch.manual_seed(0)
    return _finish(
        PhimoeForCausalLM(PhimoeConfig(**_TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW))
    )


def qwen2_moe() -> torch.nn.Module:
    """Layer 0 slides ("sliding_attention" in layer_types), through the mask only; layer 1 is full."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        **_TINY,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=2,
    )
    assert config.layer_types == ["sliding_attention", "full_attention"]
    return _finish(Qwen2MoeForCausalLM(config))


# an attention function that drops the window it is handed: what a model that keeps its window in the
# mask does to nopad_varlen, whatever the architecture
WINDOWLESS = IMPLEMENTATION + "_windowless_test"


def _windowless(module, query, key, value, attention_mask, sliding_window=None, **kwargs):
    return nopad_varlen_attention(module, query, key, value, attention_mask, **kwargs)


@pytest.fixture(scope="module")
def windowless() -> str:
    from transformers import masking_utils, modeling_utils

    register()
    modeling_utils.AttentionInterface.register(WINDOWLESS, _windowless)
    masking_utils.AttentionMaskInterface.register(
        WINDOWLESS, masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    )
    return WINDOWLESS


def _alone(model: torch.nn.Module, micro: dict) -> torch.Tensor:
    """Each sequence of ``micro`` run alone (sdpa, its own mask) -> (T, V) logits in packed order."""
    ids, positions = micro["input_ids"].values(), micro["position_ids"].values()
    offsets = micro["input_ids"].offsets().tolist()
    with torch.no_grad():
        return torch.cat(
            [
                model(input_ids=ids[a:b][None], position_ids=positions[a:b][None], use_cache=False).logits[0]
                for a, b in zip(offsets[:-1], offsets[1:])
            ]
        )


# ---- the probe ------------------------------------------------------------------------------------


def test_the_default_probe_has_a_sequence_longer_than_the_models_window():
    assert probe_lengths(mistral(None).config) == PROBE_LENGTHS == (5, 3, 6)
    assert probe_lengths(mistral().config) == (5, 3, 6, WINDOW + 3)
    assert probe_lengths(mistral(window=300).config) == PROBE_LENGTHS  # past its 256 positions: cannot bite


def test_a_window_dropped_inside_each_sequence_is_found_though_nothing_leaks(windowless):
    model = mistral()
    model.config._attn_implementation = windowless
    report = check_isolation(model)
    assert not report.leaked and report.max_change == 0.0  # the leak test alone sees nothing
    assert report, str(report)  # truthy: something is wrong
    lengths = probe_lengths(model.config)
    assert report.differs_alone == [i for i, n in enumerate(lengths) if n > WINDOW], str(report)
    assert report.max_alone_diff > 1e-2
    assert report.differing_module == "model.layers.0.self_attn (MistralAttention)"
    assert str(report).startswith("DIFFERS FROM ALONE: the packed logits of sequences [0, 2, 3]")
    assert model.config._attn_implementation == windowless  # the reference runs switched it back


def test_a_window_the_call_hands_on_is_clean():
    for model in (mistral(), use_packed_attention(mistral())):
        report = check_isolation(model)
        assert not report and report.differs_alone == [] and report.max_alone_diff < 1e-4, str(report)
        assert str(report) == "isolated: changing sequence 0 moved no other logit by > 1e-05 (max change 0)"


def test_phimoe_loaded_with_nopad_varlen_drops_its_window_and_the_probe_names_its_attention():
    model = phimoe()
    register()
    model.config._attn_implementation = IMPLEMENTATION  # loaded so, never given to use_packed_attention
    report = check_isolation(model)
    assert report and not report.leaked and report.differs_alone == [0, 2, 3], str(report)
    assert report.max_alone_diff > 1e-2
    assert report.differing_module == "model.layers.0.self_attn (PhimoeAttention)"


def test_qwen2_moe_without_nopads_layer_type_window_drops_it_and_the_probe_names_its_attention(monkeypatch):
    monkeypatch.setattr(_attention, "mask_window", lambda module: None)  # nopad_varlen before the fix
    report = check_isolation(use_packed_attention(qwen2_moe()))
    assert report and not report.leaked and report.differs_alone == [0, 2, 3], str(report)
    assert report.differing_module == "model.layers.0.self_attn (Qwen2MoeAttention)"


def test_the_comparison_alone_is_skipped_on_request_and_leaks_keep_their_message(windowless):
    model = mistral()
    model.config._attn_implementation = windowless
    report = check_isolation(model, alone=False)
    assert not report and report.differs_alone == [] and report.max_alone_diff is None
    # a sequence another one leaked into differs alone too: the message is the leak's
    leaky = check_isolation(mistral(), probe_batch(VOCAB), use_cache=None)
    assert leaky.leaked and leaky.differs_alone == leaky.moved_sequences == [1, 2]
    assert str(leaky).startswith("LEAK: changing sequence 0 moved the logits of sequences [1, 2]")


def test_the_alone_tolerance_is_never_below_atol_and_follows_the_dtype(windowless):
    model = mistral()
    assert check_isolation(model, alone_atol=0.0).alone_atol == 1e-5
    assert check_isolation(model).alone_atol == 1e-4
    model.config._attn_implementation = windowless
    assert not check_isolation(model, alone_atol=1e3)  # a tolerance past the window's effect: nothing found
    half = check_isolation(use_packed_attention(mistral().to(torch.bfloat16)), atol=1e-2)
    assert half.alone_atol == 0.25 and not half, str(half)  # packed and alone take different kernels


# ---- nopad_varlen serves a "sliding_attention" layer's window ---------------------------------------


def test_qwen2_moe_packed_through_nopad_varlen_equals_each_sequence_alone():
    model = qwen2_moe()
    micro = probe_batch(VOCAB, (9, 1, 12, 5))
    alone = torch.log_softmax(_alone(model, micro), -1)
    with torch.no_grad():
        packed = packed_logprobs(model, micro, attention="sdpa", head="logits").values()
    ids, offsets = micro["input_ids"].values(), micro["input_ids"].offsets().tolist()
    expected = torch.zeros_like(packed)
    for a, b in zip(offsets[:-1], offsets[1:]):
        expected[a : b - 1] = alone[a : b - 1].gather(-1, ids[a + 1 : b, None]).squeeze(-1)
    assert torch.allclose(packed, expected, rtol=0, atol=1e-5), (packed - expected).abs().max()
    assert not check_isolation(use_packed_attention(qwen2_moe()))


def test_nopad_varlen_on_a_padded_batch_keeps_the_layer_type_window_too():
    model = qwen2_moe()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        use_packed_attention(model)
        ours = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    real = mask.bool()
    assert torch.allclose(ours[real], reference[real], rtol=0, atol=1e-5), (ours[real] - reference[real]).abs().max()


def test_a_window_applied_only_through_the_mask_is_refused_by_name_before_any_forward():
    """The guard names PhiMoE's attention, whose window only the mask carries; a window past every
    position the model takes changes nothing, and is served."""
    with pytest.raises(
        ValueError,
        match=r"PhimoeAttention \(model.layers.0.self_attn\) applies the model's 4-token "
        r"sliding window only through the attention mask",
    ):
        use_packed_attention(phimoe())
    from transformers import PhimoeConfig, PhimoeForCausalLM

    long = PhimoeForCausalLM(PhimoeConfig(**_TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=256))
    use_packed_attention(long)
