"""``nopad.integrations.trl.install(share_prefixes=True)``: a group's shared prompt computed once under
TRL 1.16's GRPOTrainer and RLOOTrainer, equal to the flag off.

The replaced method on a padded GRPO batch (3 prompts x num_generations=4, a prompt of one token,
long-tailed completions, one empty), flag off and on: log-probs, entropies and parameter gradients
equal to 1e-5 in float32 on Llama- and Qwen3.5-style models, with and without ``batch_size`` chunks
and activation checkpointing, under a PEFT LoRA adapter (and with it disabled), and on a
Mixture-of-Experts model whose aux-loss call runs unshared. Then both trainers driven two steps on
CPU, flag off and on, the same seed: every logged metric but the timings, the gradients and the
weights after each step equal to 1e-5, with each call's groups recorded (TRL's loss call hands its
rows shuffled: the groups are found from the tokens, and ``num_generations`` consecutive rows as group
ids would be refused). Skipped without TRL unless NOPAD_REQUIRE_TRL=1.
"""

from __future__ import annotations

import pytest
import torch

import nopad.engines._prefixes as engine_prefixes  # private: the plan each call makes
from nopad.batches._prefixes import plan_shared_prefixes
from tests.test_integration_trl import (  # skips this module too where TRL is absent
    METHOD,
    TOL,
    TRAINERS,
    GRPOTrainer,
    drive,
    fake_trainer,
    grpo_batch,
    model_of,
    need_peft,
    nopad_trl,
    peft_model_of,
    run,
    two_steps_alike,
)


@pytest.fixture(autouse=True)
def _no_patch_left_behind():
    yield
    nopad_trl.uninstall()


@pytest.fixture
def plans(monkeypatch):
    """Every shared-prefix plan made, as (grad enabled, rows, groups, tokens computed, rows' tokens,
    whether num_generations=4 consecutive rows as group ids are refused by the plan)."""
    made = []

    def recording(input_ids, prompt_lengths, **kwargs):
        plan = plan_shared_prefixes(input_ids, prompt_lengths, **kwargs)
        consecutive = torch.arange(plan.rows) // 4
        try:
            plan_shared_prefixes(input_ids, prompt_lengths, group_ids=consecutive)
            refused = False
        except ValueError as error:
            assert str(error).startswith("group_ids row"), error
            refused = True
        made.append((torch.is_grad_enabled(), plan.rows, plan.groups, plan.total, plan.rows_total, refused))
        return plan

    monkeypatch.setattr(engine_prefixes, "plan_shared_prefixes", recording)
    return made


def flag_off_and_on(method_cls, model, trainer, input_ids, mask, C, **kwargs):
    with nopad_trl.install():
        off = run(getattr(method_cls, METHOD), trainer, model, input_ids, mask, C, **kwargs)
    with nopad_trl.install(share_prefixes=True) as patch:
        assert patch.share_prefixes
        on = run(getattr(method_cls, METHOD), trainer, model, input_ids, mask, C, **kwargs)
    return off, on


def assert_same(on, off):
    torch.testing.assert_close(on[0], off[0], atol=TOL, rtol=0)
    torch.testing.assert_close(on[1], off[1], atol=TOL, rtol=0)
    assert on[3].keys() == off[3].keys() and off[3]
    for name in off[3]:
        torch.testing.assert_close(on[3][name], off[3][name], atol=TOL, rtol=1e-4, msg=name)


@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
@pytest.mark.parametrize("batch_size", [None, 5])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_shared_prefixes_equal_the_flag_off(cls, arch, batch_size, checkpointed, plans):
    """12 rows, 3 prompts x 4: one forward computes 3 prompts, not 12 (batch_size=5 cuts the rows into
    3 forwards, a group split across two computes its prompt once in each). Checkpointed, the shared
    attention stays in place until backward has recomputed the layers, and is gone after."""
    torch.manual_seed(0)
    model, trainer = model_of(arch), fake_trainer()
    if checkpointed:
        model.gradient_checkpointing_enable()
    implementation = model.config._attn_implementation
    input_ids, mask, C = grpo_batch()
    off, on = flag_off_and_on(cls, model, trainer, input_ids, mask, C, batch_size=batch_size)
    assert model.config._attn_implementation == implementation
    assert on[0].shape == (12, C) and on[2] is None
    assert (on[0][mask[:, -C:] == 0] == 0).all() and (on[1][mask[:, -C:] == 0] == 0).all()
    assert_same(on, off)
    computed, tokens = sum(p[3] for p in plans), sum(p[4] for p in plans)
    assert tokens == int(mask.sum()) and computed < tokens
    if batch_size is None:
        assert [p[1:3] for p in plans] == [(12, 3)]  # the prompts (1, 5, 3 tokens) once each
        assert computed == tokens - 3 * (1 + 5 + 3)
    print(arch, cls.__name__, batch_size, checkpointed, "tokens computed", computed, "of", tokens)


def test_entropy_not_asked_is_none_and_no_grad_calls_share_too(plans):
    model, trainer = model_of("qwen3_5"), fake_trainer()
    input_ids, mask, C = grpo_batch(seed=1)
    with torch.no_grad():
        with nopad_trl.install():
            off, off_entropy, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)
        with nopad_trl.install(share_prefixes=True):
            on, entropy, aux = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)
    assert entropy is None and off_entropy is None and aux is None
    torch.testing.assert_close(on, off, atol=TOL, rtol=0)
    assert len(plans) == 1 and plans[0][2] == 3


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_peft_lora_shares_and_equals_the_flag_off_with_the_adapter_and_disabled(arch, plans):
    need_peft()
    model, trainer = peft_model_of(arch, "lora"), fake_trainer()
    input_ids, mask, C = grpo_batch(seed=3)
    off, on = flag_off_and_on(GRPOTrainer, model, trainer, input_ids, mask, C, batch_size=5)
    assert_same(on, off)
    assert all(".lora_" in name for name in off[3])
    method = GRPOTrainer._get_per_token_logps_and_entropies
    with torch.no_grad(), model.disable_adapter():
        with nopad_trl.install():
            base_off = method(trainer, model, input_ids, mask, C)[0]
        with nopad_trl.install(share_prefixes=True):
            base_on = method(trainer, model, input_ids, mask, C)[0]
    torch.testing.assert_close(base_on, base_off, atol=TOL, rtol=0)
    assert (base_on - on[0]).abs().max() > 1e-3 and plans and all(p[3] < p[4] for p in plans)


def test_moe_aux_loss_call_runs_unshared_and_equals_the_flag_off(plans):
    """compute_aux_loss=True: TRL's load-balancing loss counts every row's prompt tokens; a shared
    prompt is computed once, so that call runs the unshared packed route (no plan is made)."""
    model, trainer = model_of("qwen3_moe"), fake_trainer()
    input_ids, mask, C = grpo_batch(seed=4)
    off, on = flag_off_and_on(GRPOTrainer, model, trainer, input_ids, mask, C, compute_aux_loss=True)
    torch.testing.assert_close(on[2], off[2], atol=0, rtol=0)
    assert_same(on, off)
    assert plans == []
    with torch.no_grad(), nopad_trl.install(share_prefixes=True):  # without the aux loss: shared
        GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)
    assert len(plans) == 1 and plans[0][2] == 3


def test_share_prefixes_refusals_by_name():
    with pytest.raises(ValueError, match=r"^nopad\.integrations\.trl: share_prefixes"):
        nopad_trl.install(share_prefixes="yes")
    patch = nopad_trl.install()
    assert repr(patch).endswith("share_prefixes=False)")
    with pytest.raises(ValueError, match=r"^nopad\.integrations\.trl: share_prefixes"):
        nopad_trl.install(share_prefixes=True)  # another setting while one is active
    patch.uninstall()
    patch = nopad_trl.install(share_prefixes=True)
    assert nopad_trl.install(share_prefixes=True) is patch and patch.share_prefixes
    # a model the shared layout cannot serve: refused naming its layer, before any forward
    from nopad._apps.families import tiny_model

    model, trainer = tiny_model("mamba"), fake_trainer()  # Mamba's selective scan: no prompt's state
    if isinstance(model, str):
        pytest.skip(model)
    implementation = model.config._attn_implementation
    input_ids, mask, C = grpo_batch()
    input_ids = input_ids % model.config.vocab_size
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match="MambaMixer"):
        GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C)
    assert model.config._attn_implementation == implementation and calls == []
    with pytest.raises(ValueError, match="pixel_values"):  # the vision inputs: refused as without the flag
        GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, mask, C, pixel_values=1)


# --- the trainers driven: flag off, then on, the same seed ------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
@pytest.mark.parametrize("kind", ["grpo", "grpo-masks", "rloo", "rloo-iterations", "grpo-lora", "rloo-lora"])
def test_trl_trainer_two_steps_flag_off_and_on_log_the_same_and_train_the_same_weights(
    kind, arch, tmp_path, monkeypatch, plans
):
    """Two steps of each trainer (GRPO: beta=0.04 with num_iterations=2, entropy masking; RLOO: its
    beta=0.05, num_iterations=2; each with a LoRA policy), installed with the flag off and on: every
    logged metric but the timings, the gradients before each optimizer step and the weights after
    each step agree to 1e-5. Each log-prob call of 8 rows (2 prompts x num_generations=4) computes 2
    prompts: the old-policy and reference calls get the rows in TRL's order, the loss's call gets them
    shuffled (TRL's shuffle_sequence_dict), where 4 consecutive rows as group ids are refused."""
    off = drive(kind, arch, tmp_path, True, monkeypatch)
    assert plans == []
    on = drive(kind, arch, tmp_path, "shared", monkeypatch)
    logs, grads, weights, calls, used = off
    logs_on, grads_on, weights_on, calls_on, used_on = on
    assert calls_on == calls > 0 and used_on == used
    assert len(plans) == calls and all(p[1:3] == (8, 2) and p[3] < p[4] for p in plans), plans
    assert not any(p[5] for p in plans if not p[0])  # TRL's order: consecutive groups
    assert any(p[5] for p in plans if p[0])  # the loss's call: shuffled rows, groups found all the same
    assert len(logs) == len(logs_on) == 3 and len(grads) == len(grads_on) == 2 == len(weights_on)
    for ours, theirs in zip(logs_on, logs):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            if key not in ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"):
                rel = 1e-5 if key == "grad_norm" else 0
                assert ours[key] == pytest.approx(theirs[key], abs=1e-5, rel=rel), (key, ours[key], theirs[key])
    for ours, theirs in (*zip(grads_on, grads), *zip(weights_on, weights)):
        assert ours.keys() == theirs.keys() and theirs
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=0, msg=name)
    computed, tokens = sum(p[3] for p in plans), sum(p[4] for p in plans)
    print(kind, arch, "calls", calls, "tokens computed", computed, "of", tokens, f"({tokens / computed:.2f}x fewer)")


def test_trl_trainer_on_a_moe_model_flag_on_equals_alone(tmp_path, monkeypatch, plans):
    """GRPO on a Mixture-of-Experts policy (the loss's call asks the aux loss, so it runs unshared;
    the old-policy and reference calls share): as TRL alone, to 1e-5 (``two_steps_alike``'s checks)."""
    monkeypatch.setattr(
        "tests.test_integration_trl.drive",
        lambda kind, arch, tmp, packed, mp: drive(kind, arch, tmp, "shared" if packed else False, mp),
    )
    logs = two_steps_alike("grpo", "qwen3_moe", tmp_path, monkeypatch)
    assert len([e for e in logs if "aux_loss" in e]) == 2
    assert plans and all(not p[0] for p in plans)  # only the no-grad calls shared
