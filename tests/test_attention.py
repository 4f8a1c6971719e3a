"""The packed attention back end "nopad_varlen": every kernel equals the padded forward, kernels are
chosen and refused as documented, and it serves nopad's micro-batches and padding-free collators alike.

The three CUDA kernels run here as CPU stand-ins with their exact signatures (tests/kernel_standins.py);
the real ones are compared on a GPU by the tests marked ``cuda`` at the end.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

# private: the kernel registry and the attention function transformers calls are tested directly
import nopad.modeling._attention as attention
from nopad import IndexPlan, left_right_2_no_padding, no_padding_2_padding
from nopad.diagnostics import OpCounter
from nopad.engines import check_isolation, packed_logprobs, padded_logprobs, prepare_model_inputs
from nopad.modeling import available_kernels, use_packed_attention
from nopad.synthetic import tiny_causal_lm
from tests.kernel_standins import CALLS, aten_flash_without_window, use_standins, varlen_attn_2_10, varlen_attn_2_11
from tests.models import VOCAB, make_padded_batch, tiny_llama, tiny_qwen2, tiny_qwen2_vl_text

TOL = 1e-5
BUILDERS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen2_vl_text": tiny_qwen2_vl_text}


def _batch(name, seed=11):
    return make_padded_batch(
        4, 7, 6, seed=seed, prompt_lens=[1, 7, 3, 5], resp_lens=[6, 1, 4, 6], mrope=name == "qwen2_vl_text"
    )


def _log_probs_entropy_grads(model, td, packed: bool, kernel: str | None = None):
    temperature = torch.tensor([0.7, 1.0, 1.3, 2.0])
    model.zero_grad()
    if packed:
        micro = left_right_2_no_padding(td)
        out = packed_logprobs(model, micro, temperature, calculate_entropy=True, attention=kernel)
        log_probs = no_padding_2_padding(out["log_probs"], micro)
        entropy = out["entropy"].values()
    else:
        log_probs = padded_logprobs(model, td, temperature)
        with torch.no_grad():
            positions = td["position_ids"]
            positions = positions.transpose(0, 1) if positions.dim() == 3 else positions
            logits = model(
                input_ids=td["input_ids"], attention_mask=td["attention_mask"], position_ids=positions, use_cache=False
            ).logits / temperature.view(-1, 1, 1)
        plan = IndexPlan.from_mask(td["attention_mask"])
        entropy = torch.distributions.Categorical(logits=plan.pack(logits)).entropy()
    log_probs.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return log_probs.detach(), entropy.detach(), grads


def _assert_same(packed, padded):
    (lp, ent, grads), (ref_lp, ref_ent, ref_grads) = packed, padded
    assert (lp - ref_lp).abs().max() <= TOL
    assert (ent - ref_ent).abs().max() <= TOL
    assert set(grads) == set(ref_grads)
    for n in grads:
        assert (grads[n] - ref_grads[n]).abs().max() <= TOL, n
    assert max(g.abs().max() for g in grads.values()) > 1e-3  # the loss really reached the weights


# ---- every kernel equals the padded forward ---------------------------------------------------------


@pytest.mark.parametrize("kernel", attention.KERNELS)
@pytest.mark.parametrize("name", list(BUILDERS))
def test_each_kernel_equals_the_padded_forward_in_log_probs_entropy_and_every_gradient(monkeypatch, name, kernel):
    use_standins(monkeypatch)
    td = _batch(name)
    reference = _log_probs_entropy_grads(BUILDERS[name](), td, packed=False)
    model = use_packed_attention(BUILDERS[name](), kernel)
    assert model.config._attn_implementation.startswith("nopad_varlen")
    _assert_same(_log_probs_entropy_grads(model, td, packed=True, kernel=None), reference)
    if kernel != "sdpa":
        assert CALLS and {c["kernel"] for c in CALLS} == {kernel}
        assert all(c["kv_heads"] == 2 and c["heads"] == 4 for c in CALLS)  # GQA: K/V never repeated


def test_auto_on_this_cpu_is_the_exact_fallback_and_the_padded_forward_through_it_is_unchanged():
    assert available_kernels("cpu", torch.float32) == available_kernels("cpu") == ["sdpa"]
    td = _batch("llama")
    plain, varlen = tiny_llama(), use_packed_attention(tiny_llama())
    assert varlen.config._attn_implementation == "nopad_varlen"
    with torch.no_grad():
        # a padded batch through nopad_varlen: rows unpadded by their 2-D mask, one sequence each
        assert (padded_logprobs(varlen, td) - padded_logprobs(plain, td)).abs().max() <= TOL


def test_torch_2_11_varlen_attn_repeats_kv_for_gqa_and_auto_prefers_a_kernel_that_does_not(monkeypatch):
    use_standins(monkeypatch, flash_attn=None, aten_flash=None, varlen_attn=varlen_attn_2_11)
    gqa = attention.Needs(gqa=True)
    assert attention.select_kernel("auto", "cpu", torch.bfloat16, gqa) == "varlen_attn"  # nothing better left
    use_standins(monkeypatch, flash_attn=None, varlen_attn=varlen_attn_2_11)
    assert attention.select_kernel("auto", "cpu", torch.bfloat16, gqa) == "aten_flash"
    td = _batch("llama")
    reference = _log_probs_entropy_grads(tiny_llama(), td, packed=False)
    _assert_same(_log_probs_entropy_grads(use_packed_attention(tiny_llama(), "varlen_attn"), td, True), reference)
    assert {c["kv_heads"] for c in CALLS} == {4}  # the copy torch 2.11 needs


def test_auto_order_is_flash_attn_then_aten_flash_then_varlen_attn_then_sdpa(monkeypatch):
    use_standins(monkeypatch)
    needs = attention.Needs(gqa=True)
    assert attention.available_kernels("cpu") == list(attention.KERNELS)
    assert attention.select_kernel("auto", "cpu", torch.float16, needs) == "flash_attn"
    use_standins(monkeypatch, flash_attn=None)
    assert attention.select_kernel("auto", "cpu", torch.float16, needs) == "aten_flash"
    use_standins(monkeypatch, flash_attn=None, aten_flash=None)
    assert attention.select_kernel("auto", "cpu", torch.float16, needs) == "varlen_attn"
    use_standins(monkeypatch, flash_attn=None, varlen_attn=None, aten_flash=None)
    assert attention.select_kernel("auto", "cpu", torch.float16, needs) == "sdpa"


# ---- sliding window ---------------------------------------------------------------------------------


def _sliding_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).float().eval()


@pytest.mark.parametrize("kernel", attention.KERNELS)
def test_sliding_window_per_layer_reaches_every_kernel_and_equals_the_padded_forward(monkeypatch, kernel):
    use_standins(monkeypatch)
    td = _batch("qwen2", seed=5)
    reference = _log_probs_entropy_grads(_sliding_qwen2(), td, packed=False)
    _assert_same(_log_probs_entropy_grads(use_packed_attention(_sliding_qwen2(), kernel), td, True), reference)
    if kernel != "sdpa":  # layer 0 slides (window 3: itself and 2 before), layer 1 does not
        windows = [c.get("window_size", c.get("window")) for c in CALLS]
        assert set(windows) == ({(2, 0), (None, None)} if kernel == "aten_flash" else {(2, 0), (-1, 0)})


def test_a_kernel_that_cannot_slide_is_refused_when_forced_and_skipped_by_auto(monkeypatch):
    use_standins(monkeypatch, varlen_attn=varlen_attn_2_10, aten_flash=aten_flash_without_window, flash_attn=None)
    window = attention.Needs(window=3)
    assert attention.select_kernel("auto", "cpu", torch.bfloat16, window) == "sdpa"
    assert attention.select_kernel("auto", "cpu", torch.bfloat16, attention.Needs()) == "aten_flash"
    model = use_packed_attention(_sliding_qwen2(), "varlen_attn")
    with pytest.raises(
        ValueError,
        match=r"kernel: expected a kernel that runs here .*'varlen_attn', which cannot "
        r"honour a sliding window",
    ):
        packed_logprobs(model, left_right_2_no_padding(_batch("qwen2")), attention=None)


# ---- clear errors -----------------------------------------------------------------------------------


def test_a_kernel_that_cannot_run_here_is_a_clear_error_naming_what_can():
    with pytest.raises(
        ValueError,
        match=r"kernel: expected a kernel that runs here \(available: \['sdpa'\]\), got "
        r"'aten_flash', which needs a cuda device, the model is on cpu",
    ):
        use_packed_attention(tiny_llama(), "aten_flash")
    with pytest.raises(
        ValueError,
        match=r"kernel: expected 'auto' or one of \['flash_attn', 'aten_flash', "
        r"'varlen_attn', 'sdpa'\], got 'flash'",
    ):
        use_packed_attention(tiny_llama(), "flash")


def test_features_no_kernel_honours_are_refused_not_ignored(monkeypatch):
    use_standins(monkeypatch)
    q = torch.randn(1, 4, 5, 8)
    kv = torch.randn(1, 2, 5, 8)
    module = torch.nn.Module()
    module.config = type("C", (), {"_attn_implementation": "nopad_varlen_aten"})()
    with pytest.raises(ValueError, match="'aten_flash', which cannot honour soft-capping"):
        attention.nopad_varlen_attention(module, q, kv, kv, None, softcap=30.0)
    with pytest.raises(ValueError, match="'aten_flash', which cannot honour attention sinks"):
        attention.nopad_varlen_attention(module, q, kv, kv, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match=r"Module key: expected keys for the queries' own 1 positions.* \(no KV cache"):
        attention.nopad_varlen_attention(module, q[:, :, :1], kv, kv, None)
    with pytest.raises(ValueError, match=r"Module position_bias: expected no per-score tensor .* got a \(1, 4, 5, 5\)"):
        attention.nopad_varlen_attention(module, q, kv, kv, None, position_bias=torch.zeros(1, 4, 5, 5))
    with pytest.raises(ValueError, match=r"attention_mask: expected None or a \(1, 5\) padding mask"):
        attention.nopad_varlen_attention(module, q, kv, kv, torch.ones(1, 1, 5, 5, dtype=torch.bool))


def test_softcap_and_sinks_on_the_fallback_equal_the_eager_formula():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    module = torch.nn.Module()
    module.config = type("C", (), {"_attn_implementation": "nopad_varlen"})()
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    sinks = torch.randn(4)
    out, _ = attention.nopad_varlen_attention(
        module, q, k, v, None, softcap=2.0, s_aux=sinks, cu_seq_lens_q=cu, max_length_q=4
    )
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for start, end in ((0, 2), (2, 6)):
        s = q[..., start:end, :] @ kr[..., start:end, :].transpose(-1, -2) * 8**-0.5
        s = torch.tanh(s / 2.0) * 2.0
        n = end - start
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        p = torch.cat([s, sinks.view(1, 4, 1, 1).expand(1, 4, n, 1)], -1).softmax(-1)[..., :-1]
        expected = (p @ vr[..., start:end, :]).transpose(1, 2)
        assert torch.allclose(out[:, start:end], expected, atol=1e-6)


# ---- boundaries from nopad's inputs, from position ids, and none at all ------------------------------


@given(rows=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=4), min_size=1, max_size=3))
def test_plan_from_position_ids_matches_a_naive_scan(rows):
    width = max(sum(r) for r in rows)
    position_ids = torch.zeros(len(rows), width, dtype=torch.int64)
    for b, lengths in enumerate(rows):
        tail = width - sum(lengths)
        runs = [*lengths, *([tail] if tail else [])]
        position_ids[b] = torch.cat([torch.arange(n) for n in runs])
    plan = IndexPlan.from_position_ids(position_ids)
    flat = position_ids.flatten().tolist()
    starts = [t for t in range(len(flat)) if t % width == 0 or flat[t] != flat[t - 1] + 1]
    assert plan.offsets.tolist() == [*starts, len(flat)]
    assert plan.max_seqlen == max(b - a for a, b in zip(starts, [*starts[1:], len(flat)]))


def test_padding_free_collator_rows_need_only_position_ids():
    from transformers import DataCollatorWithFlattening

    torch.manual_seed(0)
    sequences = [torch.randint(1, VOCAB, (n,)).tolist() for n in (5, 1, 7, 3)]
    batch = DataCollatorWithFlattening()([{"input_ids": s} for s in sequences])
    assert set(batch) >= {"input_ids", "position_ids"} and "cu_seq_lens_q" not in batch
    varlen = use_packed_attention(tiny_llama())
    with torch.no_grad():
        packed = varlen(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        alone = [tiny_llama()(input_ids=torch.tensor([s])).logits[0] for s in sequences]
    assert (packed - torch.cat(alone)).abs().max() <= TOL


def _forward_syncs(layers: int, **inputs) -> int:
    model = use_packed_attention(tiny_causal_lm(vocab=VOCAB, layers=layers))
    clones: dict[int, torch.Tensor] = {}  # fresh tensors (nothing cached from another forward), aliases kept
    inputs = {k: clones.setdefault(id(v), v.clone()) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad(), OpCounter() as counter:
        model(**inputs)
    return counter.syncs


def test_nopad_inputs_carry_boundaries_so_the_attention_makes_no_host_sync(device_path):
    micro = left_right_2_no_padding(_batch("llama"))
    inputs, _ = prepare_model_inputs(micro, attn_implementation="nopad_varlen")
    assert inputs["cu_seq_lens_q"].dtype == torch.int32 and isinstance(inputs["max_length_q"], int)
    # transformers' own mask preprocessing reads the position ids once per forward (packed-sequence
    # detection, whatever the implementation); nopad's attention adds none, in any layer
    assert _forward_syncs(2, **inputs) == _forward_syncs(4, **inputs) <= 1
    # boundaries given as two equal tensors, max length not given: checked and derived once per forward
    inputs.update(cu_seq_lens_k=inputs["cu_seq_lens_k"].clone(), max_length_q=None)
    assert _forward_syncs(2, **inputs) == _forward_syncs(4, **inputs) <= 3


def test_position_ids_alone_cost_one_boundary_derivation_per_forward_not_one_per_layer():
    micro = left_right_2_no_padding(_batch("llama"))
    inputs, _ = prepare_model_inputs(micro)
    assert "cu_seq_lens_q" not in inputs
    # transformers' packed-sequence detection and nopad's derivation (the start flags' one copy)
    assert _forward_syncs(2, **inputs) == _forward_syncs(4, **inputs) <= 2


def test_the_leak_probe_reports_nopad_varlen_isolated_with_and_without_boundaries():
    varlen = use_packed_attention(tiny_llama())
    assert not check_isolation(varlen)  # nopad's inputs: cu_seq_lens
    assert not check_isolation(varlen, use_cache=None, cu_seq_lens_q=None, cu_seq_lens_k=None)  # position ids only


def test_packed_attention_switches_only_where_asked_and_restores_the_model():
    model = tiny_llama()
    micro = left_right_2_no_padding(_batch("llama"))
    with torch.no_grad():
        auto = packed_logprobs(model, micro)  # CPU: auto keeps the model's own attention
        forced = packed_logprobs(model, micro, attention="sdpa")
    assert model.config._attn_implementation == "sdpa"
    assert all(m.config._attn_implementation == "sdpa" for m in model.modules() if hasattr(m, "config"))
    assert (auto.values() - forced.values()).abs().max() <= TOL
    with attention.packed_attention(model, "sdpa"):
        assert model.config._attn_implementation == "nopad_varlen_dense"
    assert model.config._attn_implementation == "sdpa"


def test_from_pretrained_takes_nopad_varlen_after_import_nopad_attention(tmp_path):
    """The back end registers when nopad.modeling is imported (``import nopad`` alone loads no transformers)."""
    tiny_llama().save_pretrained(tmp_path)
    script = (
        "import sys, nopad\n"
        "assert 'transformers.modeling_utils' not in sys.modules, 'import nopad must not load transformers'\n"
        "import nopad.modeling\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, attn_implementation='nopad_varlen')\n"
        "assert m.config._attn_implementation == 'nopad_varlen', m.config._attn_implementation\n"
        "import torch\n"
        "print(m(input_ids=torch.tensor([[1, 2, 3]])).logits.shape)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch.Size([1, 3, 97])" in out.stdout


# ---- the real kernels, on a GPU ----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the real kernels run there")
@pytest.mark.parametrize("kernel", attention.KERNELS)
def test_real_kernels_are_within_the_bf16_padded_error_of_an_fp32_padded_forward(kernel):
    if kernel not in available_kernels("cuda", torch.bfloat16):
        pytest.skip(f"{kernel} is not available on this machine")
    from nopad.synthetic import synthetic_batch

    td = synthetic_batch(8, 128, 256, vocab=1000, device="cuda")
    fp32 = tiny_causal_lm(vocab=1000, hidden=256, layers=4).cuda()
    with torch.no_grad():
        exact = padded_logprobs(fp32, td)
        bf16 = fp32.to(torch.bfloat16)
        padded_error = (padded_logprobs(bf16, td) - exact).abs().max()
        micro = left_right_2_no_padding(td)
        packed = no_padding_2_padding(packed_logprobs(bf16, micro, attention=kernel), micro)
    assert (packed - exact).abs().max() <= padded_error * 1.1
