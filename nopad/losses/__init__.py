"""verl-compatible PPO policy, value and SFT losses over nested model outputs: each a fixed number of
tensor ops, with verl's loss aggregation modes, clipping, KL penalties and metric names."""

from nopad.losses._losses import (
    LossConfig,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
    global_batch_info,
    kl_penalty,
    ppo_loss,
    sft_loss,
    value_loss,
)

__all__ = [
    "LossConfig",
    "agg_loss",
    "compute_policy_loss",
    "compute_value_loss",
    "global_batch_info",
    "kl_penalty",
    "ppo_loss",
    "sft_loss",
    "value_loss",
]
