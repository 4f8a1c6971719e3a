"""A critic on nested batches: ``prepare_value_outputs`` turns a value head's per-token output on the
packed row into the nested values ``value_loss`` takes, with the row's padding, in micro-batches and
under Ulysses SP, equal to each row run alone through the critic.

The reference is per row and written here: the row's real tokens alone through the critic, the
value of response token k read at the position before it (as verl's critic reads
``values[:, -R - 1 : -1]``), and the clipped value loss computed from those by hand.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import nopad
from nopad.batches import micro_batches
from nopad.engines import prepare_model_inputs, prepare_value_outputs
from nopad.losses import LossConfig, global_batch_info, value_loss
from nopad.synthetic import synthetic_batch, tiny_causal_lm
from tests.dist_utils import run_distributed

VOCAB = 200
CLIP = 0.2


def critic_model(seed: int = 0) -> torch.nn.Module:
    """A random-weight Llama with a one-output token-classification head: verl's kind of critic."""
    config = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, layers=2, seed=seed).config
    config.num_labels = 1
    torch.manual_seed(seed)
    model = transformers.LlamaForTokenClassification(config).float().eval()
    model.config._attn_implementation = "sdpa"
    return model


def rollout(B: int = 6, seed: int = 0):
    data = synthetic_batch(B, 8, 12, vocab=VOCAB, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    R = data["response_mask"].shape[1]
    data["values"] = torch.randn(B, R, generator=g)  # the rollout's old estimates
    data["returns"] = torch.randn(B, R, generator=g)
    return data


def reference_vpreds(critic, data) -> torch.Tensor:
    """(B, R) values of the response tokens, each row alone: position n - r - 1 + k for token k."""
    R = data["response_mask"].shape[1]
    rows = []
    for b in range(data.batch_size[0]):
        ids = data["input_ids"][b][data["attention_mask"][b].bool()]
        out = critic(input_ids=ids[None], position_ids=torch.arange(len(ids))[None]).logits[0, :, 0]
        r = int(data["response_mask"][b].sum())
        rows.append(torch.nn.functional.pad(out[len(ids) - r - 1 : len(ids) - 1], (0, R - r)))
    return torch.stack(rows)


def reference_loss(vpreds, data) -> torch.Tensor:
    mask = data["response_mask"].bool()
    old, returns = data["values"], data["returns"]
    clipped = old + (vpreds - old).clamp(-CLIP, CLIP)
    per_token = torch.maximum((vpreds - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * per_token[mask].sum() / mask.sum()


def packed_values(critic, micro, **kwargs):
    inputs, args = prepare_model_inputs(micro, attn_implementation="sdpa", **kwargs)
    return prepare_value_outputs(critic(**inputs), args)


@pytest.mark.parametrize("pad_to_multiple", [1, 16])
def test_values_from_the_packed_row_equal_each_row_alone_and_give_its_value_loss(pad_to_multiple):
    critic, data = critic_model(), rollout()
    micro = nopad.left_right_2_no_padding(data.clone())
    with torch.no_grad():
        out = packed_values(critic, micro, pad_to_multiple=pad_to_multiple)
        want = reference_vpreds(critic, data)
    values = out["values"]
    assert values.is_nested and values.dtype == torch.float32
    assert values.offsets() is micro["input_ids"].offsets()  # on the batch's own offsets: no compare needed
    got = nopad.no_padding_2_padding(values, micro)
    assert torch.allclose(got, want, atol=1e-5)
    loss, metrics = value_loss(LossConfig(cliprange_value=CLIP), out, micro)
    assert loss.item() == pytest.approx(reference_loss(want, data).item(), rel=1e-5)
    assert set(metrics) == {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"}


def test_the_value_loss_over_token_budget_micro_batches_is_the_whole_batchs_with_its_gradient():
    critic, data = critic_model(), rollout(B=8, seed=3)
    whole = nopad.left_right_2_no_padding(data.clone())
    figures = global_batch_info(data["response_mask"])
    cfg = LossConfig(cliprange_value=CLIP)
    micro, restore = micro_batches(whole, max_token_len=24)
    assert len(micro) > 1
    total = 0.0
    outputs = []
    for m in micro:
        for key, value in figures.items():
            m.set_non_tensor(key, value)
        out = packed_values(critic, m)
        loss, _ = value_loss(cfg, out, m)
        loss.backward()
        total += loss.item()
        outputs.append(out["values"].detach())
    grads = [p.grad.clone() for p in critic.parameters()]
    critic.zero_grad()
    reference = reference_loss(reference_vpreds(critic, data), data)
    reference.backward()
    assert total == pytest.approx(reference.item(), rel=1e-5)
    for got, want in zip(grads, (p.grad for p in critic.parameters())):
        assert torch.allclose(got, want, atol=1e-5)
    restored = restore(outputs)  # the micro-batches' values back in the batch's row order
    assert torch.allclose(nopad.no_padding_2_padding(restored, whole), reference_vpreds(critic, data), atol=1e-5)


def test_a_critic_output_of_the_wrong_shape_or_args_are_refused():
    micro = nopad.left_right_2_no_padding(rollout().clone())
    _, args = prepare_model_inputs(micro)
    L = args.labels.shape[0]
    with pytest.raises(ValueError, match=rf"^values: expected \(1, {L}\) or \(1, {L}, 1\): one value per token"):
        prepare_value_outputs(torch.zeros(1, L, 2), args)
    with pytest.raises(ValueError, match=r"^values: expected a floating-point"):
        prepare_value_outputs(torch.zeros(1, L, dtype=torch.int64), args)
    with pytest.raises(ValueError, match=r"^output_args: expected the OutputArgs of prepare_model_inputs, got dict"):
        prepare_value_outputs(torch.zeros(1, L), {})


def _ulysses_values(rank: int, world_size: int) -> tuple[list[float], list[float], float]:
    import torch.distributed as dist

    from nopad.parallel import enable_ulysses

    critic, data = enable_ulysses(critic_model()), rollout()
    micro = nopad.left_right_2_no_padding(data.clone())
    out = packed_values_sp(critic, micro, dist.group.WORLD)
    loss, _ = value_loss(LossConfig(cliprange_value=CLIP), out, micro)
    loss.backward()
    grad = sum(float(p.grad.double().sum()) for p in critic.parameters())
    return out["values"].values().tolist(), [loss.item()], grad


def packed_values_sp(critic, micro, group):
    inputs, args = prepare_model_inputs(
        micro, attn_implementation=critic.config._attn_implementation, sp_group=group, pad_to_multiple=4
    )
    assert inputs["input_ids"].shape[1] == args.padded_total // 2  # each rank ran half of the row
    return prepare_value_outputs(critic(**inputs), args)


@pytest.mark.slow
def test_values_under_ulysses_sp_2_equal_one_process_with_gradients():
    critic, data = critic_model(), rollout()
    micro = nopad.left_right_2_no_padding(data.clone())
    out = packed_values(critic, micro)
    loss, _ = value_loss(LossConfig(cliprange_value=CLIP), out, micro)
    loss.backward()
    one_grad = sum(float(p.grad.double().sum()) for p in critic.parameters())
    ranks = run_distributed(_ulysses_values, 2)
    for values, (rank_loss,), _grad in ranks:
        assert torch.allclose(torch.tensor(values), out["values"].values().detach(), atol=1e-5)
        assert rank_loss == pytest.approx(loss.item(), rel=1e-5)
    # every SP rank computes the same loss from the gathered values: their gradients sum to 2x one process's
    assert sum(grad for _, _, grad in ranks) == pytest.approx(2 * one_grad, rel=1e-4)
