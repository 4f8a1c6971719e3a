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

from nopad._padding import left_right_2_no_padding, no_padding_2_padding
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


# (batch, prompt width, response width, hidden, layers, heads, kv heads, vocab): tiny on a CPU; on a GPU
# large enough for padding's waste to show (issue 11's B=32 shape: 27% of the slots are real)
SIZES = {"cpu": (16, 64, 128, 64, 2, 4, 2, 1000), "cuda": (32, 1024, 2048, 1024, 8, 16, 4, 32_000)}


def run_demo(
    batch_size: int | None = None,
    prompt_len: int | None = None,
    response_len: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    arch: str = "llama",
) -> dict:
    """Run the demo and return its measurements (the CLI prints them).

    On a CPU everything is fp32 and packed must equal padded within 1e-5. On CUDA the model runs
    bf16, packed attention goes through ``nopad_varlen``, and both the packed and the padded
    log-probs are compared with an fp32 padded forward: packed must be within the bf16 padded
    path's own error plus 10%.
    """
    from nopad._attention import Needs, current_implementation, packed_attention, select_kernel
    from nopad.engines._fsdp import packed_logprobs, padded_logprobs
    from nopad.engines._leak import check_isolation

    on_gpu = torch.device(device).type == "cuda"
    B, P, R, hidden, layers, heads, kv_heads, vocab = SIZES["cuda" if on_gpu else "cpu"]
    B, P, R = batch_size or B, prompt_len or P, response_len or R
    data = synthetic_batch(B, P, R, seed=seed, device=device, vocab=vocab)
    model = tiny_causal_lm(
        arch, vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, seed=seed
    ).to(device)
    mask = data["response_mask"].bool()
    exact = None
    if on_gpu:
        with torch.no_grad():
            exact = padded_logprobs(model, data, rows_per_forward=max(1, 4096 // (P + R)))
        model = model.to(torch.bfloat16)
    nested, t_convert = _timed(lambda: left_right_2_no_padding(data), device)
    ref, t_padded = _timed(lambda: padded_logprobs(model, data), device)
    packed, t_packed = _timed(lambda: packed_logprobs(model, nested), device)
    ours, t_back = _timed(lambda: no_padding_2_padding(packed, nested), device)
    max_error = lambda x, y: float((x.float() - y.float()).abs()[mask].max()) if mask.any() else 0.0  # noqa: E731
    if exact is None:
        diff, tolerance = max_error(ours, ref), TOLERANCE
        kernel = f"transformers' packed {current_implementation(model)} (nopad_varlen's auto on CUDA)"
    else:
        diff, padded_error = max_error(ours, exact), max_error(ref, exact)
        tolerance = 1.1 * padded_error + 1e-6
        needs = Needs(gqa=kv_heads != heads)
        kernel = f"nopad_varlen, {select_kernel('auto', 'cuda', torch.bfloat16, needs)} kernel"
    atol = 1e-5 if exact is None else 1e-2
    # the model as transformers runs it, use_cache left at its default: the trap nopad's route closes
    leak_default = check_isolation(model, nested, use_cache=None, atol=atol)
    with packed_attention(model):  # the model as the packed forward ran it
        leak_nopad = check_isolation(model, nested, atol=atol)
    slots, real = data["attention_mask"].numel(), int(data["attention_mask"].sum())
    return {
        "batch_size": B,
        "arch": arch,
        "device": device,
        "dtype": str(next(model.parameters()).dtype),
        "attention": kernel,
        "reference": "fp32 padded forward" if exact is not None else "padded forward",
        "tokens_padded": slots,
        "tokens_packed": real,
        "padding_fraction": 1 - real / slots,
        "response_tokens": int(mask.sum()),
        "max_abs_logprob_diff": diff,
        "tolerance": tolerance,
        "leak_default_use_cache": leak_default,
        "leak_nopad": leak_nopad,
        "ms_convert": t_convert,
        "ms_padded_forward": t_padded,
        "ms_packed_forward": t_packed,
        "ms_back": t_back,
    }


def passed(r: dict) -> bool:
    """Packed agrees with the reference and its sequences cannot see each other."""
    return r["max_abs_logprob_diff"] <= r["tolerance"] and not r["leak_nopad"]


def format_report(r: dict) -> str:
    ok = "OK" if r["max_abs_logprob_diff"] <= r["tolerance"] else "FAIL"
    speedup = r["ms_padded_forward"] / r["ms_packed_forward"]
    rows = [
        ("batch", f"B={r['batch_size']} {r['arch']} (random weights, {r['dtype']}) on {r['device']}"),
        ("packed attention", r["attention"]),
        ("tokens computed, padded", f"{r['tokens_padded']:,}"),
        ("tokens computed, packed", f"{r['tokens_packed']:,}"),
        ("padding never computed", f"{r['padding_fraction']:.1%} of all slots"),
        (
            f"max |logp packed - {r['reference']}|",
            f"{r['max_abs_logprob_diff']:.2e} over {r['response_tokens']:,} "
            f"response tokens ({ok}: <= {r['tolerance']:.2g})",
        ),
        ("leak probe, use_cache default", str(r["leak_default_use_cache"])),
        ("leak probe, nopad inputs", str(r["leak_nopad"])),
        ("left_right_2_no_padding", f"{r['ms_convert']:8.2f} ms"),
        ("padded forward", f"{r['ms_padded_forward']:8.2f} ms"),
        ("packed forward", f"{r['ms_packed_forward']:8.2f} ms  ({speedup:.2f}x the padded forward)"),
        ("no_padding_2_padding", f"{r['ms_back']:8.2f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=None, help="default 16 on a CPU, 32 on CUDA")
    parser.add_argument("--prompt-len", type=int, default=None, help="padded prompt width (64; 1024 on CUDA)")
    parser.add_argument("--response-len", type=int, default=None, help="padded response width (128; 2048 on CUDA)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2"])


def run(args: argparse.Namespace) -> int:
    report = run_demo(args.batch_size, args.prompt_len, args.response_len, args.seed, args.device, args.arch)
    print(format_report(report))
    return 0 if passed(report) else 1
