"""``packed_logprobs(..., share_prefixes=True)``: a GRPO batch (each prompt sampled n times, left-padded
prompts, right-padded responses) scored with each group's prompt computed once gives what the plain
packed call and the padded reference give, log-probs, entropy and every parameter's gradient, in the
same nested frame; what it cannot serve is refused by name before any forward."""

from __future__ import annotations

import functools

import pytest
import torch
from tensordict import TensorDict

from nopad import left_right_2_no_padding, no_padding_2_padding
from nopad.batches import select_rows
from nopad.diagnostics import OpCounter
from nopad.engines import packed_logprobs, padded_logprobs
from tests.models import VOCAB, tiny_llama
from tests.test_head import _tiny, tiny_cohere, tiny_qwen2_biased
from tests.test_shared_prefixes import hybrid

TOL = 1e-5


def grpo_batch(prompt_lens: list[int], n: int, resp_lens: list[int], *, vocab: int = VOCAB, seed: int = 0):
    """A padded batch of len(prompt_lens) * n rows: prompt p's n samples are rows p*n .. p*n + n - 1,
    each with the same prompt tokens, response i of length ``resp_lens[i]``."""
    g = torch.Generator().manual_seed(seed)
    rows = len(prompt_lens) * n
    assert len(resp_lens) == rows
    width_p, width_r = max(prompt_lens), max(max(resp_lens), 1)
    prompts = [torch.randint(1, vocab, (p,), generator=g) for p in prompt_lens]
    input_ids = torch.zeros(rows, width_p + width_r, dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(rows, width_r, dtype=torch.int64)
    for row in range(rows):
        prompt, r = prompts[row // n], resp_lens[row]
        input_ids[row, width_p - len(prompt) : width_p] = prompt
        input_ids[row, width_p : width_p + r] = torch.randint(1, vocab, (r,), generator=g)
        attention_mask[row, width_p - len(prompt) : width_p + r] = 1
        response_mask[row, :r] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    fields = dict(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, position_ids=position_ids
    )
    return TensorDict(fields, batch_size=[rows])


def scored(model, micro, temperature, **kw):
    """Padded (B, R) log-probs and entropy, and every parameter's gradient of a weighted sum of both."""
    model.zero_grad()
    out = packed_logprobs(model, micro, temperature, calculate_entropy=True, tokens="response", **kw)
    lp, ent = no_padding_2_padding(out["log_probs"], micro), no_padding_2_padding(out["entropy"], micro)
    w = torch.randn(2, *lp.shape, generator=torch.Generator().manual_seed(1))
    ((lp * w[0]).sum() + (ent * w[1]).sum()).backward()
    return out, lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def tiny_gemma2_windowed():
    """Gemma 2 with a 4-token sliding window in every other layer (shorter than the rows) and
    final-logit soft-capping."""
    return _tiny(
        "Gemma2", 0, VOCAB, head_dim=8, final_logit_softcapping=1.5, attn_logit_softcapping=None, sliding_window=4
    )


MODELS = {"llama": tiny_llama, "gemma2 window 4": tiny_gemma2_windowed, "qwen2 head bias": tiny_qwen2_biased}
MODELS["cohere logit scale"] = tiny_cohere
# hybrids: each response continues from its prompt's final state (gated delta rule, Mamba2 scan, short conv)
MODELS |= {family: functools.partial(hybrid, family) for family in ("qwen3_5_text", "bamba", "lfm2")}
THREE_GROUPS = ([5, 1, 9], 4, [3, 7, 1, 4, 2, 2, 6, 1, 5, 3, 8, 2])  # a 1-token prompt; three groups of 4


@pytest.mark.parametrize(
    ("name", "prompt_lens", "n", "resp_lens"),
    [
        *[(name, *THREE_GROUPS) for name in MODELS],
        ("llama", [6], 16, [1 + (7 * i) % 9 for i in range(16)]),  # a group of 16
        ("llama", [4, 4], 1, [3, 5]),  # no prompt shared: the plain packed layout
    ],
    ids=[*(f"{name}, three groups of 4" for name in MODELS), "one group of 16", "no group"],
)
def test_shared_prefixes_equal_the_plain_packed_call_and_the_padded_reference(name, prompt_lens, n, resp_lens):
    """Log-probs and entropy within 1e-5; every parameter's gradient within 1e-5 of the plain call's,
    relative to max(1, its largest entry) as tests/test_packed_models.py measures it."""
    model = MODELS[name]()
    padded = grpo_batch(prompt_lens, n, resp_lens, vocab=model.config.vocab_size)
    micro = left_right_2_no_padding(padded)
    temperature = torch.linspace(0.5, 1.5, len(resp_lens))
    ours, lp, ent, grads = scored(model, micro, temperature, share_prefixes=True)
    _, ref_lp, ref_ent, ref_grads = scored(model, micro, temperature)
    assert ours["log_probs"].offsets() is micro["input_ids"].offsets()
    assert (lp - ref_lp).abs().max() <= TOL and (ent - ref_ent).abs().max() <= TOL
    with torch.no_grad():
        reference = padded_logprobs(model, padded, temperature)
    assert (lp - reference).abs().max() <= TOL
    for param, grad in ref_grads.items():
        assert (grads[param] - grad).abs().max() <= TOL * max(1.0, grad.abs().max().item()), param
    # nowhere but the response positions: the same zeros the plain call leaves
    plain = packed_logprobs(model, micro, temperature, tokens="response").detach()
    shared = packed_logprobs(model, micro, temperature, tokens="response", share_prefixes=True).detach()
    assert torch.equal(shared.values() == 0, plain.values() == 0)


def test_a_group_split_across_micro_batches_is_exact_in_each():
    """Rows of one group in two micro-batches (picked out of order, as a balancer would): each
    micro-batch shares what it holds, and every row's log-probs equal the padded reference's."""
    model = tiny_llama(0)
    padded = grpo_batch([5, 3], 4, [3, 1, 4, 2, 5, 2, 1, 3])
    reference = padded_logprobs(model, padded).detach()
    micro = left_right_2_no_padding(padded)
    for rows in ([6, 0, 1, 5], [2, 7, 4, 3]):
        part = select_rows(micro, rows)
        with torch.no_grad():
            ours = no_padding_2_padding(packed_logprobs(model, part, tokens="response", share_prefixes=True), part)
        assert (ours - reference[rows]).abs().max() <= TOL, rows


def test_the_model_is_left_as_it_was():
    model = tiny_llama(0)
    micro = left_right_2_no_padding(grpo_batch([3], 2, [2, 4]))
    before = model.config._attn_implementation
    with torch.no_grad():
        packed_logprobs(model, micro, tokens="response", share_prefixes=True)
    assert model.config._attn_implementation == before
    assert model.lm_head.__dict__.get("forward") is None


def test_an_empty_response_scores_nothing_and_its_siblings_are_unchanged():
    model = tiny_llama(0)
    padded = grpo_batch([4], 3, [0, 3, 2])
    micro = left_right_2_no_padding(padded)
    with torch.no_grad():
        ours = no_padding_2_padding(packed_logprobs(model, micro, tokens="response", share_prefixes=True), micro)
        reference = padded_logprobs(model, padded)
    assert (ours - reference).abs().max() <= TOL
    assert torch.equal(ours[0], torch.zeros_like(ours[0]))


def test_the_op_count_and_the_host_syncs_do_not_grow_with_the_groups():
    """2 groups or 16, the same ops and syncs (the plan's one, the conversion's own): no loop over
    groups or rows."""
    model = tiny_llama(0)
    counts = []
    for groups in (2, 16):
        micro = left_right_2_no_padding(grpo_batch([3] * groups, 4, [2] * (4 * groups), seed=groups))
        with torch.no_grad(), OpCounter() as ops:
            packed_logprobs(model, micro, tokens="response", share_prefixes=True)
        counts.append((ops.ops, ops.syncs))
    assert counts[0] == counts[1], counts


def test_position_ids_that_do_not_count_from_zero_give_nan_not_other_values():
    model = tiny_llama(0)
    micro = left_right_2_no_padding(grpo_batch([3], 2, [2, 2]))
    position_ids = micro["position_ids"]
    shifted = torch.nested.nested_tensor_from_jagged(position_ids.values() + 1, position_ids.offsets())
    micro["position_ids"] = shifted
    with torch.no_grad():
        out = packed_logprobs(model, micro, tokens="response", share_prefixes=True)
    assert out.values().isnan().all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tokens="all"), r"tokens: expected 'response' with share_prefixes"),
        (dict(tokens="response", head="logits"), r"head: expected 'auto' or 'chunked' with share_prefixes"),
        (dict(tokens="response", attention="sdpa"), r"attention: expected 'auto' with share_prefixes"),
        (dict(tokens="response", pad_to_multiple=8), r"input_kwargs: expected none with share_prefixes"),
        (dict(tokens="response", share_prefixes="yes"), r"share_prefixes"),
    ],
)
def test_what_share_prefixes_does_not_take_is_refused_by_name(kwargs, match):
    model = tiny_llama(0)
    micro = left_right_2_no_padding(grpo_batch([3], 2, [2, 2]))
    with pytest.raises(ValueError, match=match):
        packed_logprobs(model, micro, share_prefixes=kwargs.pop("share_prefixes", True), **kwargs)


def test_a_state_layer_without_a_shared_prefix_form_is_refused_before_any_forward():
    from nopad._apps.families import tiny_model

    model = tiny_model("mamba")  # Mamba's selective scan: no form that takes a prompt's final state
    if isinstance(model, str):
        pytest.skip(model)
    micro = left_right_2_no_padding(grpo_batch([3], 2, [2, 2], vocab=model.config.vocab_size))
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=r"MambaMixer"):
        packed_logprobs(model, micro, tokens="response", share_prefixes=True)
    assert calls == []


def test_synthetic_batches_in_groups_repeat_each_groups_prompt_and_only_it():
    """``synthetic_batch(samples_per_prompt=n)``: n consecutive rows share their first row's prompt
    (tokens and length); the responses are drawn as without groups; a B that n does not divide is
    refused by name."""
    from nopad.synthetic import synthetic_batch

    alone, grouped = synthetic_batch(8, 12, 10, seed=3), synthetic_batch(8, 12, 10, seed=3, samples_per_prompt=4)
    for key in ("input_ids", "attention_mask"):
        prompts = grouped[key][:, :12]
        assert torch.equal(prompts, alone[key][[0, 0, 0, 0, 4, 4, 4, 4], :12]), key
        assert torch.equal(grouped[key][:, 12:], alone[key][:, 12:]), key
    assert torch.equal(grouped["position_ids"], (grouped["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    with pytest.raises(ValueError, match=r"samples_per_prompt: expected a divisor of B = 6"):
        synthetic_batch(6, 4, 4, samples_per_prompt=4)
