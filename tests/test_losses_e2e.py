"""End to end on a tiny random-weight HF model (CPU, fp32).

nopad path: padded rollout -> left_right_2_no_padding -> ONE packed forward -> prepare_model_outputs
-> ppo_loss. Reference: a plain padded forward with the attention mask, log_softmax at the
temperature, the response slice taken by column, and the PPO formula written in tests/test_losses.py.
The two losses and every parameter gradient must agree.
"""

from __future__ import annotations

import re

import pytest
import torch

import nopad.losses as L
from nopad.batches import left_right_2_no_padding
from nopad.engines import packed_logprobs
from tests.models import make_padded_batch, tiny_llama
from tests.test_losses import ref_agg, ref_kl, ref_pg_tokens

TEMPERATURE = 0.7
P, R = 5, 6


def rollout_batch(seed=0):
    # a length-1 prompt, a length-1 response, an empty response, a full row; row 3's response is masked out
    td = make_padded_batch(5, P, R, seed=seed, prompt_lens=[1, 3, 5, 2, 4], resp_lens=[6, 1, 0, 4, 3])
    td["response_mask"][3] = 0
    g = torch.Generator().manual_seed(seed)
    B = td.batch_size[0]
    td["old_log_probs"] = -torch.rand(B, R, generator=g) * 4 - 2
    td["advantages"] = torch.randn(B, R, generator=g) * 2
    td["ref_log_prob"] = -torch.rand(B, R, generator=g) * 4 - 2
    td["rollout_is_weights"] = torch.rand(B, R, generator=g) + 0.5
    return td


def padded_reference(model, td, cfg):
    """The padded forward and the PPO loss written out on (B, R) tensors."""
    logits = (
        model(
            input_ids=td["input_ids"],
            attention_mask=td["attention_mask"],
            position_ids=td["position_ids"],
            use_cache=False,
        ).logits.float()
        / TEMPERATURE
    )
    log_softmax = logits[:, P - 1 : P - 1 + R].log_softmax(-1)  # column P + k - 1 predicts response token k
    logp = log_softmax.gather(-1, td["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    mask = td["response_mask"].bool()
    agg = lambda m: ref_agg(m, mask, cfg.loss_agg_mode, scale=cfg.loss_scale_factor)
    loss = agg(
        ref_pg_tokens(
            logp,
            td["old_log_probs"],
            td["advantages"],
            cfg.clip_ratio_low,
            cfg.clip_ratio_high,
            cfg.clip_ratio_c,
            td["rollout_is_weights"],
        )
    )
    loss = loss - cfg.entropy_coeff * agg(entropy)
    return loss + cfg.kl_loss_coef * agg(ref_kl(logp, td["ref_log_prob"], cfg.kl_loss_type))


def nopad_loss(model, td, cfg):
    data = left_right_2_no_padding(td)
    out = packed_logprobs(model, data, TEMPERATURE, calculate_entropy=True)
    return L.ppo_loss(cfg, out, data)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_ppo_loss_and_gradients_equal_the_padded_forward(mode):
    model = tiny_llama(seed=0)
    td = rollout_batch()
    cfg = L.LossConfig(
        loss_agg_mode=mode,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        kl_loss_coef=0.1,
        loss_scale_factor=R,
    )
    loss, metrics = nopad_loss(model, td, cfg)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = padded_reference(model, td, cfg)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    for (name, _), got, want in zip(model.named_parameters(), grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert sum(g.abs().sum() for g in grads) > 0
    assert 0 <= metrics["actor/pg_clipfrac"] <= 1


@pytest.mark.slow
def test_packed_micro_batches_with_global_figures_equal_one_padded_batch():
    """Two packed micro batches, normalised by the mini batch's figures, give the padded batch's gradient."""
    model = tiny_llama(seed=1)
    td = rollout_batch(seed=1)
    cfg = L.LossConfig(
        loss_agg_mode="seq-mean-token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_type="k1",
        loss_scale_factor=R,
    )
    figures = L.global_batch_info(td["response_mask"])
    params = list(model.parameters())
    total, grads = 0.0, [torch.zeros_like(p) for p in params]
    for rows in (slice(0, 2), slice(2, 5)):
        data = left_right_2_no_padding(td[rows])
        for key, value in figures.items():
            data.set_non_tensor(key, value)
        loss, _ = L.ppo_loss(cfg, packed_logprobs(model, data, TEMPERATURE, calculate_entropy=True), data)
        total = total + loss.detach()
        grads = [g + d for g, d in zip(grads, torch.autograd.grad(loss, params))]
    expected = padded_reference(model, td, cfg)
    expected_grads = torch.autograd.grad(expected, params)
    torch.testing.assert_close(total, expected.detach(), atol=1e-5, rtol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _run_example(monkeypatch, capsys, *argv):
    import runpy

    monkeypatch.setattr("sys.argv", ["ppo_step.py", *argv])
    runpy.run_path("examples/ppo_step.py", run_name="__main__")
    return capsys.readouterr().out


@pytest.mark.slow
def test_example_ppo_step_prints_loss_metrics_and_skipped_padding(monkeypatch, capsys):
    out4 = _run_example(monkeypatch, capsys, "--batch", "8", "--micro-batches", "4")
    out1 = _run_example(monkeypatch, capsys, "--batch", "8", "--micro-batches", "1")
    metric_lines = [line for line in out4.splitlines() if line.startswith(("loss", "  actor/", "  kl_"))]
    lines = dict(line.strip().split(" ", 1) for line in metric_lines)
    for key in (
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
        "actor/pg_loss",
        "actor/entropy_loss",
        "kl_loss",
    ):
        assert key in lines, out4
    assert 0 < float(lines["actor/pg_clipfrac"].split()[0]) < 1
    # the padding line is the batch's real count of pad slots, none of which the model computed
    skipped, slots, pct = re.search(r"padding never computed: (\d+)/(\d+) slots = ([\d.]+)%", out4).groups()
    assert int(slots) == 8 * 56 and 0 < int(skipped) < int(slots)
    assert abs(float(pct) - 100 * int(skipped) / int(slots)) < 0.06
    # the update does not depend on the micro-batch split: same loss and same gradient norm
    numbers = lambda out: [float(x) for x in re.search(r"^loss (\S+)  grad_norm (\S+)$", out, re.M).groups()]
    assert numbers(out4) == pytest.approx(numbers(out1), abs=2e-6)
    assert "after the update" in out4
