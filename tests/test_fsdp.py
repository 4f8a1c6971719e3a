"""The FSDP engine adapter on real (tiny, random-weight) HF models: packed == padded, per token and in gradients."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from nopad import left_right_2_no_padding, no_padding_2_padding
from nopad.core import IndexPlan
from nopad.diagnostics import OpCounter
from nopad.engines import packed_logprobs, padded_logprobs, prepare_model_inputs, prepare_model_outputs

# private: the leak probe's batch builder
from nopad.engines._leak import check_isolation, probe_batch
from nopad.modeling import token_log_probs
from tests.dist_utils import run_distributed
from tests.models import VOCAB, make_padded_batch, tiny_llama, tiny_qwen2, tiny_qwen2_vl_text

TOL = 1e-5
BUILDERS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen2_vl_text": tiny_qwen2_vl_text}


@functools.cache
def model(name: str) -> torch.nn.Module:
    return BUILDERS[name]()


def _packed_vs_padded(m, td, temperature=1.0, **kw):
    micro = left_right_2_no_padding(td)
    packed = no_padding_2_padding(packed_logprobs(m, micro, temperature, **kw), micro)
    return packed, padded_logprobs(m, td, temperature)


@st.composite
def batches(draw, max_b=4, prompt_width=6, resp_width=5):
    B = draw(st.integers(1, max_b))
    prompt_lens = draw(st.lists(st.integers(1, prompt_width), min_size=B, max_size=B))
    resp_lens = draw(st.lists(st.integers(0, resp_width), min_size=B, max_size=B))
    per_sample = draw(st.booleans())
    temps = draw(st.lists(st.floats(0.25, 2.0), min_size=B, max_size=B))
    temperature = torch.tensor(temps) if per_sample else temps[0]
    pad_to = draw(st.sampled_from([1, 8]))
    seed = draw(st.integers(0, 2**16))
    return prompt_lens, resp_lens, temperature, pad_to, seed


# ---- equivalence on real models ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2_vl_text"])
@settings(max_examples=15)
@given(case=batches())
def test_packed_log_probs_equal_padded_for_every_response_token(name, case):
    prompt_lens, resp_lens, temperature, pad_to, seed = case
    td = make_padded_batch(
        len(prompt_lens), 6, 5, seed=seed, prompt_lens=prompt_lens, resp_lens=resp_lens, mrope=name == "qwen2_vl_text"
    )
    with torch.no_grad():
        packed, padded = _packed_vs_padded(model(name), td, temperature, pad_to_multiple=pad_to)
    mask = td["response_mask"].bool()
    assert (packed - padded).abs().max() <= TOL
    assert (packed[~mask] == 0).all()


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2_vl_text"])
def test_parameter_gradients_of_summed_response_log_prob_equal_padded(name):
    m = model(name)
    td = make_padded_batch(
        4, 7, 6, seed=11, prompt_lens=[1, 7, 3, 5], resp_lens=[6, 1, 4, 6], mrope=name == "qwen2_vl_text"
    )
    temperature = torch.tensor([0.7, 1.0, 1.3, 2.0])
    grads = []
    for loss_of in (lambda: _packed_vs_padded(m, td, temperature)[0], lambda: padded_logprobs(m, td, temperature)):
        m.zero_grad()
        loss_of().sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    m.zero_grad()
    packed, padded = grads
    assert set(packed) == set(padded)
    for n in packed:
        assert (packed[n] - padded[n]).abs().max() <= TOL, n
    assert max(g.abs().max() for g in packed.values()) > 1e-3  # the loss really reached the weights


def test_three_row_mrope_position_ids_get_text_row_and_match_padded():
    td = make_padded_batch(3, 5, 4, seed=5, mrope=True)
    micro = left_right_2_no_padding(td)
    inputs, _ = prepare_model_inputs(micro)
    assert inputs["position_ids"].shape == (4, 1, micro["input_ids"].values().shape[0])
    td3 = td.clone()
    td3["position_ids"] = td["position_ids"][:, 1:]
    micro3 = left_right_2_no_padding(td3)
    inputs3, _ = prepare_model_inputs(micro3)
    assert torch.equal(inputs3["position_ids"], inputs["position_ids"])
    with torch.no_grad():
        packed = no_padding_2_padding(packed_logprobs(model("qwen2_vl_text"), micro3), micro3)
        assert (packed - padded_logprobs(model("qwen2_vl_text"), td)).abs().max() <= TOL


def test_entropy_equals_the_padded_forward_entropy_for_every_real_token():
    m = model("llama")
    td = make_padded_batch(3, 6, 5, seed=2)
    micro = left_right_2_no_padding(td)
    out = packed_logprobs(m, micro, 0.8, calculate_entropy=True)
    with torch.no_grad():
        logits = (
            m(
                input_ids=td["input_ids"],
                attention_mask=td["attention_mask"],
                position_ids=td["position_ids"],
                use_cache=False,
            ).logits
            / 0.8
        )
    plan = IndexPlan.from_mask(td["attention_mask"])
    reference = torch.distributions.Categorical(logits=plan.pack(logits)).entropy()
    assert torch.equal(out["entropy"].offsets(), micro["input_ids"].offsets())
    assert (out["entropy"].values() - reference).abs().max() <= TOL


# ---- the adapter's inputs and outputs ---------------------------------------------------------


def _micro(lengths=(3, 1, 4), seed=0):
    return probe_batch(VOCAB, lengths, seed)


def test_model_inputs_are_one_packed_row_without_mask_and_without_cache():
    micro = _micro()
    inputs, args = prepare_model_inputs(micro)
    ids = micro["input_ids"].values()
    assert set(inputs) == {"input_ids", "position_ids", "use_cache"} and inputs["use_cache"] is False
    assert torch.equal(inputs["input_ids"], ids.unsqueeze(0))
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert torch.equal(args.labels, torch.where(args.label_mask, torch.roll(ids, -1), 0))  # pad id at last tokens
    assert args.label_mask.tolist() == [True, True, False, False, True, True, True, False]


def test_flash_attention_gets_cu_seq_lens_and_max_lengths():
    inputs, _ = prepare_model_inputs(_micro(), attn_implementation="flash_attention_2")
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert inputs[key].dtype == torch.int32 and inputs[key].tolist() == [0, 3, 4, 8]
    assert inputs["max_length_q"] == inputs["max_length_k"] == 4
    assert "attention_mask" not in inputs


def test_bucket_padding_pads_the_row_as_its_own_sequence_and_strips_it():
    micro = _micro()
    inputs, args = prepare_model_inputs(micro, pad_to_multiple=16, attn_implementation="flash_attention_2")
    assert inputs["input_ids"].shape == (1, 16) and args.padded_total == 16
    assert inputs["position_ids"][0, 8:].tolist() == list(range(8))  # restarts: its own segment
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 4, 8, 16] and inputs["max_length_q"] == 8
    logits = torch.randn(1, 16, VOCAB)
    out = prepare_model_outputs(logits, args)["log_probs"]
    plain_inputs, plain_args = prepare_model_inputs(micro)
    plain = prepare_model_outputs(logits[:, :8], plain_args)["log_probs"]
    assert torch.equal(out.values(), plain.values()) and torch.equal(out.offsets(), micro["input_ids"].offsets())


def test_log_prob_of_each_sequence_last_token_is_zero_and_others_match_log_softmax():
    micro = _micro()
    logits = torch.randn(1, 8, VOCAB)
    inputs, args = prepare_model_inputs(micro, temperature=torch.tensor([0.5, 1.0, 2.0]))
    lp = prepare_model_outputs(logits, args)["log_probs"].values()
    temps = torch.tensor([0.5] * 3 + [1.0] + [2.0] * 4)
    expected = (logits[0] / temps.unsqueeze(1)).log_softmax(-1).gather(1, args.labels.unsqueeze(1)).squeeze(1)
    keep = torch.tensor([1, 1, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    assert (lp[keep] - expected[keep]).abs().max() <= 1e-6
    assert (lp[~keep] == 0).all()


def test_temperature_is_taken_from_the_micro_batch_when_not_given():
    micro = dict(_micro(), temperature=0.5)
    _, args = prepare_model_inputs(micro)
    assert args.temperature == 0.5
    td = left_right_2_no_padding(make_padded_batch(3, 4, 3, seed=1))
    td.set_non_tensor("temperature", 0.25)
    assert prepare_model_inputs(td)[1].temperature == 0.25
    td["temperature"] = torch.tensor([0.5, 1.0, 2.0])  # per sample, as a (B,) entry of the batch
    _, args = prepare_model_inputs(td)
    lengths = td["input_ids"].offsets().diff()
    assert torch.equal(args.temperature, torch.tensor([0.5, 1.0, 2.0]).repeat_interleave(lengths))


@given(L=st.integers(1, 6), V=st.integers(2, 9), entropy=st.booleans(), seed=st.integers(0, 1000))
@settings(max_examples=25)
def test_token_log_probs_gradients_match_autograd_of_log_softmax(L, V, entropy, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(L, V, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (L,), generator=g)
    temps = torch.rand(L, generator=g, dtype=torch.float64) + 0.5
    lp, ent = token_log_probs(logits, labels, temps, with_entropy=entropy)
    w = torch.randn(L, generator=g, dtype=torch.float64)
    loss = (lp * w).sum() + (ent.sum() if entropy else 0)
    (ours,) = torch.autograd.grad(loss, logits)
    logp = (logits / temps.unsqueeze(1)).log_softmax(-1)
    ref_loss = (logp.gather(1, labels.unsqueeze(1)).squeeze(1) * w).sum()
    if entropy:
        ref_loss = ref_loss - (logp.exp() * logp).sum()
    (ref,) = torch.autograd.grad(ref_loss, logits)
    assert torch.allclose(ours, ref, atol=1e-10)
    assert torch.allclose(lp, logp.gather(1, labels.unsqueeze(1)).squeeze(1), atol=1e-12)


class _BigAllocations(TorchDispatchMode):
    """Counts op outputs of at least ``numel`` elements that are new storage (not an in-place result)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel and t.untyped_storage().data_ptr() not in inputs:
                self.count += 1
        return out


def test_log_probs_materialise_one_extra_tokens_by_vocab_tensor_forward_and_backward():
    T, V = 64, 512
    logits = torch.randn(T, V, requires_grad=True)
    labels = torch.randint(0, V, (T,))
    with _BigAllocations(T * V) as forward:
        lp, _ = token_log_probs(logits, labels, torch.rand(T) + 0.5)
    with _BigAllocations(T * V) as backward:
        lp.sum().backward()
    assert forward.count == 1 and backward.count == 1
    with _BigAllocations(T * V) as reference:
        torch.log_softmax(logits / 0.7, -1).gather(1, labels.unsqueeze(1))
    assert reference.count == 2  # what the plain formulation costs, for contrast


@pytest.mark.parametrize("attn_implementation", ["sdpa", "flash_attention_2"])
def test_adapter_op_count_is_independent_of_batch_size_and_sync_free(attn_implementation, device_path):
    def run(B):
        micro = left_right_2_no_padding(make_padded_batch(B, 6, 5, seed=B))  # nested rows carry their max length
        T = micro["input_ids"].values().shape[0]
        logits = torch.randn(1, -(-T // 8) * 8, VOCAB)
        with OpCounter() as counter:
            inputs, args = prepare_model_inputs(
                micro, temperature=0.9, pad_to_multiple=8, attn_implementation=attn_implementation
            )
            prepare_model_outputs(logits, args, calculate_entropy=True)
        return counter

    run(4)
    small, large = run(8), run(512)
    assert small.by_op == large.by_op
    assert small.syncs == large.syncs == 0


# ---- bad input ------------------------------------------------------------------------------


def test_bad_input_fails_loudly_naming_the_field():
    micro = _micro()
    with pytest.raises(ValueError, match="input_ids"):
        prepare_model_inputs({"input_ids": torch.ones(2, 3, dtype=torch.long), "position_ids": micro["position_ids"]})
    with pytest.raises(ValueError, match="position_ids"):
        other = probe_batch(VOCAB, (4, 4))["position_ids"]
        prepare_model_inputs({"input_ids": micro["input_ids"], "position_ids": other})
    with pytest.raises(ValueError, match="temperature: expected a float, a 0-d tensor or a \\(3,\\)"):
        prepare_model_inputs(micro, temperature=torch.ones(2))
    with pytest.raises(ValueError, match="temperature row 1: expected a finite number > 0, got 0.0"):
        prepare_model_inputs(micro, temperature=torch.tensor([1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="sp_group"):
        prepare_model_inputs(micro, sp_size=2)
    _, args = prepare_model_inputs(micro)
    with pytest.raises(ValueError, match=r"logits: expected \(1, 8, vocab\)"):
        prepare_model_outputs(torch.randn(1, 7, VOCAB), args)


# ---- the leak probe ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2_vl_text"])
def test_leak_probe_flags_default_use_cache_and_passes_the_adapter_inputs(name):
    m = model(name)
    clean = check_isolation(m)
    assert not clean and not clean.leaked and clean.max_change == 0.0, str(clean)
    leaky = check_isolation(m, use_cache=None)  # None: the model's default, as when a caller omits it
    assert leaky and leaky.moved_sequences == [1, 2] and leaky.max_change > 1e-2, str(leaky)
    assert "LEAK" in str(leaky)


def test_leak_probe_flags_attention_that_ignores_boundaries():
    # Without position ids the model numbers the whole row 0..T-1 and sees one long sequence.
    report = check_isolation(model("llama"), position_ids=None)
    assert report.leaked
    # Qwen2-VL looks for boundaries only in row 0 of 4-row position ids: 1-row ids leak there.
    assert check_isolation(model("qwen2_vl_text"), probe_batch(VOCAB)).leaked
    assert not check_isolation(model("qwen2_vl_text"), probe_batch(VOCAB, position_rows=4)).leaked


# ---- FSDP2 on two gloo processes --------------------------------------------------------------


def _fsdp_batch(rank):
    return make_padded_batch(3, 6, 5, seed=100 + rank)


def _fsdp2_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    m = tiny_llama()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in m.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    td = _fsdp_batch(rank)
    micro = left_right_2_no_padding(td)
    lp = packed_logprobs(m, micro, 0.9)
    no_padding_2_padding(lp, micro).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    return lp.values().detach(), grads


@pytest.mark.slow
def test_fsdp2_fully_shard_two_processes_matches_one_process():
    results = run_distributed(_fsdp2_worker, 2)
    m = tiny_llama()
    expected_grads = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
    for rank, (lp, _) in enumerate(results):
        micro = left_right_2_no_padding(_fsdp_batch(rank))
        m.zero_grad()
        ref = packed_logprobs(m, micro, 0.9)
        no_padding_2_padding(ref, micro).sum().backward()
        assert torch.equal(lp, ref.values().detach())
        for n, p in m.named_parameters():
            expected_grads[n] += p.grad / len(results)  # FSDP averages gradients over its ranks
    for _, grads in results:
        for n, g in grads.items():
            assert torch.allclose(g, expected_grads[n], atol=TOL), n


def test_padded_reference_a_few_rows_per_forward_equals_one_forward():
    td = make_padded_batch(5, 6, 5, seed=1)
    temperature = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0])
    with torch.no_grad():
        whole = padded_logprobs(model("llama"), td, temperature)
        assert torch.equal(padded_logprobs(model("llama"), td, temperature, rows_per_forward=2), whole)
        assert torch.equal(
            padded_logprobs(model("llama"), td, 0.7, rows_per_forward=3), padded_logprobs(model("llama"), td, 0.7)
        )
