"""nopad.integrations.trl against TRL 1.16's own ``_get_per_token_logps_and_entropies`` (GRPO and RLOO).

The replaced method is called directly on a padded GRPO batch (prompts left-padded, completions
right-padded, long-tailed completion lengths, num_generations=4, a prompt of one token) and must
equal TRL's to 1e-5 in float32: log-probs, entropies and the parameter gradients of a weighted sum,
on a Llama-style and a Qwen3.5-style (gated delta net hybrid) tiny random-weight model. Then the
handle (install / uninstall restore TRL's method) and the refusals (every argument nopad does not
serve is a ValueError naming it). Skipped without TRL unless NOPAD_REQUIRE_TRL=1.
"""

from __future__ import annotations

import collections
import contextlib
import os
import types

import pytest
import torch

try:
    from accelerate import Accelerator
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.rloo_trainer import RLOOTrainer
    from trl.trainer.sft_trainer import SFTTrainer
    from trl.trainer.utils import add_fused_lm_head
except Exception as exc:  # noqa: BLE001 - any failure to import TRL means these tests cannot run
    if os.environ.get("NOPAD_REQUIRE_TRL") == "1":
        raise
    pytest.skip(f"trl is not importable here ({exc!r})", allow_module_level=True)

from nopad.integrations import trl as nopad_trl  # noqa: E402
from nopad.integrations.trl import _install  # noqa: E402  # private: the active patch, the checkpoint test, the call count
from nopad.synthetic import tiny_causal_lm  # noqa: E402

METHOD = "_get_per_token_logps_and_entropies"
TRAINERS = (GRPOTrainer, RLOOTrainer)
VOCAB, TOL = 97, 1e-5


@pytest.fixture(autouse=True)
def _no_patch_left_behind():
    yield
    nopad_trl.uninstall()


def trl_method(cls: type):
    """TRL's own method, whatever is installed now."""
    patch = _install._ACTIVE
    if patch is not None and cls in patch.originals:
        return patch.originals[cls]
    return cls.__dict__[METHOD]


def fake_trainer(temperature: float = 0.7, cast_lm_head_to_fp32: bool = False, accelerator=None):
    """What the method reads of its trainer: the accelerator (autocast, unwrap), temperature, args."""
    return types.SimpleNamespace(
        accelerator=accelerator if accelerator is not None else Accelerator(cpu=True),
        temperature=temperature,
        args=types.SimpleNamespace(cast_lm_head_to_fp32=cast_lm_head_to_fp32),
    )


def causal_lm(arch: str, vocab: int) -> torch.nn.Module:
    """A tiny random-weight causal LM: nopad.synthetic's families, and two Mixture-of-Experts ones built
    here (Qwen3-MoE, Qwen2-MoE with its shared expert; every layer sparse, 4 experts, top 2), whose
    configs carry output_router_logits and a router_aux_loss_coef (raised to 0.05), so TRL computes
    the load-balancing loss."""
    if arch not in ("qwen3_moe", "qwen2_moe"):
        return tiny_causal_lm(arch, vocab=vocab, hidden=32, layers=2, seed=0)
    import transformers

    torch.manual_seed(0)
    config = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        router_aux_loss_coef=0.05,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config)).eval()
    config["shared_expert_intermediate_size"] = 32
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**config)).eval()


def model_of(arch: str, temperature: float = 0.7) -> torch.nn.Module:
    """A tiny random-weight model with TRL's fused head added, as GRPOTrainer's __init__ does."""
    model = causal_lm(arch, VOCAB)
    model.train()
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    return model


def grpo_batch(num_generations: int = 4, seed: int = 0):
    """A GRPO batch as TRL pads it: 3 prompts (lengths 1, 5, 3) each repeated num_generations times,
    prompts left-padded to P, completions right-padded to C, long-tailed completion lengths (most
    short, one of the full width C, one empty as a truncated completion whose mask TRL zeroes)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = [1, 5, 3]
    P, C = max(prompt_lens), 24
    rows = len(prompt_lens) * num_generations
    lengths = (torch.distributions.Exponential(0.4).sample((rows,)).ceil().long()).clamp(1, C)
    lengths[0], lengths[-1] = C, 0
    input_ids = torch.randint(1, VOCAB, (rows, P + C), generator=g)
    mask = torch.zeros(rows, P + C, dtype=torch.long)
    for i in range(rows):
        p = prompt_lens[i // num_generations]
        input_ids[i, P - p : P] = input_ids[(i // num_generations) * num_generations, P - p : P]
        mask[i, P - p : P] = 1
        mask[i, P : P + int(lengths[i])] = 1
    return input_ids.masked_fill(mask == 0, 0), mask, C


def run(method, trainer, model, input_ids, mask, C, **kwargs):
    model.zero_grad(set_to_none=True)
    logps, entropies, aux = method(trainer, model, input_ids, mask, C, compute_entropy=True, **kwargs)
    weights = torch.linspace(-1.0, 1.0, logps.numel()).view_as(logps)
    (logps * weights).sum().add((entropies * weights.flip(0)).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), entropies.detach(), aux, grads


@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
@pytest.mark.parametrize("batch_size", [None, 5])
def test_packed_method_equals_trl_s_own_log_probs_entropies_and_gradients(cls, arch, batch_size):
    torch.manual_seed(0)
    model, trainer = model_of(arch), fake_trainer()
    input_ids, mask, C = grpo_batch()
    ref = run(trl_method(cls), trainer, model, input_ids, mask, C, batch_size=batch_size)
    with nopad_trl.install():
        ours = run(getattr(cls, METHOD), trainer, model, input_ids, mask, C, batch_size=batch_size)
    assert ours[0].shape == ref[0].shape == (input_ids.shape[0], C)
    assert ours[0].dtype == ref[0].dtype and ours[2] is None and ref[2] is None
    assert (ours[0][mask[:, -C:] == 0] == 0).all() and (ours[1][mask[:, -C:] == 0] == 0).all()
    torch.testing.assert_close(ours[0], ref[0], atol=TOL, rtol=0)
    torch.testing.assert_close(ours[1], ref[1], atol=TOL, rtol=0)
    assert ours[3].keys() == ref[3].keys() and ref[3]
    for name in ref[3]:
        torch.testing.assert_close(ours[3][name], ref[3][name], atol=TOL, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_batch_size_becomes_a_token_budget_fewer_tokens_per_forward_same_results(arch, monkeypatch):
    """TRL's batch_size=5 cuts the 12 rows into chunks of 49, 32 and 8 real tokens (the completion of
    the full width and the long prompts in the first); installed, the rows are cut, in order, into
    at most as many packed forwards with as few tokens in the largest as such a cut allows: 30, 28
    and 31. Log-probs, entropies and gradients equal TRL's to 1e-5."""
    model, trainer = model_of(arch), fake_trainer()
    torch.manual_seed(0)  # grpo_batch draws the completion lengths from torch's global generator
    input_ids, mask, C = grpo_batch(seed=0)
    lengths = mask.sum(-1)
    trl_chunks = [int(lengths[start : start + 5].sum()) for start in range(0, 12, 5)]
    assert trl_chunks == [49, 32, 8]
    forwards = []
    convert = _install.left_right_2_no_padding
    monkeypatch.setattr(
        _install,
        "left_right_2_no_padding",
        lambda data: forwards.append(int(data["attention_mask"].sum())) or convert(data),
    )
    ref = run(trl_method(GRPOTrainer), trainer, model, input_ids, mask, C, batch_size=5)
    with nopad_trl.install():
        ours = run(GRPOTrainer._get_per_token_logps_and_entropies, trainer, model, input_ids, mask, C, batch_size=5)
    print(arch, "tokens per forward: TRL's row chunks", trl_chunks, "installed", forwards)
    assert forwards == [30, 28, 31] and sum(forwards) == int(lengths.sum())
    torch.testing.assert_close(ours[0], ref[0], atol=TOL, rtol=0)
    torch.testing.assert_close(ours[1], ref[1], atol=TOL, rtol=0)
    assert ours[3].keys() == ref[3].keys() and ref[3]
    for name in ref[3]:
        torch.testing.assert_close(ours[3][name], ref[3][name], atol=TOL, rtol=1e-4, msg=name)
    forwards.clear()  # one chunk asked (batch_size None): one forward, as before
    with nopad_trl.install(), torch.no_grad():
        GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)
    assert forwards == [int(lengths.sum())]


def test_token_budget_cut_never_needs_more_forwards_nor_more_tokens_than_trl_s_chunks():
    def cut(lengths, batch_size, keep_rows=False):
        mask = torch.zeros(len(lengths), max(lengths) + 1, dtype=torch.long)
        for row, length in enumerate(lengths):
            mask[row, mask.shape[1] - length :] = 1
        chunks = _install.token_budget_chunks(mask, batch_size, keep_rows=keep_rows)
        assert [b for _, b in chunks[:-1]] == [a for a, _ in chunks[1:]] and chunks[0][0] == 0
        assert chunks[-1][1] == len(lengths)  # the rows in order, each once
        return [sum(lengths[a:b]) for a, b in chunks]

    assert cut([25, 1, 1, 1, 1, 1], 2) == [25, 5]  # TRL's: 26, 2, 2
    assert cut([4] * 6, 2) == [8, 8, 8]  # balanced already: TRL's chunks
    assert cut([1, 1, 1, 1, 30, 30], 2) == [4, 30, 30]  # TRL's: 2, 2, 60
    assert cut([3, 9, 2], 5) == [14]  # one chunk asked
    assert cut([25, 1, 1, 1, 1, 1], 2, keep_rows=True) == [26, 2, 2]  # the MoE aux loss: TRL's chunks


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "qwen3_next"])
def test_moe_router_aux_loss_equals_trl_s_own(arch):
    """compute_aux_loss=True: TRL's fused head takes transformers' load-balancing loss over the router
    logits of each row chunk with its attention mask, then the chunks' mean; nopad takes the same
    function over the packed chunk's router logits without a mask (the row holds exactly the real
    tokens). The loss, and the gradients of a sum that weighs it in, agree with TRL's to 1e-5, on
    Qwen3-MoE, Qwen2-MoE (a shared expert) and Qwen3-Next (MoE on gated delta nets and attention)."""
    model, trainer = model_of(arch), fake_trainer()
    input_ids, mask, C = grpo_batch(seed=4)
    method = GRPOTrainer._get_per_token_logps_and_entropies

    def scored(method, batch_size):
        model.zero_grad(set_to_none=True)
        logps, entropies, aux = method(
            trainer, model, input_ids, mask, C, batch_size=batch_size, compute_entropy=True, compute_aux_loss=True
        )
        (logps * torch.linspace(-1.0, 1.0, logps.numel()).view_as(logps)).sum().add(aux).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return logps.detach(), entropies.detach(), aux.detach(), grads

    results = {}
    for batch_size in (None, 5):
        ref = scored(trl_method(GRPOTrainer), batch_size)
        with nopad_trl.install():
            ours = scored(method, batch_size)
        assert ours[2].shape == ref[2].shape == () and ours[2].dtype == ref[2].dtype
        torch.testing.assert_close(ours[2], ref[2], atol=TOL, rtol=0)
        torch.testing.assert_close(ours[0], ref[0], atol=TOL, rtol=0)
        torch.testing.assert_close(ours[1], ref[1], atol=TOL, rtol=0)
        assert ours[3].keys() == ref[3].keys()
        assert any("gate" in name for name in ref[3])  # the routers take the aux loss's gradient
        for name in ref[3]:
            torch.testing.assert_close(ours[3][name], ref[3][name], atol=TOL, rtol=1e-4, msg=name)
        results[batch_size] = float(ours[2])
    print(arch, "aux loss, one chunk and chunks of 5 rows:", results)
    assert abs(results[None] - results[5]) > 1e-4  # TRL's row chunks kept: the loss is the chunks' mean


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_checkpointed_model_recomputes_packed_in_backward_and_is_restored_after(arch):
    """GRPOConfig checkpoints activations by default: the layers recompute in backward, after the
    forward returned; the packed attention must still be in place then, and gone after."""
    torch.manual_seed(0)
    model, trainer = model_of(arch), fake_trainer()
    model.gradient_checkpointing_enable()
    implementation = model.config._attn_implementation
    input_ids, mask, C = grpo_batch(seed=2)
    ref = run(trl_method(GRPOTrainer), trainer, model, input_ids, mask, C, batch_size=5)
    with nopad_trl.install():
        ours = run(GRPOTrainer._get_per_token_logps_and_entropies, trainer, model, input_ids, mask, C, batch_size=5)
        assert model.config._attn_implementation == implementation  # released once backward passed
        with torch.no_grad():  # the old-policy / reference forwards: nothing held
            plain = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)[0]
        assert model.config._attn_implementation == implementation
        # a forward whose backward never comes: released at the next call, before its forward
        GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)
        assert model.config._attn_implementation != implementation
        GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)[0].sum().backward()
        assert model.config._attn_implementation == implementation
        holed = mask.clone()
        holed[0, -C + 2] = 0  # refused while converting, after the switch: the model is put back at once
        with pytest.raises(ValueError, match="attention_mask row 0"):
            GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, holed, C)
        assert model.config._attn_implementation == implementation
    torch.testing.assert_close(plain, ref[0], atol=TOL, rtol=0)
    torch.testing.assert_close(ours[0], ref[0], atol=TOL, rtol=0)
    torch.testing.assert_close(ours[1], ref[1], atol=TOL, rtol=0)
    assert ours[3].keys() == ref[3].keys() and ref[3]
    for name in ref[3]:
        torch.testing.assert_close(ours[3][name], ref[3][name], atol=TOL, rtol=1e-4, msg=name)


def test_entropy_not_asked_is_none_and_log_probs_equal():
    model, trainer = model_of("llama"), fake_trainer()
    input_ids, mask, C = grpo_batch(seed=1)
    with torch.no_grad():
        ref, ref_entropy, _ = trl_method(GRPOTrainer)(trainer, model, input_ids, mask, C)
        with nopad_trl.install():
            ours, entropy, aux = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)
    assert entropy is None and ref_entropy is None and aux is None
    torch.testing.assert_close(ours, ref, atol=TOL, rtol=0)


def test_install_replaces_both_trainers_and_uninstall_restores_trl_s_method():
    originals = {cls: cls.__dict__[METHOD] for cls in TRAINERS}
    steps = {name: SFTTrainer.__dict__[name] for name in ("training_step", "prediction_step")}
    patch = nopad_trl.install()
    assert patch.active and patch.trainers == ["GRPOTrainer", "RLOOTrainer", "SFTTrainer"]
    assert all(SFTTrainer.__dict__[name] is not step for name, step in steps.items())
    assert nopad_trl.install() is patch  # idempotent
    for cls in TRAINERS:
        assert cls.__dict__[METHOD] is not originals[cls]
        assert patch.originals[cls] is originals[cls]
        assert getattr(cls, METHOD).__name__ == METHOD  # TRL's profiling names its timings by it
    patch.uninstall()
    assert not patch.active
    for cls in TRAINERS:
        assert cls.__dict__[METHOD] is originals[cls]
    patch.uninstall()  # idempotent
    with nopad_trl.install() as scoped:
        assert scoped.active and GRPOTrainer.__dict__[METHOD] is not originals[GRPOTrainer]
    assert all(cls.__dict__[METHOD] is originals[cls] for cls in TRAINERS)
    nopad_trl.install()
    nopad_trl.uninstall()  # the module-level undo
    assert all(cls.__dict__[METHOD] is originals[cls] for cls in TRAINERS)
    assert all(SFTTrainer.__dict__[name] is step for name, step in steps.items())


def test_install_refuses_a_trl_method_with_parameters_it_does_not_know(monkeypatch):
    original = GRPOTrainer.__dict__[METHOD]

    def newer(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, new_option=None):
        return original(self, model, input_ids, attention_mask, logits_to_keep, batch_size)

    monkeypatch.setattr(GRPOTrainer, METHOD, newer)
    with pytest.raises(RuntimeError, match="new_option"):
        nopad_trl.install()
    assert GRPOTrainer.__dict__[METHOD] is newer and RLOOTrainer.__dict__[METHOD] is trl_method(RLOOTrainer)
    with pytest.raises(ValueError, match="check_version"):
        nopad_trl.install(check_version="no")
    monkeypatch.undo()

    def later_step(self, model, batch, num_items_in_batch=None):  # SFTTrainer's step, its batch renamed
        return None

    monkeypatch.setattr(SFTTrainer, "prediction_step", later_step)
    with pytest.raises(RuntimeError, match="SFTTrainer.prediction_step"):
        nopad_trl.install()
    assert SFTTrainer.__dict__["prediction_step"] is later_step and GRPOTrainer.__dict__[METHOD] is original


VISION = {
    "pixel_values": torch.zeros(1, 3),
    "image_grid_thw": torch.ones(1, 3, dtype=torch.long),
    "num_images": [1] * 12,
    "pixel_attention_mask": torch.ones(1, 3),
    "spatial_shapes": torch.ones(1, 2),
    "num_tiles": [1] * 12,
    "image_sizes": torch.ones(1, 2),
    "token_type_ids": torch.zeros(12, 29, dtype=torch.long),
    "mm_token_type_ids": torch.zeros(12, 29, dtype=torch.long),
    "image_position_ids": torch.zeros(1, 3),
}


@pytest.mark.parametrize("name", sorted(VISION))
def test_every_input_nopad_does_not_serve_is_refused_by_name(name):
    model, trainer = model_of("llama"), fake_trainer()
    input_ids, mask, C = grpo_batch()
    nopad_trl.install()
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C, **{name: VISION[name]})


def test_aux_loss_head_precision_wrapped_models_and_bad_arguments_are_refused_by_name():
    model, trainer = model_of("llama"), fake_trainer()
    input_ids, mask, C = grpo_batch()
    nopad_trl.install()
    method = GRPOTrainer._get_per_token_logps_and_entropies
    with pytest.raises(ValueError, match="compute_aux_loss"):  # not a Mixture-of-Experts model
        method(trainer, model, input_ids, mask, C, compute_aux_loss=True)
    with pytest.raises(ValueError, match="compute_aux_loss"):
        method(trainer, model, input_ids, mask, C, compute_aux_loss="yes")
    for bad in (0, input_ids.shape[1], 2.0, True):
        with pytest.raises(ValueError, match="logits_to_keep"):
            method(trainer, model, input_ids, mask, bad)
    with pytest.raises(ValueError, match="batch_size"):
        method(trainer, model, input_ids, mask, C, batch_size=-1)
    with pytest.raises(ValueError, match="attention_mask"):
        method(trainer, model, input_ids, mask[:, 1:], C)
    with pytest.raises(ValueError, match="compute_entropy"):
        method(trainer, model, input_ids, mask, C, compute_entropy="yes")
    # TRL's cast_lm_head_to_fp32: served where the head is float32 without mixed precision, else refused
    fp32 = method(fake_trainer(cast_lm_head_to_fp32=True), model, input_ids, mask, C)[0]
    torch.testing.assert_close(fp32, method(trainer, model, input_ids, mask, C)[0], atol=0, rtol=0)
    model.lm_head.to(torch.bfloat16)
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32"):
        method(fake_trainer(cast_lm_head_to_fp32=True), model, input_ids, mask, C)
    model.lm_head.float()

    class Wrapping:  # an accelerator whose unwrap_model finds a model inside the one TRL passes (DDP, ...)
        is_main_process = True

        def __init__(self, inner):
            self.inner = inner

        def unwrap_model(self, model):
            return self.inner

        def autocast(self):
            return torch.autocast("cpu", enabled=False)

    wrapper = torch.nn.Module()
    with pytest.raises(ValueError, match=r"^nopad\.integrations\.trl: model"):
        method(fake_trainer(accelerator=Wrapping(model)), wrapper, input_ids, mask, C)
    # a row nopad cannot convert (a hole inside the completion) is refused by name, never guessed
    holed = mask.clone()
    holed[0, -C + 2] = 0
    with pytest.raises(ValueError, match="attention_mask row 0"):
        method(trainer, model, input_ids, holed, C)


# --- PEFT adapters: the model TRL passes is a PeftModel -----------------------------------------------


def need_peft() -> None:
    """PEFT's tests skip without peft, unless NOPAD_REQUIRE_TRL=1 (CI's trl leg installs it)."""
    if os.environ.get("NOPAD_REQUIRE_TRL") == "1":
        import peft  # noqa: F401
    else:
        pytest.importorskip("peft")


def peft_model_of(arch: str, adapter: str):
    """model_of's model with a PEFT adapter (weights not at their no-op init: the adapter changes the
    log-probs), as GRPOTrainer wraps it (its fused head added first)."""
    import peft

    torch.manual_seed(1)
    configs = {
        "lora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
        "dora": lambda: peft.LoraConfig(
            r=4, target_modules="all-linear", use_dora=True, init_lora_weights=False, task_type="CAUSAL_LM"
        ),
        "ia3": lambda: peft.IA3Config(
            target_modules=["down_proj", "k_proj", "v_proj"], feedforward_modules=["down_proj"], init_ia3_weights=False
        ),
        "prompt": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
        "prefix": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
        "lm_head": lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False),
    }
    return peft.get_peft_model(model_of(arch), configs[adapter]())


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
@pytest.mark.parametrize("adapter", ["lora", "dora", "ia3"])
def test_peft_adapters_equal_trl_s_own_with_the_adapter_and_with_it_disabled(arch, adapter):
    """PEFT's adapters that wrap the layers in place run within the packed forward: log-probs,
    entropies and the adapter's gradients equal TRL's own method on the PeftModel, and so do the
    log-probs with the adapter disabled (TRL's reference model under PEFT)."""
    need_peft()
    model, trainer = peft_model_of(arch, adapter), fake_trainer()
    input_ids, mask, C = grpo_batch(seed=3)
    ref = run(trl_method(GRPOTrainer), trainer, model, input_ids, mask, C, batch_size=5)
    with torch.no_grad(), model.disable_adapter():
        ref_base = trl_method(GRPOTrainer)(trainer, model, input_ids, mask, C)[0]
    assert (ref[0] - ref_base).abs().max() > 1e-3  # the adapter is in the log-probs
    with nopad_trl.install():
        ours = run(GRPOTrainer._get_per_token_logps_and_entropies, trainer, model, input_ids, mask, C, batch_size=5)
        with torch.no_grad(), model.disable_adapter():
            ours_base = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)[0]
    torch.testing.assert_close(ours[0], ref[0], atol=TOL, rtol=0)
    torch.testing.assert_close(ours[1], ref[1], atol=TOL, rtol=0)
    torch.testing.assert_close(ours_base, ref_base, atol=TOL, rtol=0)
    assert ours[3].keys() == ref[3].keys() and ref[3]
    assert all(".lora_" in name or ".ia3_" in name for name in ref[3]), sorted(ref[3])  # the base is frozen
    for name in ref[3]:
        torch.testing.assert_close(ours[3][name], ref[3][name], atol=TOL, rtol=1e-4, msg=name)


@pytest.mark.parametrize("adapter", ["prompt", "prefix", "lm_head"])
def test_peft_adapters_nopad_cannot_run_packed_are_refused_by_name(adapter):
    """Prompt and prefix tuning put virtual tokens (or keys) before each row: a packed row holds many
    sequences. An adapter on the output layer is left out by TRL's head (TRL refuses it at init)."""
    need_peft()
    model, trainer = peft_model_of("llama", adapter), fake_trainer()
    input_ids, mask, C = grpo_batch()
    nopad_trl.install()
    expected = "around the output layer" if adapter == "lm_head" else f"{adapter.upper()}_TUNING adapter"
    with pytest.raises(ValueError, match=rf"^nopad\.integrations\.trl: model: .*{expected}"):
        GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)


def test_peft_adapter_on_a_conv_the_layer_reads_by_weight_is_left_out_alone_and_installed_alike():
    """A gated delta net hands ``conv1d.weight`` to its conv function: a LoRA on ``conv1d`` is in no
    forward, TRL's alone or nopad's; the results agree, and only the other adapter takes gradients."""
    need_peft()
    import peft

    torch.manual_seed(1)
    config = peft.LoraConfig(r=64, target_modules=["conv1d", "q_proj"], init_lora_weights=False)  # r % groups == 0
    model, trainer = peft.get_peft_model(model_of("qwen3_5"), config), fake_trainer()
    assert any(name.endswith("conv1d.lora_A.default.weight") for name, _ in model.named_parameters())
    input_ids, mask, C = grpo_batch(seed=3)
    ref = run(trl_method(GRPOTrainer), trainer, model, input_ids, mask, C)
    with nopad_trl.install():
        ours = run(GRPOTrainer._get_per_token_logps_and_entropies, trainer, model, input_ids, mask, C)
    torch.testing.assert_close(ours[0], ref[0], atol=TOL, rtol=0)
    torch.testing.assert_close(ours[1], ref[1], atol=TOL, rtol=0)
    assert ours[3].keys() == ref[3].keys() and ref[3] and not any("conv1d" in name for name in ref[3])
    for name in ref[3]:
        torch.testing.assert_close(ours[3][name], ref[3][name], atol=TOL, rtol=1e-4, msg=name)


def test_a_model_fsdp2_sharded_is_refused_by_name(tmp_path):
    """FSDP2's fully_shard swaps the classes of the modules it shards in place, so accelerate hands
    the model over as it is: refused by name (not run under TRL here), in GRPO's method and SFT's step."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, trainer = model_of("llama"), fake_trainer()
        for layer in model.model.layers:
            fully_shard(layer)
        input_ids, mask, C = grpo_batch()
        nopad_trl.install()
        with pytest.raises(
            ValueError, match=r"^nopad\.integrations\.trl: model: .*FSDP2 sharded \(FSDPLlamaDecoderLayer"
        ):
            GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)
        sft = types.SimpleNamespace(padding_free=True, accelerator=trainer.accelerator)
        with pytest.raises(ValueError, match=r"^nopad\.integrations\.trl: SFTTrainer model: .*FSDP2 sharded"):
            SFTTrainer.training_step(sft, model, {})
    finally:
        dist.destroy_process_group()


# --- TRL's trainers driven end to end: alone, then with install(), the same seed --------------------

WORDS = ["<pad>", "<eos>", "<unk>"] + [chr(ord("a") + i) for i in range(17)]
PROMPTS = ["a", "b c d e", "f g", "h i j k l m", "n", "o p q"]  # "a": a prompt of one token


def word_tokenizer():
    """A word-level tokenizer built here (no download), with pad and eos tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def length_reward(completions, **kwargs):
    return [len(c.split()) / 10 for c in completions]


def drive(kind: str, arch: str, tmp_path, packed: bool | str, monkeypatch, **overrides):
    """Two steps of TRL's GRPO or RLOO trainer on CPU; returns (log history, grads before each
    optimizer step, weights after each step, packed forwards run, what the trainer used: generation
    batches, old and reference log-probs handed to the loss, entropy masks). The reference model
    (beta > 0) is loaded by TRL from the tiny model saved under tmp_path (the policy's name_or_path).
    ``packed``: False alone, True installed, "shared" installed with ``share_prefixes=True``;
    ``overrides``: more fields of the trainer's config (``torch_compile``, ...)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, RLOOConfig

    module = _install

    saved = tmp_path / f"{arch}-model"
    model = causal_lm(arch, len(WORDS))
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id = 0, 1
    if not saved.exists():
        model.save_pretrained(saved)
    model.config._name_or_path = str(saved)

    class Record(TrainerCallback):
        grads: list = []
        weights: list = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
            assert _install.checkpointed(model)  # TRL's default: the layers recomputed in this backward

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.weights.append({k: p.detach().clone() for k, p in model.named_parameters()})

    calls = []
    counted = module.packed_logprobs
    monkeypatch.setattr(module, "packed_logprobs", lambda *a, **k: calls.append(1) or counted(*a, **k))
    common = dict(
        output_dir=str(tmp_path / f"{kind}-{arch}-{packed}"),
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,  # truncates: about a third of the completions are cut
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        seed=7,
        save_strategy="no",
        # gradient_checkpointing left at TRL's default (on): the layers recompute packed in backward
        optim="sgd",  # weights differ by lr x the gradients' difference (Adam would amplify the near-zero ones)
        learning_rate=0.1,
        temperature=0.7,  # TRL divides the logits by it, in generation and in the log-probs
        bf16=False,  # float32: TRL's configs turn bf16 autocast on by default
        **overrides,
    )
    record = Record()
    record.grads, record.weights = [], []
    peft_config = None
    if kind.endswith("-lora"):  # TRL wraps the model in PEFT's LoRA; the reference is the adapter disabled
        need_peft()
        from peft import LoraConfig

        # init_lora_weights=False: B random, not 0, so the policy differs from the reference from step 1
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        kind = kind.removesuffix("-lora")
    if kind == "grpo":
        args = GRPOConfig(**common, beta=0.04, num_iterations=2)  # a reference model and old log-probs
        trainer_cls = GRPOTrainer
    elif kind == "grpo-masks":  # entropy masking, and truncated completions masked out (prompt-only rows)
        args = GRPOConfig(**common, top_entropy_quantile=0.2, mask_truncated_completions=True)
        trainer_cls = GRPOTrainer
    elif kind == "rloo":
        args = RLOOConfig(**common)  # beta 0.05 by default: a reference model
        trainer_cls = RLOOTrainer
    else:  # "rloo-iterations": one generation batch, two optimizer passes (its old log-probs now differ)
        args = RLOOConfig(**common, num_iterations=2, mask_truncated_completions=True)
        trainer_cls = RLOOTrainer
    trainer = trainer_cls(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
        processing_class=word_tokenizer(),
        callbacks=[record],
        peft_config=peft_config,
    )
    used = collections.Counter()  # the options in force, seen where the trainer uses them
    generate = trainer._generate_and_score_completions

    def recording_generate(*a, **k):
        output = generate(*a, **k)
        used["generations"] += 1
        used.update(key for key in ("old_per_token_logps", "ref_per_token_logps") if output.get(key) is not None)
        return output

    trainer._generate_and_score_completions = recording_generate
    if peft_config is not None:  # the reference log-probs: TRL's policy with its adapter disabled
        assert trainer.ref_model is None and type(trainer.model).__name__.startswith("Peft")
        disable_adapter = trainer.model.disable_adapter
        trainer.model.disable_adapter = lambda: used.update(["adapter_disabled"]) or disable_adapter()
    if trainer_cls is GRPOTrainer:
        entropy_mask = trainer.get_high_entropy_mask
        trainer.get_high_entropy_mask = lambda *a, **k: used.update(["entropy_mask"]) or entropy_mask(*a, **k)
    if packed:
        with nopad_trl.install(share_prefixes=packed == "shared"):
            trainer.train()
    else:
        trainer.train()
    return trainer.state.log_history, record.grads, record.weights, len(calls), used


TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


# what each kind must have put in force (seen by drive), beyond a reference model (beta > 0, "kl"
# logged) and completions that max_completion_length truncates, which all have
IN_FORCE = {
    # num_iterations=2: one generation batch for the two steps, its old and reference log-probs
    "grpo": {"generations": 1, "old_per_token_logps": 1, "ref_per_token_logps": 1},
    "grpo-masks": {"generations": 2, "entropy_mask": 2},  # top_entropy_quantile=0.2
    "rloo": {"generations": 2},
    "rloo-iterations": {"generations": 1},  # num_iterations=2: the second step reuses the batch
    # as "grpo" and "rloo", the policy a PEFT LoRA model: the reference is it with the adapter disabled
    "grpo-lora": {"generations": 1, "old_per_token_logps": 1, "ref_per_token_logps": 1, "adapter_disabled": 1},
    "rloo-lora": {"generations": 2, "adapter_disabled": 2},
}


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
@pytest.mark.parametrize("kind", ["grpo", "grpo-masks", "rloo", "rloo-iterations", "grpo-lora", "rloo-lora"])
def test_trl_trainer_two_steps_alone_and_installed_log_the_same_and_train_the_same_weights(
    kind, arch, tmp_path, monkeypatch
):
    two_steps_alike(kind, arch, tmp_path, monkeypatch)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trl_trainer_on_a_moe_model_adds_the_same_router_aux_loss_alone_and_installed(
    kind, arch, tmp_path, monkeypatch
):
    """A Mixture-of-Experts policy: TRL adds router_aux_loss_coef x the load-balancing loss to each
    step's loss (compute_aux_loss=True) and logs it as aux_loss; installed, nopad computes it on the
    packed rows: the logged aux_loss, the loss, the gradients and the weights agree to 1e-5."""
    logs = two_steps_alike(kind, arch, tmp_path, monkeypatch)
    aux = [entry["aux_loss"] for entry in logs if "loss" in entry]
    assert len(aux) == 2 and all(1.0 < value < 4.0 for value in aux), aux  # 2 steps, about top_k


@contextlib.contextmanager
def graph_breaks_seen():
    """torch.compile's graph breaks while the block runs, as (file, source line) of the user code each
    broke in (dynamo's graph_breaks log, read by a handler; nothing printed)."""
    import linecache
    import logging
    import re

    seen: list[tuple[str, str]] = []

    class Record(logging.Handler):
        def emit(self, record):
            found = re.search(r"in user code at (\S+):(\d+)", record.getMessage())
            if found:
                path, line = found.group(1), int(found.group(2))
                seen.append((path, linecache.getline(path, line).strip()))

    logger = logging.getLogger("torch._dynamo.symbolic_convert.__graph_breaks")
    handler = Record()
    torch._logging.set_logs(graph_breaks=True)
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        torch._logging.set_logs()


# Where torch.compile breaks its graph inside nopad's packed forward (a split, not an error: the
# results are the same). It needs no change to TRL or transformers: activation checkpointing's
# gradient hook on the embeddings' output that ends the packed attention switch (torch 2.13 traces a
# hook's body into the graph; this one leaves the switch). The head kernel's lazy import broke it too
# until the kernel's presence was read as a constant at trace time.
NOPAD_GRAPH_BREAKS = {("nopad/integrations/trl/_install.py", "self._handle.remove()")}


def test_trl_trainer_compiled_by_torch_compile_trains_the_same_installed_as_alone(tmp_path, monkeypatch):
    """``torch_compile=True`` (transformers' Trainer has accelerate compile the policy, here with the
    aot_eager backend: TRL hands its loss an OptimizedModule): two GRPO steps alone and installed log
    the same metrics, and the gradients and weights agree to 1e-5; installed, nopad's packed forward
    runs the compiled policy, and breaks its graph only where NOPAD_GRAPH_BREAKS says."""
    import torch._dynamo

    import nopad

    served = []
    packed = _install.packed_logprobs
    monkeypatch.setattr(
        _install, "packed_logprobs", lambda m, *a, **k: served.append(type(m).__name__) or packed(m, *a, **k)
    )
    torch._dynamo.reset()
    try:
        with graph_breaks_seen() as breaks:
            two_steps_alike(
                "grpo", "llama", tmp_path, monkeypatch, torch_compile=True, torch_compile_backend="aot_eager"
            )
    finally:
        torch._dynamo.reset()
    # the policy compiled (TRL's reference model, beta > 0, is not): nopad's forward ran both
    assert collections.Counter(served) == {"OptimizedModule": 3, "LlamaForCausalLM": 1}, served
    root = os.path.dirname(os.path.abspath(nopad.__file__))
    ours = collections.Counter(
        (os.path.relpath(path, os.path.dirname(root)), line) for path, line in breaks if path.startswith(root + os.sep)
    )
    assert set(ours) <= NOPAD_GRAPH_BREAKS, ours
    print("graph breaks in nopad:", dict(ours), "elsewhere:", len(breaks) - sum(ours.values()))


def two_steps_alike(kind, arch, tmp_path, monkeypatch, **overrides):
    """Two steps of ``kind`` alone and installed (``overrides``: more config fields, for both): returns
    TRL's log history once all agrees."""
    logs, grads, weights, calls, used = drive(kind, arch, tmp_path, False, monkeypatch, **overrides)
    assert calls == 0
    logs_nopad, grads_nopad, weights_nopad, calls_nopad, used_nopad = drive(
        kind, arch, tmp_path, True, monkeypatch, **overrides
    )
    assert calls_nopad > 0, "install() did not route the trainer's log-probs to nopad"
    assert used == used_nopad and {k: used[k] for k in IN_FORCE[kind]} == IN_FORCE[kind], used
    steps = [entry for entry in logs if "loss" in entry]
    assert any("kl" in entry for entry in steps) is (kind != "grpo-masks")  # beta > 0 but there
    clipped = [entry["completions/clipped_ratio"] for entry in steps if "completions/clipped_ratio" in entry]
    assert clipped and all(0 < ratio < 1 for ratio in clipped), clipped  # max_completion_length truncates some
    assert len(logs) == len(logs_nopad) == 3 and len(grads) == len(grads_nopad) == 2 == len(weights_nopad)
    assert any("loss" in entry for entry in logs)
    if kind.endswith("-lora"):  # only the adapter trains, and the reference (adapter off) is another model
        assert all(".lora_" in name for step in grads for name in step), sorted(grads[0])
        assert steps[0]["kl"] > 1e-4, steps[0]
    for ours, theirs in zip(logs_nopad, logs):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            if key not in TIMINGS:
                # the norm before clipping (6 to 11 under LoRA's random init) to 1e-5 of its size
                rel = 1e-5 if key == "grad_norm" else 0
                assert ours[key] == pytest.approx(theirs[key], abs=1e-5, rel=rel), (key, ours[key], theirs[key])
    for ours, theirs in (*zip(grads_nopad, grads), *zip(weights_nopad, weights)):
        assert ours.keys() == theirs.keys() and theirs
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=0, msg=name)
    return logs


# --- padding-free SFT (and DPO) on a hybrid: TRL's packed row, routed by install() -------------------

SFT_TEXTS = [  # 12 documents of 2 to 19 words: three batches of 4, each packed into one row padding-free
    " ".join(WORDS[3 + (7 * i + 3 * j) % 17] for j in range(2 + (5 * i) % 18)) for i in range(12)
]
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def sft_drive(tmp_path, padding_free: bool, packed: bool, steps: int = 3, arch: str = "qwen3_5"):
    """``steps`` steps of TRL's SFTTrainer on CPU (TRL's defaults but float32 and plain SGD: activation
    checkpointing on), then one evaluation; returns (log history, weights after each step, eval loss)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig

    model = tiny_causal_lm(arch, vocab=len(WORDS), hidden=32, layers=2, seed=0)
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id = 0, 1
    implementation = model.config._attn_implementation

    class Record(TrainerCallback):
        def __init__(self):
            self.weights = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            assert model.config._attn_implementation == implementation  # as it was, between the steps
            self.weights.append({k: p.detach().clone() for k, p in model.named_parameters()})

    args = SFTConfig(
        output_dir=str(tmp_path / f"sft-{arch}-{padding_free}-{packed}"),
        max_steps=steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        padding_free=padding_free,
        max_length=None,  # padding-free without packing enforces no max_length (TRL refuses one)
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        seed=7,
        save_strategy="no",
        optim="sgd",
        learning_rate=0.1,
        bf16=False,
    )
    record = Record()
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"text": SFT_TEXTS}),
        eval_dataset=Dataset.from_dict({"text": SFT_TEXTS[:8]}),
        processing_class=word_tokenizer(),
        callbacks=[record],
    )
    assert trainer.padding_free is padding_free and args.gradient_checkpointing  # TRL's default: on
    with nopad_trl.install() if packed else contextlib.nullcontext():
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"]
    assert model.config._attn_implementation == implementation
    return trainer.state.log_history, record.weights, eval_loss


def assert_same_training(ours, theirs):
    (logs, weights, eval_loss), (ref_logs, ref_weights, ref_eval_loss) = ours, theirs
    assert len(logs) == len(ref_logs) and len(weights) == len(ref_weights) == 3
    assert sum("loss" in entry for entry in ref_logs) == 3
    for entry, ref in zip(logs, ref_logs):
        assert entry.keys() == ref.keys()
        for key in ref:
            timing = key in TIMINGS or key.endswith(("_runtime", "_per_second"))
            if not timing and key != "total_flos":  # transformers' flos count the padded tokens too
                assert entry[key] == pytest.approx(ref[key], abs=1e-5, rel=0), (key, entry[key], ref[key])
    for step, ref_step in zip(weights, ref_weights):
        for name in ref_step:
            torch.testing.assert_close(step[name], ref_step[name], atol=1e-5, rtol=0, msg=name)
    assert eval_loss == pytest.approx(ref_eval_loss, abs=1e-5, rel=0)


def losses(logs):
    return [entry["loss"] for entry in logs if "loss" in entry]


@pytest.fixture(scope="module")
def padded_sft(tmp_path_factory):
    """TRL alone, padded (padding_free=False), by architecture: a hybrid is exact on right-padded rows."""
    runs = {}

    def run(arch):
        if arch not in runs:
            runs[arch] = sft_drive(tmp_path_factory.mktemp("padded"), padding_free=False, packed=False, arch=arch)
        return runs[arch]

    return run


@pytest.mark.parametrize("arch", ["qwen3_5", "bamba"])
def test_padding_free_sft_on_a_hybrid_installed_trains_as_the_padded_run(arch, padded_sft, tmp_path):
    """Qwen3.5-style (gated delta nets, attention) and Bamba-style (Mamba2, attention): every step's
    loss, grad norm, entropy and token accuracy, the weights after each step and the evaluation loss
    equal the padded run's to 1e-5. Alone, TRL 1.16's packed row reaches transformers' CPU fallbacks
    of the state layers, which refuse its boundaries."""
    padded = padded_sft(arch)
    packed = sft_drive(tmp_path, padding_free=True, packed=True, arch=arch)
    print(f"{arch} SFT losses padded", losses(padded[0]), "padding-free with nopad", losses(packed[0]))
    assert_same_training(packed, padded)
    assert_same_training(sft_drive(tmp_path, padding_free=False, packed=True, arch=arch), padded)  # untouched
    with pytest.raises(ValueError, match="can't keep packed sequences apart"):
        sft_drive(tmp_path, padding_free=True, packed=False, arch=arch)


def test_padding_free_sft_on_a_hybrid_given_only_position_ids_mixes_alone_and_not_installed(
    padded_sft, tmp_path, monkeypatch
):
    """Handed the position ids only (the boundaries dropped from the collator's batch), transformers'
    CPU fallbacks of the gated delta net's conv and scan run across the sequences and train something
    else, without a word. Installed, nopad finds the boundaries in the restarting position ids and
    trains as the padded run."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    padded_sft = padded_sft("qwen3_5")
    collate = DataCollatorForLanguageModeling.torch_call

    def positions_only(self, examples):
        batch = collate(self, examples)
        return {k: v for k, v in batch.items() if k not in BOUNDARY_KEYS}

    monkeypatch.setattr(DataCollatorForLanguageModeling, "torch_call", positions_only)
    mixed = sft_drive(tmp_path, padding_free=True, packed=False)
    print("SFT losses padded", losses(padded_sft[0]), "padding-free without nopad", losses(mixed[0]))
    # the sequences mixed in the conv and the scan: not the padded run, by far more than the 1e-5 the
    # installed run agrees to (small, as a random tiny model's state carries little from one sequence on)
    differences = [abs(a - b) for a, b in zip(losses(mixed[0]), losses(padded_sft[0]))]
    assert max(differences) > 5e-5, differences
    norms = [abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(mixed[0], padded_sft[0]) if "grad_norm" in b]
    assert min(norms) > 1e-3, norms
    weights = max(float((mixed[1][-1][k] - w).abs().max()) for k, w in padded_sft[1][-1].items())
    assert weights > 1e-4, weights
    assert_same_training(sft_drive(tmp_path, padding_free=True, packed=True), padded_sft)


def test_padding_free_sft_refuses_a_seq_idx_that_disagrees_with_the_boundaries(tmp_path, monkeypatch):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling.torch_call

    def shifted(self, examples):
        batch = collate(self, examples)
        return {**batch, "seq_idx": batch["seq_idx"].roll(1, dims=-1)}

    monkeypatch.setattr(DataCollatorForLanguageModeling, "torch_call", shifted)
    with pytest.raises(ValueError, match=r"^nopad\.integrations\.trl: SFTTrainer seq_idx"):
        sft_drive(tmp_path, padding_free=True, packed=True, steps=1)


def test_padding_free_sft_refuses_a_model_accelerate_wrapped():
    accelerator = types.SimpleNamespace(unwrap_model=lambda m: m.module)  # DDP's, say: the model inside
    trainer = types.SimpleNamespace(padding_free=True, accelerator=accelerator)
    wrapper = torch.nn.Module()
    wrapper.module = model_of("qwen3_5")
    nopad_trl.install()
    with pytest.raises(ValueError, match=r"^nopad\.integrations\.trl: SFTTrainer model"):
        SFTTrainer.training_step(trainer, wrapper, {})
    with pytest.raises(ValueError, match=r"^nopad\.integrations\.trl: SFTTrainer model"):
        SFTTrainer.prediction_step(trainer, wrapper, {}, True)


def test_dpo_has_no_padding_free_mode_in_trl_1_16_and_installed_trains_as_alone(tmp_path):
    """TRL 1.16's DPOTrainer turns padding_free=True off (a warning: padded rows, the prompt and the
    completion right-padded): on a hybrid that is exact, and install() leaves DPO as it is."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    def lm():
        model = tiny_causal_lm("qwen3_5", vocab=len(WORDS), hidden=32, layers=2, seed=0)
        for config in (model.config, model.generation_config):
            config.pad_token_id, config.eos_token_id = 0, 1
        return model

    data = {
        "prompt": [t[:5] for t in SFT_TEXTS[:8]],
        "chosen": [t[5:15] or "a" for t in SFT_TEXTS[:8]],
        "rejected": [t[15:] or "b" for t in SFT_TEXTS[:8]],
    }

    def drive(padding_free, packed):
        args = DPOConfig(
            output_dir=str(tmp_path / f"dpo-{padding_free}-{packed}"),
            max_steps=2,
            per_device_train_batch_size=4,
            padding_free=padding_free,
            report_to="none",
            use_cpu=True,
            logging_steps=1,
            seed=7,
            save_strategy="no",
            optim="sgd",
            learning_rate=0.1,
            bf16=False,
        )
        dataset, tokenizer = Dataset.from_dict(data), word_tokenizer()
        trainer = DPOTrainer(model=lm(), ref_model=lm(), args=args, train_dataset=dataset, processing_class=tokenizer)
        assert trainer.padding_free is False  # TRL 1.16: "temporarily unavailable", padded instead
        with nopad_trl.install() if packed else contextlib.nullcontext():
            trainer.train()
        return trainer.state.log_history

    alone, installed = drive(False, False), drive(True, True)
    assert len(losses(alone)) == 2
    for entry, ref in zip(installed, alone):
        for key in ref:
            if key not in TIMINGS:
                assert entry[key] == pytest.approx(ref[key], abs=1e-5, rel=0), key
