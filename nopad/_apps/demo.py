"""`nopad demo`: one RL batch through a tiny causal LM, padded and packed, side by side.

Builds a synthetic batch (left-padded prompts, right-padded responses, long-tailed lengths),
converts it with :func:`nopad.left_right_2_no_padding`, runs a random-weight HF causal LM on the
padded and on the packed form, and prints what a trainer engineer checks before trusting a
conversion: tokens computed, padding saved, the largest per-token log-prob difference, whether
packed sequences can see each other (the leak probe, also run on the trap it closes: the model as
transformers runs it with ``use_cache`` left at its default, which leaks on purpose), and the time
of each step as the median of several warm calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from nopad._apps.progress import QUIET, Progress, add_quiet_argument, sync
from nopad.batches._padding import left_right_2_no_padding, no_padding_2_padding
from nopad.synthetic import synthetic_batch, tiny_causal_lm

TOLERANCE = 1e-5
CALLS = 7  # timed warm calls of each step; the median is shown (one call ranged 1.1x to 41x over 10 runs)


def _timed(fn: Callable[[], Any], device: str, calls: int = CALLS) -> tuple[Any, float]:
    """Result and the median wall time (ms) of ``calls`` calls after one warm-up call (the first pays
    one-time setup: lazy imports, caches); the device is waited for around each call."""
    with torch.no_grad():
        out = fn()
    times = []
    for _ in range(calls):
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return out, statistics.median(times)


def speed_words(padded_ms: float, packed_ms: float) -> str:
    """'packed is 2.1x faster than padded' (or slower): a ratio above 1 whichever way it goes."""
    if packed_ms <= padded_ms:
        return f"packed is {padded_ms / packed_ms:.1f}x faster than padded"
    return f"packed is {packed_ms / padded_ms:.1f}x slower than padded"


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
    progress: Progress = QUIET,
) -> dict:
    """Run the demo and return its measurements (the CLI prints them); ``progress`` counts its 7 steps.

    On a CPU everything is fp32 and packed must equal padded within 1e-5. On CUDA the model runs
    bf16, packed attention goes through ``nopad_varlen``, and both the packed and the padded
    log-probs are compared with an fp32 padded forward: packed must be within the bf16 padded
    path's own error plus 10%.
    """
    from nopad.engines._fsdp import packed_logprobs, padded_logprobs
    from nopad.engines._leak import check_isolation
    from nopad.modeling._attention import Needs, current_implementation, packed_attention, select_kernel

    on_gpu = torch.device(device).type == "cuda"
    B, P, R, hidden, layers, heads, kv_heads, vocab = SIZES["cuda" if on_gpu else "cpu"]
    B, P, R = batch_size or B, prompt_len or P, response_len or R
    with progress.step(f"a random-weight {arch}, B={B}"):
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
    with progress.step(f"left_right_2_no_padding, {CALLS} warm calls"):
        nested, t_convert = _timed(lambda: left_right_2_no_padding(data), device)
    with progress.step(f"the padded forward, {CALLS} warm calls"):
        ref, t_padded = _timed(lambda: padded_logprobs(model, data), device)
    with progress.step(f"the packed forward, {CALLS} warm calls"):
        packed, t_packed = _timed(lambda: packed_logprobs(model, nested), device)
    with progress.step(f"no_padding_2_padding, {CALLS} warm calls"):
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
    with progress.step("the leak probe on the packed forward"), packed_attention(model):
        leak_nopad = check_isolation(model, nested, atol=atol)  # the model as the packed forward ran it
    # the model as transformers runs it, use_cache left at its default: the trap nopad's route closes
    with progress.step("the leak probe on the trap (use_cache left at its default)"):
        leak_default = check_isolation(model, nested, use_cache=None, atol=atol)
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
    trap = "the same packed row as transformers runs it, use_cache left at its default"
    trap = f"{trap}: expected to LEAK" if r["leak_default_use_cache"] else f"{trap}: no leak, even so"
    median = f"(median of {CALLS} warm calls)"
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
        ("leak probe, nopad inputs", str(r["leak_nopad"])),
        ("the trap nopad closes, on purpose", trap),
        ("leak probe, use_cache default", str(r["leak_default_use_cache"])),
        ("left_right_2_no_padding", f"{r['ms_convert']:8.2f} ms  {median}"),
        ("padded forward", f"{r['ms_padded_forward']:8.2f} ms  {median}"),
        ("packed forward", f"{r['ms_packed_forward']:8.2f} ms  {median}"),
        ("no_padding_2_padding", f"{r['ms_back']:8.2f} ms  {median}"),
        ("speed", speed_words(r["ms_padded_forward"], r["ms_packed_forward"]) + " (the forwards above)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cpu, cuda = SIZES["cpu"], SIZES["cuda"]
    parser.add_argument(
        "--batch-size", type=int, default=None, help=f"rows (default: {cpu[0]} on a CPU, {cuda[0]} on CUDA)"
    )
    parser.add_argument(
        "--prompt-len", type=int, default=None, help=f"padded prompt width (default: {cpu[1]}; {cuda[1]} on CUDA)"
    )
    parser.add_argument(
        "--response-len", type=int, default=None, help=f"padded response width (default: {cpu[2]}; {cuda[2]} on CUDA)"
    )
    parser.add_argument("--seed", type=int, default=0, help="of the batch and the model's weights")
    parser.add_argument("--device", default="cpu", help="a torch device: cpu, cuda, cuda:1, ...")
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2"], help="the model family")
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    with Progress("nopad demo", 7, quiet=args.quiet) as progress:
        report = run_demo(
            args.batch_size, args.prompt_len, args.response_len, args.seed, args.device, args.arch, progress
        )
    print(format_report(report))
    return 0 if passed(report) else 1
