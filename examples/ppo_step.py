"""One PPO update of a tiny random-weight Llama on a synthetic padded rollout batch.

Run with::

    python examples/ppo_step.py [--batch 16] [--micro-batches 4] [--seed 0] [--device cuda]

On a CPU the model runs fp32; on CUDA bf16, and ``packed_logprobs`` runs its attention through
nopad's varlen back end (``nopad_varlen``: torch's own flash kernel, nothing extra to install).

The trainer's usual padded batch (prompts left-padded, responses right-padded) goes through
``left_right_2_no_padding`` once per micro batch, the model runs ONE packed row per micro batch
(no padding token is ever computed), ``ppo_loss`` takes the nested log-probs and entropy back to
the response frame, and the micro-batch losses are normalised by the figures of the whole mini
batch, so the update does not depend on how the batch was split.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from tensordict import TensorDict

from nopad.batches import left_right_2_no_padding
from nopad.engines import packed_logprobs
from nopad.losses import LossConfig, global_batch_info, ppo_loss

VOCAB, PROMPT_WIDTH, RESPONSE_WIDTH = 128, 24, 32


def tiny_llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).float()


def synthetic_rollout(B: int, seed: int) -> TensorDict:
    """A verl-style padded batch with ragged prompts/responses and GRPO-like per-sequence advantages."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, PROMPT_WIDTH + 1, (B,), generator=g)
    resp_lens = torch.randint(1, RESPONSE_WIDTH + 1, (B,), generator=g)
    prompt_mask = torch.arange(PROMPT_WIDTH) >= PROMPT_WIDTH - prompt_lens.unsqueeze(1)
    response_mask = torch.arange(RESPONSE_WIDTH) < resp_lens.unsqueeze(1)
    attention_mask = torch.cat([prompt_mask, response_mask], 1).long()
    input_ids = torch.randint(1, VOCAB, attention_mask.shape, generator=g) * attention_mask
    scores = torch.randn(B, generator=g)
    advantages = ((scores - scores.mean()) / (scores.std() + 1e-6)).unsqueeze(1) * response_mask
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_mask": response_mask.long(),
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "advantages": advantages,
        },
        batch_size=[B],
    )


@torch.no_grad()
def rollout_log_probs(model: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    """The behaviour policy's (B, R) log-probs, as the rollout would have recorded them."""
    from nopad.batches import no_padding_2_padding

    data = left_right_2_no_padding(batch)
    return no_padding_2_padding(packed_logprobs(model, data), data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = tiny_llama(args.seed).to(args.device, dtype)
    batch = synthetic_rollout(args.batch, args.seed).to(args.device)
    # the rollout engine's numerics differ a little from the trainer's: a slightly off-policy batch
    noise = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(args.seed)) * 0.2
    noise = noise.to(args.device)
    before = rollout_log_probs(model, batch)
    batch["old_log_probs"] = (before + noise) * batch["response_mask"]
    batch["ref_log_prob"] = rollout_log_probs(tiny_llama(args.seed + 1).to(args.device, dtype), batch)
    cfg = LossConfig(
        loss_agg_mode="seq-mean-token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        entropy_coeff=0.001,
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        kl_loss_coef=0.01,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    figures = global_batch_info(batch["response_mask"])  # once per mini batch, before splitting
    model.train()
    optimizer.zero_grad()
    total_loss, metrics = 0.0, {}
    for micro in batch.chunk(args.micro_batches):
        data = left_right_2_no_padding(micro)
        for key, value in figures.items():
            data.set_non_tensor(key, value)
        loss, micro_metrics = ppo_loss(cfg, packed_logprobs(model, data, calculate_entropy=True), data)
        loss.backward()
        total_loss += loss.item()
        for key, value in micro_metrics.items():
            metrics.setdefault(key, []).append(float(value))
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

    slots = batch["attention_mask"].numel()
    real = int(batch["attention_mask"].sum())
    attention = "nopad_varlen" if args.device.startswith("cuda") else "transformers' packed sdpa"
    print(
        f"batch {args.batch} x {PROMPT_WIDTH + RESPONSE_WIDTH} padded slots, {real} real tokens, "
        f"{args.micro_batches} micro batches, on {args.device} ({dtype}, packed attention: {attention})"
    )
    print(f"padding never computed: {slots - real}/{slots} slots = {(slots - real) / slots:.1%}")
    print(f"loss {total_loss:.6f}  grad_norm {float(grad_norm):.4f}")
    for key, values in metrics.items():
        # losses are normalised by the mini batch's figures: their sum is the mini-batch value
        how = "sum" if key.endswith("_loss") else "mean"
        value = sum(values) if how == "sum" else sum(values) / len(values)
        print(f"  {key:<24} {value:+.6f} ({how} over micro batches)")

    # the step moved the policy toward the tokens with positive advantage and away from the others
    after = rollout_log_probs(model.eval(), batch)
    mask = batch["response_mask"].bool()
    moved = ((after - before) * torch.sign(batch["advantages"]))[mask].mean()
    print(f"after the update: mean over response tokens of sign(A) * (log-prob after - before) = {float(moved):+.6f}")


if __name__ == "__main__":
    main()
