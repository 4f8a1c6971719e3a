"""`nopad bench --model --share-prefixes`: GRPO groups' response log-probs, padded, packed, and packed
with each group's prompt computed once.

For each shape (a prompt width, a response width, n samples per prompt) it times, on one
random-weight model, forward and forward + backward of:

- ``padded``: the padded forward with an attention mask (what a trainer runs without nopad);
- ``packed``: ``packed_logprobs(..., tokens="response")``, each row's prompt computed again;
- ``packed, shared-prefix path, nothing shared``: the shared-prefix path's attention and head over
  the plain packed layout (every row its own group);
- ``packed, shared prefixes``: ``share_prefixes=True``.

Timings include the conversions a trainer pays. Each row reports the tokens each contender computes,
the best of the repeats (contenders in turn), the speed-up over ``packed`` and over the unshared
shared-prefix path (sharing alone: the same attention and head) beside the token ratio (what
computing each prompt once can give at most), the peak GiB (CUDA) and the largest |log-prob
difference| over response tokens against the fp32 padded forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from nopad._apps.bench_model import ModelShape, build_model, finite_ms, time_contenders
from nopad._apps.progress import QUIET, Progress
from nopad.batches._padding import left_right_2_no_padding, no_padding_2_padding
from nopad.engines._fsdp import packed_logprobs, padded_logprobs
from nopad.engines._prefixes import shared_prefix_logprobs
from nopad.synthetic import synthetic_batch

SHARED = "packed, shared prefixes"
# the same attention and head over the plain packed layout: the speed-up of sharing alone is against it
UNSHARED = "packed, shared-prefix path, nothing shared"


@dataclass(frozen=True)
class GroupShape:
    """``prompts`` groups of ``samples`` rows each, prompts up to ``prompt`` and responses up to
    ``response`` tokens (long-tailed), on the model ``model``."""

    prompts: int
    samples: int
    prompt: int
    response: int
    model: ModelShape

    @property
    def label(self) -> str:
        return f"n={self.samples} x {self.prompts} prompts, P={self.prompt} R={self.response}"


_CPU_MODEL = ModelShape(0, 0, 0, hidden=64, layers=2, heads=4, kv_heads=2, vocab=1000)
_GPU_MODEL = ModelShape(0, 0, 0)  # a 1,024-wide 8-layer Llama
# n in {1, 4, 8, 16} at two prompt / response ratios; CPU sizes for CI's two cores
CPU_GROUPS = tuple(GroupShape(max(1, 16 // n), n, 512, 256, _CPU_MODEL) for n in (1, 4, 8, 16)) + tuple(
    GroupShape(max(1, 16 // n), n, 128, 512, _CPU_MODEL) for n in (4, 16)
)
GPU_GROUPS = tuple(GroupShape(max(1, 64 // n), n, 2048, 1024, _GPU_MODEL) for n in (1, 4, 8, 16)) + tuple(
    GroupShape(max(1, 64 // n), n, 512, 2048, _GPU_MODEL) for n in (4, 16)
)


def _contenders(model: torch.nn.Module, data: TensorDict) -> dict[str, Callable[[], torch.Tensor]]:
    def packed() -> torch.Tensor:
        micro = left_right_2_no_padding(data)
        return no_padding_2_padding(packed_logprobs(model, micro, tokens="response"), micro)

    def shared_layout(share: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            micro = left_right_2_no_padding(data)
            out = shared_prefix_logprobs(model, micro, micro["input_ids"], 1.0, False, None, share=share)
            return no_padding_2_padding(out["log_probs"], micro)

        return run

    return {
        "padded": lambda: padded_logprobs(model, data),
        "packed": packed,
        UNSHARED: shared_layout(False),
        SHARED: shared_layout(True),
    }


def _computed_tokens(data: TensorDict, prompt_width: int, samples: int) -> dict[str, int]:
    """The tokens each contender's layers run on: every slot, every real token, each prompt once."""
    mask = data["attention_mask"]
    real = int(mask.sum())
    repeated = int(mask[:, :prompt_width].sum()) - int(mask[::samples, :prompt_width].sum())
    return {"padded": mask.numel(), "packed": real, UNSHARED: real, SHARED: real - repeated}


def bench_group_shape(
    shape: GroupShape, device: str = "cpu", repeats: int = 3, seed: int = 0, progress: Progress = QUIET
) -> list[dict]:
    """Rows of {shape, contender, tokens, fwd_ms, fwd_bwd_ms, x_packed_fwd_bwd, x_unshared_fwd_bwd,
    token_ratio, peak_gib, max_abs_logprob_diff}."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = shape.prompts * shape.samples
    data = synthetic_batch(
        n,
        shape.prompt,
        shape.response,
        seed=seed,
        device=device,
        vocab=shape.model.vocab,
        samples_per_prompt=shape.samples,
    )
    model = build_model(shape.model, dev, torch.float32)
    with torch.no_grad():
        exact = padded_logprobs(model, data, rows_per_forward=max(1, 4096 // (shape.prompt + shape.response)))
    model.to(dtype)  # in place, once the fp32 reference is taken
    runs = _contenders(model, data)
    tokens = _computed_tokens(data, shape.prompt, shape.samples)
    fwd, fwd_bwd, peak, diff = time_contenders(runs, model, exact, dev, repeats, shape.label, progress)
    return [
        {
            "shape": shape.label,
            "contender": name,
            "tokens": tokens[name],
            "fwd_ms": finite_ms(fwd[name]),
            "fwd_bwd_ms": finite_ms(fwd_bwd[name]),
            "x_packed_fwd_bwd": finite_ms(fwd_bwd["packed"] / fwd_bwd[name]),
            "x_unshared_fwd_bwd": finite_ms(fwd_bwd[UNSHARED] / fwd_bwd[name]),
            "token_ratio": round(tokens["packed"] / tokens[name], 3),
            "peak_gib": peak[name],
            "max_abs_logprob_diff": diff[name],
        }
        for name in runs
    ]


def bench_groups(
    device: str = "cpu",
    shapes: tuple[GroupShape, ...] | None = None,
    repeats: int = 3,
    on_shape: Callable[[list[dict]], None] | None = None,
    progress: Progress = QUIET,
) -> list[dict]:
    """:func:`bench_group_shape` over ``shapes`` (default: :data:`GPU_GROUPS` on CUDA, :data:`CPU_GROUPS`
    elsewhere); ``on_shape`` sees each shape's rows as soon as they are measured."""
    if shapes is None:
        shapes = GPU_GROUPS if torch.device(device).type == "cuda" else CPU_GROUPS
    rows: list[dict] = []
    for shape in shapes:
        measured = bench_group_shape(shape, device, repeats, progress=progress)
        if on_shape is not None:
            on_shape(measured)
        rows += measured
    return rows
