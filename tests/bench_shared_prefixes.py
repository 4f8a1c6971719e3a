"""CPU micro-benchmark of issue 38: a tiny model's forward + backward over one GRPO group, packed with
shared prefixes against packed without (the same exact attention and state-layer forms over both plans).

    OMP_NUM_THREADS=1 python -m tests.bench_shared_prefixes [--model llama|lfm2|qwen3_5_text|bamba]
        [--prompt 1024] [--repeats 3]

``--model``: a tiny Llama (default) or a tiny random-weight hybrid of that transformers model type
(LFM2's short convs, Qwen3.5's gated delta nets, Bamba's Mamba2 mixers, each beside attention).

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


def tiny(name: str) -> torch.nn.Module:
    if name == "llama":
        return tiny_llama()
    from nopad._apps.families import tiny_model

    model = tiny_model(name)
    if isinstance(model, str):
        raise SystemExit(f"{name}: {model}")
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--completions", type=int, nargs="+", default=[128 * k for k in range(1, 9)])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    model = use_shared_prefix_attention(tiny(args.model)).train()
    vocab = min(97, model.config.vocab_size)
    prompt = torch.randint(1, vocab, (args.prompt,), generator=gen)
    completions = [torch.randint(1, vocab, (n,), generator=gen) for n in args.completions]
    input_ids, prompt_lengths = join_prompts(nested([prompt] * len(completions)), nested(completions))
    values = input_ids.values()
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
        f"{args.model}: prompt {args.prompt}, {len(completions)} completions of "
        f"{min(args.completions)}-{max(args.completions)} tokens: "
        f"packed {plans['plain'].total} tokens {plain * 1e3:.0f} ms, shared prefixes "
        f"{plans['shared'].total} tokens {shared * 1e3:.0f} ms (fwd+bwd, median of {args.repeats}); "
        f"speed-up {plain / shared:.2f}x, token ratio {tokens:.2f}x"
    )


if __name__ == "__main__":
    main()
