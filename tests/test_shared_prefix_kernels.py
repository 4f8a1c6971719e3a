"""The shared-prefix attention through nopad_varlen's flash kernels (issue 38): the keys gathered per
row and ONE varlen call with the queries' and the keys' own boundaries, equal to the exact tiled path
and to each row alone, forward and backward; the kernel chosen and refused as nopad_varlen's.

The CUDA kernels run here as CPU stand-ins with their exact signatures (tests/kernel_standins.py),
which align the causal mask and the window at the bottom right where a sequence has fewer queries
than keys, as the real kernels do; the real ones are compared on a GPU by the test marked ``cuda``.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

# private: the attention function transformers calls and its kernel choice are tested directly
import nopad.modeling._attention as attention
import nopad.modeling._prefixes as prefixes
from nopad import left_right_2_no_padding, no_padding_2_padding
from nopad.batches._prefixes import join_prompts, plan_shared_prefixes
from nopad.core._memo import remember
from nopad.diagnostics import OpCounter
from nopad.engines import packed_logprobs
from nopad.modeling import use_packed_attention
from nopad.modeling._prefixes import shared_implementation, use_shared_prefix_attention
from tests.kernel_standins import CALLS, aten_flash_without_window, use_standins, varlen_attn_2_10, varlen_attn_2_11
from tests.models import tiny_llama
from tests.test_attention import _sliding_qwen2
from tests.test_shared_prefix_logprobs import grpo_batch
from tests.test_shared_prefixes import grpo_rows, nested

TOL = 1e-5
FLASH = ("flash_attn", "aten_flash", "varlen_attn")
HEADS, KV_HEADS, DIM = 4, 2, 8


def layer(kernel: str) -> torch.nn.Module:
    """A module as transformers hands the attention function one: its config names the implementation."""
    module = torch.nn.Module()
    module.config = types.SimpleNamespace(_attn_implementation=shared_implementation(kernel))
    remember(module, prefixes._CHECKED, True)  # as use_shared_prefix_attention leaves each attention layer
    return module


def rows_case(name: str):
    """(prompts, completions) of a named case: groups of 1 to 16, 1-token prompts, empty completions."""
    if name == "groups of 1 to 16":
        prompts, completions = grpo_rows(3, [1, 6, 3, 2], [16, 1, 4, 2], 6)
    else:  # every prompt its own group of 1
        prompts, completions = grpo_rows(4, [1, 5, 2], [1, 1, 1], 4)
    completions[0] = []  # an empty completion: a segment of no queries over its prompt's keys
    completions[-1] = completions[-1] or [7]
    return prompts, completions


def alone(q_rows, k_rows, v_rows, lengths, *, scale: float, window: int | None):
    """Causal attention over each row alone (its own prompt then completion), with HF's sliding
    window: the reference, a loop over rows. (N, H, D) row tokens in, (N, H, D) out."""
    outs, start = [], 0
    for n in lengths:
        q, k, v = (t[start : start + n].transpose(0, 1) for t in (q_rows, k_rows, v_rows))
        i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        allowed = (j <= i) & ((j > i - window) if window is not None else True)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True))
        start += n
    return torch.cat([o.transpose(0, 1) for o in outs])


def attend(kernel: str, plan, q, k, v, window):
    """The attention function as a layer calls it: (T, H, D) packed in, (T, H, D) out."""
    as_hf = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out, _ = prefixes.shared_prefix_attention(
        layer(kernel), *as_hf, None, scaling=0.4, sliding_window=window, shared_prefixes=plan
    )
    return out[0]


@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("case", ["groups of 1 to 16", "groups of 1"])
@pytest.mark.parametrize("kernel", FLASH)
def test_each_flash_kernel_equals_the_tiled_path_and_each_row_alone_forward_and_backward(
    monkeypatch, kernel, case, window
):
    use_standins(monkeypatch)
    prompts, completions = rows_case(case)
    plan = plan_shared_prefixes(*join_prompts(nested(prompts), nested(completions)), tile=3)
    gen = torch.Generator().manual_seed(plan.total)
    q, k, v = (torch.randn(plan.total, h, DIM, generator=gen, requires_grad=True) for h in (HEADS, KV_HEADS, KV_HEADS))
    weights = torch.randn(plan.rows_total, HEADS, DIM, generator=gen)  # a loss over every row's tokens

    def run(fn):
        out = fn()  # (N, H, D) row tokens
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        return out.detach(), grads

    CALLS.clear()
    ours = run(lambda: plan.unpack(attend(kernel, plan, q, k, v, window)))
    # ONE call, over the gathered keys (the queries' own boundaries where a group has several rows)
    assert [(c["kernel"], c["own_keys"]) for c in CALLS] == [(kernel, plan.groups < plan.rows)]
    if window is not None and kernel != "varlen_attn":
        assert CALLS[0].get("window_size", CALLS[0].get("window")) == (window - 1, 0)
    tiled = run(lambda: plan.unpack(attend("sdpa", plan, q, k, v, window)))
    assert len(CALLS) == 1  # the tiled path calls no kernel
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    rows = run(lambda: alone(*(plan.unpack(t) for t in (q, k, v)), lengths, scale=0.4, window=window))
    for reference in (tiled, rows):
        torch.testing.assert_close(ours[0], reference[0], atol=TOL, rtol=0)
        for got, want in zip(ours[1], reference[1]):
            torch.testing.assert_close(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("kernel", FLASH)
def test_a_model_with_a_sliding_layer_through_each_kernel_equals_the_tiled_path_and_each_row_alone(monkeypatch, kernel):
    """Qwen2 with a 3-token window in layer 0 (full attention in layer 1): logits equal each row run
    alone; every parameter's gradient equals the tiled path's."""
    use_standins(monkeypatch)
    prompts, completions = rows_case("groups of 1 to 16")
    input_ids, prompt_lengths = join_prompts(nested(prompts), nested(completions))
    plan = plan_shared_prefixes(input_ids, prompt_lengths)
    packed, positions = plan.pack(input_ids.values())[None], plan.position_ids[None]
    weights = torch.randn(plan.total, 97, generator=torch.Generator().manual_seed(0))
    models, logits = {}, {}
    for name in (kernel, "sdpa"):
        models[name] = use_shared_prefix_attention(_sliding_qwen2(), name)
        CALLS.clear()
        logits[name] = models[name](input_ids=packed, position_ids=positions, shared_prefixes=plan).logits[0]
        (logits[name] * weights[:, : logits[name].shape[-1]]).sum().backward()
        assert {c["kernel"] for c in CALLS} == ({kernel} if name == kernel else set())
    assert models[kernel].config._attn_implementation == shared_implementation(kernel)
    reference = _sliding_qwen2()
    rows = plan.unpack_nested(logits[kernel].detach())
    with torch.no_grad():
        for row, p, c in zip(rows.unbind(), prompts, completions):
            torch.testing.assert_close(row, reference(input_ids=torch.tensor([p + c])).logits[0], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[kernel], logits["sdpa"], atol=TOL, rtol=0)
    for (name, got), want in zip(models[kernel].named_parameters(), models["sdpa"].parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=TOL, rtol=0, msg=name)


def test_auto_takes_the_kernel_nopad_varlen_would_and_the_tiled_path_where_none_applies(monkeypatch):
    prompts, completions = rows_case("groups of 1")
    plan = plan_shared_prefixes(*join_prompts(nested(prompts), nested(completions)))
    q, k = torch.randn(plan.total, HEADS, DIM), torch.randn(plan.total, KV_HEADS, DIM)
    gqa = attention.Needs(gqa=True)
    for absent in ((), ("flash_attn",), ("flash_attn", "aten_flash")):
        use_standins(monkeypatch, **dict.fromkeys(absent))
        attend("auto", plan, q, k, k, None)
        chosen = attention.select_kernel("auto", "cpu", torch.float32, gqa)  # what nopad_varlen reports
        assert [c["kernel"] for c in CALLS] == [chosen] == [next(x for x in FLASH if x not in absent)]
    # torch 2.11's varlen_attn copies K/V for GQA: auto prefers a kernel that does not, as nopad_varlen
    use_standins(monkeypatch, flash_attn=None, varlen_attn=varlen_attn_2_11)
    attend("auto", plan, q, k, k, None)
    assert [c["kernel"] for c in CALLS] == ["aten_flash"]
    # no flash kernel: the exact tiled path, with nothing called
    use_standins(monkeypatch, flash_attn=None, aten_flash=None, varlen_attn=None)
    torch.testing.assert_close(attend("auto", plan, q, k, k, 2), attend("sdpa", plan, q, k, k, 2), atol=0, rtol=0)
    assert CALLS == []


def test_auto_on_this_cpu_is_the_tiled_path_unchanged():
    prompts, completions = rows_case("groups of 1 to 16")
    plan = plan_shared_prefixes(*join_prompts(nested(prompts), nested(completions)), tile=4)
    q, k, v = torch.randn(plan.total, HEADS, DIM), torch.randn(plan.total, KV_HEADS, DIM), torch.randn(plan.total, 2, 8)
    for dtype in (torch.float32, torch.bfloat16):  # no CUDA here: no flash kernel at any dtype
        args = (t.to(dtype) for t in (q, k, v))
        got = attend("auto", plan, *args, 3)
        want = prefixes.tiled_attention(q.to(dtype), k.to(dtype), v.to(dtype), plan, scale=0.4, window=3)
        assert torch.equal(got, want)


def test_a_kernel_that_cannot_slide_is_refused_by_name_when_forced_and_skipped_by_auto(monkeypatch):
    use_standins(monkeypatch, varlen_attn=varlen_attn_2_10, aten_flash=aten_flash_without_window, flash_attn=None)
    prompts, completions = rows_case("groups of 1")
    plan = plan_shared_prefixes(*join_prompts(nested(prompts), nested(completions)))
    q, k = torch.randn(plan.total, HEADS, DIM), torch.randn(plan.total, KV_HEADS, DIM)
    for kernel, why in (("varlen_attn", "varlen_attn has no window_size"), ("aten_flash", "has no window_size_left")):
        with pytest.raises(
            ValueError,
            match=rf"kernel: expected a kernel that runs here .*'{kernel}', which cannot honour a sliding .*{why}",
        ):
            attend(kernel, plan, q, k, k, 2)
    attend("auto", plan, q, k, k, 2)  # a window: auto skips both, to the tiled path
    assert CALLS == []
    attend("auto", plan, q, k, k, None)  # none: the first that runs
    attend("auto", plan, q, k, k, plan.max_seqlen_k)  # a window no row outgrows asks nothing of a kernel
    assert [c["kernel"] for c in CALLS] == ["aten_flash", "aten_flash"]


def test_a_forced_kernel_that_cannot_run_here_and_an_unknown_one_are_refused_by_name_before_anything_changes():
    model = tiny_llama()
    before = model.config._attn_implementation
    with pytest.raises(
        ValueError,
        match=r"kernel: expected a kernel that runs here \(available: \['sdpa'\]\), got "
        r"'aten_flash', which needs a cuda device, the model is on cpu",
    ):
        use_shared_prefix_attention(model, "aten_flash")
    with pytest.raises(ValueError, match=r"kernel: expected 'auto' or one of \['flash_attn', .*got 'flash'"):
        use_shared_prefix_attention(model, "flash")
    assert model.config._attn_implementation == before
    plan = plan_shared_prefixes(*join_prompts(nested([[1, 2]]), nested([[3]])))
    with pytest.raises(ValueError, match=r"sliding_window: expected an int >= 1, got 0"):  # a flash kernel: no window
        attend("auto", plan, torch.randn(3, HEADS, DIM), torch.randn(3, 2, DIM), torch.randn(3, 2, DIM), 0)


def test_a_model_forced_to_a_kernel_keeps_it_for_its_shared_prefix_forwards(monkeypatch):
    """packed_logprobs(share_prefixes=True) on a model forced to nopad_varlen's flash_attn runs its
    shared forward through flash_attn too, equal to the plain packed call; the model is left as it was."""
    use_standins(monkeypatch)
    model = use_packed_attention(tiny_llama(0), "flash_attn")
    micro = left_right_2_no_padding(grpo_batch([5, 1], 4, [3, 7, 1, 0, 2, 2, 6, 1]))
    with torch.no_grad():
        plain = packed_logprobs(model, micro, tokens="response")
        CALLS.clear()
        shared = packed_logprobs(model, micro, tokens="response", share_prefixes=True)
    assert {(c["kernel"], c["own_keys"]) for c in CALLS} == {("flash_attn", True)}
    assert (no_padding_2_padding(shared, micro) - no_padding_2_padding(plain, micro)).abs().max() <= TOL
    assert model.config._attn_implementation == "nopad_varlen_fa"


def _counting_flash_attn(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):  # fmt: skip
    """flash_attn's signature, one op: what the wiring around the one call costs is what is counted."""
    return q.clone()


def test_the_kernel_path_is_a_fixed_number_of_ops_and_no_sync_whatever_the_groups(monkeypatch):
    use_standins(monkeypatch, flash_attn=_counting_flash_attn)
    counts = []
    for groups in (2, 64):
        prompts, completions = grpo_rows(
            groups, [1 + g % 9 for g in range(groups)], [1 + g % 16 for g in range(groups)], 6
        )
        plan = plan_shared_prefixes(*join_prompts(nested(prompts), nested(completions)))
        q, k = torch.randn(plan.total, HEADS, DIM), torch.randn(plan.total, KV_HEADS, DIM)
        attend("flash_attn", plan, q, k, k, None)  # the first call reads the kernel's signature, once
        with OpCounter() as counter:
            attend("flash_attn", plan, q, k, k, 5)
        counts.append((counter.ops, counter.syncs))
    assert counts[0] == counts[1] and counts[0][1] == 0, counts


# ---- the real kernels, on a GPU ----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the real kernels run there")
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kernel", FLASH)
def test_real_kernels_on_the_shared_layout_match_the_tiled_path(kernel, window):
    """bf16 through the real kernel and through the tiled path, each within its rounding of an fp32
    tiled reference (a wrong alignment or window would be off by O(1)); the gradients likewise."""
    if kernel not in attention.available_kernels("cuda", torch.bfloat16):
        pytest.skip(f"{kernel} is not available on this machine")
    why = attention._refusal(kernel, attention.Needs(gqa=True, window=window))
    if why is not None:  # refused by name, as the CPU tests show; nothing to compare
        pytest.skip(f"this torch's {kernel} cannot honour {why}")
    prompts, completions = grpo_rows(5, [1, 40, 17, 90], [16, 1, 4, 8], 120)
    completions[0] = []
    plan = plan_shared_prefixes(*join_prompts(nested(prompts).cuda(), nested(completions).cuda()))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(plan.total, h, 64, device="cuda", generator=gen) for h in (8, 2, 2))
    weights = torch.randn(plan.total, 8, 64, device="cuda", generator=gen)

    def run(name, dtype):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = attend(name, plan, *inputs, window)
        grads = torch.autograd.grad((out.float() * weights).sum(), inputs)
        return [out.float(), *(g.float() for g in grads)]

    exact = run("sdpa", torch.float32)
    for what, got, tiled, want in zip(
        ("out", "dq", "dk", "dv"), run(kernel, torch.bfloat16), run("sdpa", torch.bfloat16), exact
    ):
        error, rounding = (got - want).abs().max().item(), (tiled - want).abs().max().item()
        # a key too many or too few for some query is off by the size of the values, not by rounding
        assert error <= 2 * rounding + 1e-2 * want.abs().max().item(), (what, error, rounding)
