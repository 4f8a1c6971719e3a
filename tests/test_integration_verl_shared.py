"""install(share_prefixes=True) under verl's own engine: a GRPO PPO step equal to the flag off.

verl's TrainingWorker on its FSDP engine (FSDP2 over gloo, fp32, 2 CPU ranks, a tiny random-weight
Qwen2: tests/verl_engine.py) runs the trainer's old-log-probs pass and one actor update (verl's
ppo_loss, backward, one optimizer step) on a GRPO-shaped batch (groups of 4 rows with equal prompts),
under install() with the flag off and then on: the log-probs and entropy, the update's loss and
metrics, every parameter's gradient and the weights after the step agree to 1e-5, and with the
flag on every forward went through the shared-prefix layout and computed fewer tokens than the rows
hold. A text-only Qwen3.5 (gated delta nets, transformers 5.10's layer shapes) runs the same step
with the flag on, its log-probs those of each row alone. Multi-process, so marked slow; CI's verl
leg runs them.
"""

from __future__ import annotations

import os

import pytest
import torch

try:
    import verl.workers.engine.fsdp.transformer_impl as transformer_impl
except Exception as exc:  # noqa: BLE001 - any failure to import verl means this leg cannot run
    if os.environ.get("NOPAD_REQUIRE_VERL") == "1":
        raise
    pytest.skip(f"verl is not importable here ({exc!r}); these tests run in CI's verl leg", allow_module_level=True)

import nopad.integrations.verl._shared as shared  # noqa: E402
from nopad.integrations import verl as nopad_verl  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.verl_engine import MEASURED, flag_off_then_on, flag_on, save_tiny_hybrid, save_tiny_model  # noqa: E402

GROUPS_PER_RANK = 2
TOL = 1e-5


def _close(off, on, where: str) -> float:
    """``on`` equals ``off`` to 1e-5 (nested lists / dicts of floats and tensors); returns the largest
    absolute difference seen."""
    if isinstance(off, dict):
        assert list(on) == list(off), where
        return max([_close(off[k], on[k], f"{where}[{k!r}]") for k in off if k not in MEASURED] or [0.0])
    if isinstance(off, (list, tuple)):
        assert len(on) == len(off), where
        return max([_close(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(off, on))] or [0.0])
    if hasattr(off, "aggregate"):  # verl's Metric: its values
        return _close(vars(off), vars(on), where)
    if isinstance(off, torch.Tensor) or isinstance(off, float):
        a, b = torch.as_tensor(off, dtype=torch.float64), torch.as_tensor(on, dtype=torch.float64)
        torch.testing.assert_close(b, a, atol=TOL, rtol=TOL, msg=lambda m: f"{where}: {m}")
        return float((a - b).abs().max()) if a.numel() else 0.0
    assert on == off, where
    return 0.0


@pytest.mark.slow
def test_a_grpo_ppo_step_with_shared_prompts_equals_the_flag_off(tmp_path):
    model_dir = str(tmp_path / "tiny-qwen2")
    save_tiny_model(model_dir)
    ranks = run_distributed(flag_off_then_on, 2, model_dir, GROUPS_PER_RANK)
    report = []
    for dynamic in (False, True):
        where = f"use_dynamic_bsz={dynamic}"
        for rank, r in enumerate(ranks):
            off, on = r["off", dynamic], r["on", dynamic]
            diffs = {key: _close(off[key], on[key], f"{where} rank {rank} {key}") for key in
                     ("old_log_probs", "entropys", "train_metrics", "grads", "weights")}  # fmt: skip
            assert (on["old_log_probs"] != 0).sum() == on["response_mask"].sum(), where  # every response token
            assert all(g.abs().sum() > 0 for g in on["grads"].values()), f"{where}: a parameter had no gradient"
            # every forward (the old log-probs pass and the update's) went through the shared layout
            assert set(r["counts", dynamic]) == {"shared"}, f"{where} rank {rank}: {r['counts', dynamic]}"
            planned = r["planned", dynamic]
            assert len(planned) == r["counts", dynamic]["shared"]
            computed, rows = sum(t for t, _ in planned), sum(n for _, n in planned)
            assert computed < rows, f"{where} rank {rank}: no prompt was shared ({planned})"
            if not dynamic:  # micro-batches of whole groups: every one shares
                assert all(t < n for t, n in planned), f"{where} rank {rank}: {planned}"
            report.append((where, rank, diffs, computed, rows))
    for line in report:
        print(*line)
    print("uid in the engine's micro-batches:", sorted({seen for r in ranks for seen in r["saw_uid"]}))


@pytest.mark.slow
def test_a_hybrids_grpo_step_with_shared_prompts_equals_each_row_alone(tmp_path):
    """A text-only Qwen3.5 (gated delta nets beside attention; transformers 5.10's layer shapes under
    verl's pins): with the flag on every forward takes the shared layout, each response continuing
    from its prompt's final state, and the old log-probs equal each row's own padded
    forward within 1e-5. The reference is the padded forward, not the flag off: verl's own forward
    runs such a model's packed row as one sequence through its gated delta nets (verl patches the
    layer for the qwen3_5 and qwen3_5_moe model types, not for qwen3_5_text)."""
    from transformers import AutoModelForCausalLM

    from nopad.engines import padded_logprobs
    from tests.verl_engine import GROUP, grpo_batch

    model_dir = str(tmp_path / "tiny-qwen3_5")
    save_tiny_hybrid(model_dir, "qwen3_5_text")
    ranks = run_distributed(flag_on, 2, model_dir, GROUPS_PER_RANK)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    batch = grpo_batch(2 * GROUPS_PER_RANK)
    assert len(batch) == 2 * GROUPS_PER_RANK * GROUP
    with torch.no_grad():
        alone = padded_logprobs(model, batch, 0.7)
    for rank, r in enumerate(ranks):
        assert set(r["counts"]) == {"shared"}, f"rank {rank}: {r['counts']}"
        mask = r["response_mask"].bool()
        torch.testing.assert_close(r["old_log_probs"][mask], alone[mask], atol=TOL, rtol=TOL)
        assert all(g.abs().sum() > 0 for g in r["grads"].values()), f"rank {rank}: a parameter had no gradient"


def test_the_flag_patches_verls_engine_only_while_on():
    cls = transformer_impl.FSDPEngineWithLMHead
    theirs = cls.__dict__["forward_step"]
    with nopad_verl.install():
        assert cls.__dict__["forward_step"] is theirs and not shared.enabled()  # off by default
        nopad_verl.install(share_prefixes=True)  # a second install() applies its flag
        assert cls.__dict__["forward_step"] is shared.forward_step and shared.enabled()
        nopad_verl.install()
        assert cls.__dict__["forward_step"] is theirs
    with nopad_verl.install(share_prefixes=True):
        assert cls.__dict__["forward_step"] is shared.forward_step
        assert transformer_impl.FSDPEngineWithValueHead.forward_step is shared.forward_step  # inherited: falls back
    assert cls.__dict__["forward_step"] is theirs and not shared.enabled()
    with pytest.raises(ValueError, match="share_prefixes"):
        nopad_verl.install(share_prefixes="yes")


def _engine(cls=None, **attrs):
    """verl's FSDP engine object (not initialized: what fallback_reason reads of it set by hand) around
    a tiny Qwen2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    engine = object.__new__(cls or transformer_impl.FSDPEngineWithLMHead)
    config = Qwen2Config(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")  # fmt: skip
    vars(engine).update(module=Qwen2ForCausalLM(config), use_ulysses_sp=False, pad_to_length=False, _is_lora=False)
    vars(engine).update(attrs)
    return engine


def _micro(**meta):
    import verl.utils.tensordict_utils as tu
    import verl.workers.utils.padding as vpad

    from tests.verl_engine import grpo_batch

    batch = vpad.left_right_2_no_padding(grpo_batch(2))
    tu.assign_non_tensor(batch, **{"temperature": 1.0, **meta})
    return batch


def test_what_the_shared_layout_does_not_serve_runs_verls_own_forward():
    from functools import partial

    from verl.workers.utils.losses import ppo_loss, sft_loss

    engine, ppo = _engine(), partial(ppo_loss, config=None)
    assert shared.fallback_reason(engine, _micro(), None) is None  # the old / reference log-probs
    assert shared.fallback_reason(engine, _micro(), ppo) is None  # the PPO loss
    assert shared.fallback_reason(engine, _micro(temperature=torch.full((8,), 0.7)), ppo) is None
    cases = {
        "a loss other than verl's ppo_loss": (engine, _micro(), partial(sft_loss, config=None)),
        "use_fused_kernels": (engine, _micro(use_fused_kernels=True), ppo),
        "use_remove_padding=False": (engine, _micro(use_remove_padding=False), ppo),
        "calculate_sum_pi_squared": (engine, _micro(calculate_sum_pi_squared=True), ppo),
        "distillation": (engine, _micro(distillation_use_topk=True), ppo),
        "Ulysses sequence parallel": (_engine(use_ulysses_sp=True), _micro(), ppo),
        "pad_to_length or packed cu_seqlens": (_engine(pad_to_length=True), _micro(), ppo),
        "FSDP1 or LoRA": (_engine(_is_lora=True), _micro(), ppo),
        "an engine with its own inputs or outputs (a value head)": (
            _engine(transformer_impl.FSDPEngineWithValueHead), _micro(), None),
        "no prompts and responses (not a rollout batch)": (engine, _micro().exclude("prompts"), None),
        "a temperature tensor not one per row": (engine, _micro(temperature=torch.ones(3)), None),
        "a temperature that is not a finite number > 0": (engine, _micro(temperature=0.0), None),
        "no temperature": (engine, _micro().exclude("temperature"), None),
    }  # fmt: skip
    for reason, (e, micro, loss) in cases.items():
        assert shared.fallback_reason(e, micro, loss) == reason
    # a per-row temperature verl would clamp (to 1e-8) keeps verl's forward too
    assert shared.fallback_reason(engine, _micro(temperature=torch.tensor([0.7] * 7 + [0.0])), None) == (
        "a temperature that is not a finite number > 0"
    )
