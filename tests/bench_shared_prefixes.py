"""CPU micro-benchmark of issue 38's first slice: a tiny Llama's forward + backward over one GRPO group,
packed with shared prefixes against packed without (the same exact attention over both plans).

    OMP_NUM_THREADS=1 python -m tests.bench_shared_prefixes [--prompt 1024] [--repeats 3]

Prints times, their ratio and the token ratio; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nopad.batches._prefixes import join_prompts, plan_shared_prefixes  # private until issue 38 is done
from nopad.core._torch_internals import wrap_jagged
from nopad.modeling._prefixes import use_shared_prefix_attention
from tests.models import tiny_llama


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return wrap_jagged(torch.cat(rows), torch.tensor([0] + [len(r) for r in rows]).cumsum(0))


def step(model: torch.nn.Module, plan, values: torch.Tensor) -> float:
    start = time.perf_counter()
    out = model(
        input_ids=plan.pack(values)[None], position_ids=plan.position_ids[None], shared_prefixes=plan, use_cache=False
    )
    out.logits.float().logsumexp(-1).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--completions", type=int, nargs="+", default=[128 * k for k in range(1, 9)])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 97, (args.prompt,), generator=gen)
    completions = [torch.randint(1, 97, (n,), generator=gen) for n in args.completions]
    input_ids, prompt_lengths = join_prompts(nested([prompt] * len(completions)), nested(completions))
    values = input_ids.values()
    model = use_shared_prefix_attention(tiny_llama()).train()
    plans = {
        "shared": plan_shared_prefixes(input_ids, prompt_lengths),
        "plain": plan_shared_prefixes(input_ids, prompt_lengths, share=False),
    }
    times: dict[str, list[float]] = {name: [] for name in plans}
    for plan in plans.values():
        step(model, plan, values)  # warm-up
    for _ in range(args.repeats):  # alternate the two, so drift on a shared machine hits both
        for name, plan in plans.items():
            times[name].append(step(model, plan, values))
    shared, plain = (statistics.median(times[name]) for name in ("shared", "plain"))
    tokens = plans["plain"].total / plans["shared"].total
    print(
        f"prompt {args.prompt}, {len(completions)} completions of {min(args.completions)}-{max(args.completions)} "
        f"tokens: packed {plans['plain'].total} tokens {plain * 1e3:.0f} ms, shared prefixes "
        f"{plans['shared'].total} tokens {shared * 1e3:.0f} ms (fwd+bwd, median of {args.repeats}); "
        f"speed-up {plain / shared:.2f}x, token ratio {tokens:.2f}x"
    )


if __name__ == "__main__":
    main()
