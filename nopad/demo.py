"""`nopad demo`: one RL batch through a tiny causal LM, padded and packed, side by side.

Builds a synthetic batch (left-padded prompts, right-padded responses, long-tailed lengths),
converts it with :func:`nopad.left_right_2_no_padding`, runs a random-weight HF causal LM on the
padded and on the packed form, and prints what a trainer engineer checks before trusting a
conversion: tokens computed, padding saved, the largest per-token log-prob difference, whether
packed sequences can see each other (the leak probe), and the time of each step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from nopad.padding import left_right_2_no_padding, no_padding_2_padding
from nopad.synthetic import synthetic_batch, tiny_causal_lm

TOLERANCE = 1e-5


def _timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """Result and wall time of the second call: the first pays one-time setup (lazy imports, caches)."""
    with torch.no_grad():
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def run_demo(
    batch_size: int = 16,
    prompt_len: int = 64,
    response_len: int = 128,
    seed: int = 0,
    device: str = "cpu",
    arch: str = "llama",
) -> dict:
    """Run the demo and return its measurements (the CLI prints them)."""
    from nopad.engines.fsdp import check_isolation, packed_logprobs, padded_logprobs

    vocab = 1000
    data = synthetic_batch(batch_size, prompt_len, response_len, seed=seed, device=device, vocab=vocab)
    model = tiny_causal_lm(arch, vocab=vocab, seed=seed).to(device)
    nested, t_convert = _timed(lambda: left_right_2_no_padding(data), device)
    ref, t_padded = _timed(lambda: padded_logprobs(model, data), device)
    packed, t_packed = _timed(lambda: packed_logprobs(model, nested), device)
    ours, t_back = _timed(lambda: no_padding_2_padding(packed, nested), device)
    mask = data["response_mask"].bool()
    max_diff = (ours - ref).abs()[mask].max().item() if mask.any() else 0.0
    leak_default = check_isolation(model, nested, use_cache=None)
    leak_nopad = check_isolation(model, nested)
    slots, real = data["attention_mask"].numel(), int(data["attention_mask"].sum())
    return {
        "batch_size": batch_size,
        "arch": arch,
        "device": device,
        "tokens_padded": slots,
        "tokens_packed": real,
        "padding_fraction": 1 - real / slots,
        "response_tokens": int(mask.sum()),
        "max_abs_logprob_diff": max_diff,
        "leak_default_use_cache": leak_default,
        "leak_nopad": leak_nopad,
        "ms_convert": t_convert,
        "ms_padded_forward": t_padded,
        "ms_packed_forward": t_packed,
        "ms_back": t_back,
    }


def format_report(r: dict) -> str:
    ok = "OK" if r["max_abs_logprob_diff"] < TOLERANCE else "FAIL"

    def verdict(report) -> str:
        return str(report)

    rows = [
        ("batch", f"B={r['batch_size']} {r['arch']} (random weights) on {r['device']}"),
        ("tokens computed, padded", f"{r['tokens_padded']:,}"),
        ("tokens computed, packed", f"{r['tokens_packed']:,}"),
        ("padding never computed", f"{r['padding_fraction']:.1%} of all slots"),
        (
            "max |logp padded - packed|",
            f"{r['max_abs_logprob_diff']:.2e} over {r['response_tokens']:,} response tokens ({ok}: < {TOLERANCE:g})",
        ),
        ("leak probe, use_cache default", verdict(r["leak_default_use_cache"])),
        ("leak probe, nopad inputs", verdict(r["leak_nopad"])),
        ("left_right_2_no_padding", f"{r['ms_convert']:8.2f} ms"),
        ("padded forward", f"{r['ms_padded_forward']:8.2f} ms"),
        ("packed forward", f"{r['ms_packed_forward']:8.2f} ms"),
        ("no_padding_2_padding", f"{r['ms_back']:8.2f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64, help="padded prompt width")
    parser.add_argument("--response-len", type=int, default=128, help="padded response width")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2"])


def run(args: argparse.Namespace) -> int:
    report = run_demo(args.batch_size, args.prompt_len, args.response_len, args.seed, args.device, args.arch)
    print(format_report(report))
    return 0 if report["max_abs_logprob_diff"] < TOLERANCE and not report["leak_nopad"] else 1
