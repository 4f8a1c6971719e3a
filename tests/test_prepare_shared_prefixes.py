"""``prepare_model_inputs(..., share_prefixes=True)`` + the caller's own forward inside
``chunked_head`` (which switches the attention to ``nopad_shared`` for the block) +
``prepare_model_outputs``: the two-call API of engines that run the model themselves gives what
``packed_logprobs(..., share_prefixes=True)`` and the plain two calls give at the response positions
(log-probs, entropy, every parameter's gradient), from logits or from the chunked head; what the
shared layout cannot serve is refused by name."""

from __future__ import annotations

import contextlib
import functools
import re

import pytest
import torch

from nopad import left_right_2_no_padding, no_padding_2_padding
from nopad.batches import select_rows
from nopad.diagnostics import OpCounter
from nopad.engines import (
    chunked_head,
    packed_logprobs,
    prepare_model_inputs,
    prepare_model_outputs,
    prepare_value_outputs,
)
from nopad.modeling import packed_attention
from tests.models import tiny_llama
from tests.test_shared_prefix_logprobs import grpo_batch
from tests.test_shared_prefixes import hybrid

TOL = 1e-5


def mixed_groups(vocab: int | None = None):
    """Groups of 1, 2, ..., 8 rows (8 prompts sampled 8 times, the first g + 1 samples of prompt g kept),
    in shuffled order: a micro-batch as a balancer hands it over."""
    lens = [1 + (5 * i) % 9 for i in range(64)]
    padded = grpo_batch([4, 1, 7, 3, 9, 2, 5, 6], 8, lens, **({} if vocab is None else {"vocab": vocab}))
    rows = [8 * g + i for g in range(8) for i in range(g + 1)]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(3)).tolist()
    return select_rows(left_right_2_no_padding(padded), [rows[i] for i in order])


def two_calls(model, micro, temperature, *, share: bool, head: str = "logits", entropy: bool = True):
    """The engine's side: prepare, run the model its own way, read the outputs back."""
    inputs, args = prepare_model_inputs(micro, temperature=temperature, share_prefixes=share)
    switched = contextlib.nullcontext() if share else packed_attention(model)  # chunked_head switches a shared row's
    with switched, chunked_head(model, args, head, calculate_entropy=entropy, tokens="response") as served:
        output = served(**inputs)
    return prepare_model_outputs(output, args, calculate_entropy=entropy, tokens="response")


def padded_and_grads(model, micro, compute):
    """Padded (B, R) log-probs and entropy of ``compute()``, and every parameter's gradient of a
    weighted sum of both."""
    model.zero_grad()
    out = compute()
    lp, ent = no_padding_2_padding(out["log_probs"], micro), no_padding_2_padding(out["entropy"], micro)
    w = torch.randn(2, *lp.shape, generator=torch.Generator().manual_seed(1))
    ((lp * w[0]).sum() + (ent * w[1]).sum()).backward()
    return out, lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("head", ["logits", "chunked"])
@pytest.mark.parametrize("temperature", [None, 0.7, "per row"])
def test_the_two_calls_over_shared_prefixes_equal_packed_logprobs_and_the_plain_two_calls(head, temperature):
    model = tiny_llama(0)
    micro = mixed_groups()
    if temperature == "per row":
        temperature = torch.linspace(0.5, 1.5, micro.batch_size[0])
    ours, lp, ent, grads = padded_and_grads(
        model, micro, lambda: two_calls(model, micro, temperature, share=True, head=head)
    )
    one_call = functools.partial(
        packed_logprobs, model, micro, temperature, calculate_entropy=True, tokens="response", share_prefixes=True
    )
    _, call_lp, call_ent, call_grads = padded_and_grads(model, micro, one_call)
    plain, plain_lp, plain_ent, plain_grads = padded_and_grads(
        model, micro, lambda: two_calls(model, micro, temperature, share=False)
    )
    assert ours["log_probs"].offsets() is micro["input_ids"].offsets()
    for want_lp, want_ent, want_grads in ((call_lp, call_ent, call_grads), (plain_lp, plain_ent, plain_grads)):
        assert (lp - want_lp).abs().max() <= TOL and (ent - want_ent).abs().max() <= TOL
        for param, grad in want_grads.items():
            assert (grads[param] - grad).abs().max() <= TOL * max(1.0, grad.abs().max().item()), param
    # 0 wherever the plain two calls leave 0 (nothing but the positions before response tokens)
    assert torch.equal(ours["log_probs"].values() == 0, plain["log_probs"].values() == 0)


def test_a_hybrid_gives_the_same_log_probs():
    """Qwen3.5's gated delta rule and causal conv continue each response from its prompt's state."""
    model = hybrid("qwen3_5_text")
    micro = mixed_groups(model.config.vocab_size)
    with torch.no_grad():
        try:
            call = packed_logprobs(model, micro, tokens="response", share_prefixes=True)
        except ValueError as refused:  # layer shapes the shared forms do not take (transformers 5.10)
            with pytest.raises(ValueError, match=re.escape(str(refused))):  # refused the same, by name
                two_calls(model, micro, None, share=True, entropy=False)
            return
        ours = two_calls(model, micro, None, share=True, entropy=False)["log_probs"]
        plain = two_calls(model, micro, None, share=False, entropy=False)["log_probs"]
    assert (ours.values() - call.values()).abs().max() <= TOL
    assert (ours.values() - plain.values()).abs().max() <= TOL


def test_the_kwargs_are_the_packed_row_in_plan_order_and_its_plan():
    micro = mixed_groups()
    inputs, _ = prepare_model_inputs(micro, share_prefixes=True)
    plan = inputs["shared_prefixes"]
    assert sorted(inputs) == ["input_ids", "position_ids", "shared_prefixes", "use_cache"]
    assert inputs["use_cache"] is False
    assert torch.equal(inputs["input_ids"][0], plan.pack(micro["input_ids"].values()))
    assert torch.equal(inputs["position_ids"][0], plan.position_ids)
    # shared: fewer tokens than the rows hold
    assert inputs["input_ids"].shape[1] < micro["input_ids"].values().shape[0]


def refusal(case: str):
    """The micro-batch, prepare_model_inputs' kwargs and prepare_model_outputs' kwargs of one refusal."""
    micro = left_right_2_no_padding(grpo_batch([3], 2, [2, 2]))
    prepare: dict = {"share_prefixes": True}
    outputs: dict = {"tokens": "response"}
    if case == "sp_size":
        prepare["sp_size"] = 2
    elif case == "pad_to_multiple":
        prepare["pad_to_multiple"] = 8
    elif case == "bucket":
        prepare["bucket"] = 16
    elif case == "mrope":
        ids = micro["position_ids"]
        micro["position_ids"] = torch.nested.nested_tensor_from_jagged(
            ids.values().expand(3, -1).contiguous(), ids.offsets(), jagged_dim=2
        )
    elif case == "tokens":
        outputs["tokens"] = "all"
    elif case == "score_mask":
        outputs["score_mask"] = torch.ones(micro["input_ids"].values().shape[0], dtype=torch.bool)
    elif case == "no response fields":
        ids, pos = micro["input_ids"], micro["position_ids"]
        offsets = ids.offsets().clone()  # new offsets: no way back from a conversion to read
        micro = {
            "input_ids": torch.nested.nested_tensor_from_jagged(ids.values(), offsets),
            "position_ids": torch.nested.nested_tensor_from_jagged(pos.values(), offsets),
        }
    return micro, prepare, outputs


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("sp_size", r"sp_size: expected 1 with share_prefixes"),
        ("pad_to_multiple", r"pad_to_multiple: expected 1 with share_prefixes"),
        ("bucket", r"bucket: expected None with share_prefixes"),
        ("mrope", r"position_ids: expected 1-row \(batch, j\) ids with share_prefixes"),
        ("tokens", r"tokens: expected 'response' and no score_mask .* share_prefixes"),
        ("score_mask", r"score_mask: expected 'response' and no score_mask .* share_prefixes"),
        ("no response fields", r"expected nested responses, or attention_mask with responses/response_mask"),
    ],
)
def test_what_the_shared_layout_cannot_serve_is_refused_by_name(case, match):
    model = tiny_llama(0)
    micro, prepare, outputs = refusal(case)
    with pytest.raises(ValueError, match=match):
        inputs, args = prepare_model_inputs(micro, **prepare)
        with torch.no_grad(), chunked_head(model, args, "logits", tokens="response") as served:
            logits = served(**inputs).logits
        prepare_model_outputs(logits, args, **outputs)
    if case == "tokens":  # a critic's values: every row's tokens, which the shared row does not hold
        inputs, args = prepare_model_inputs(micro, **prepare)
        values = torch.zeros(inputs["input_ids"].shape)
        with pytest.raises(ValueError, match=r"output_args: expected the OutputArgs .* without share_prefixes"):
            prepare_value_outputs(values, args)
    if case in ("tokens", "score_mask"):  # the head is refused the same, before the forward
        inputs, args = prepare_model_inputs(micro, **prepare)
        with pytest.raises(ValueError, match=match), chunked_head(model, args, **outputs):
            pass


def test_the_attention_is_switched_for_the_block_only_and_a_checkpointed_model_is_refused_under_autograd():
    model = tiny_llama(0)
    micro = left_right_2_no_padding(grpo_batch([3], 2, [2, 2]))
    inputs, args = prepare_model_inputs(micro, share_prefixes=True)
    before = model.config._attn_implementation
    with chunked_head(model, args, "logits", tokens="response"):
        assert model.config._attn_implementation.startswith("nopad_shared")
    assert model.config._attn_implementation == before
    model.gradient_checkpointing_enable()
    model.train()
    match = r"model: expected a model whose layers are not checkpointed, for shared prefixes with gradients"
    with pytest.raises(ValueError, match=match), chunked_head(model, args, tokens="response"):
        pass
    with pytest.raises(ValueError, match=match):  # the one call the same (not a raw CheckpointError)
        packed_logprobs(model, micro, tokens="response", share_prefixes=True)
    with torch.no_grad(), chunked_head(model, args, "logits", tokens="response") as served:  # no backward: served
        assert served(**inputs).logits.shape[:2] == inputs["input_ids"].shape


@pytest.mark.parametrize("head", ["logits", "chunked"])
def test_the_op_count_and_the_host_syncs_do_not_grow_with_the_groups(head):
    """2 groups or 16, the same ops and syncs through the two calls: no loop over groups or rows."""
    model = tiny_llama(0)
    counts = []
    for groups in (2, 16):
        micro = left_right_2_no_padding(grpo_batch([3] * groups, 4, [2] * (4 * groups), seed=groups))
        with torch.no_grad(), OpCounter() as ops:
            two_calls(model, micro, None, share=True, head=head)
        counts.append((ops.ops, ops.syncs))
    assert counts[0] == counts[1], counts
