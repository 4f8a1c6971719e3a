"""`nopad bench --model`: a causal LM's response log-probs, padded against packed with each attention kernel.

For each shape it times, on one random-weight model (a Llama, or ``--arch`` another family of
:data:`nopad.synthetic.ARCHS`: Qwen3.5's gated delta nets, Bamba's Mamba2 mixers, ...):

- ``padded sdpa``: the padded forward with an attention mask (what a trainer runs without nopad);
- ``per sequence``: each sequence alone, one forward per row (what a trainer runs when its model
  cannot be packed: verl's Qwen3.5 fallback loops over sequences like this), on the families that
  carry state along the sequence;
- ``packed, HF sdpa``: the packed row as transformers runs it itself (its sdpa's dense block mask;
  its state-carrying layers leak, as the diff column shows), for the record;
- ``packed, <kernel>``: nopad's packed row through ``nopad_varlen`` with each kernel available (and
  the packed forms of the state-carrying layers).

Packed timings include the conversions a trainer pays (``left_right_2_no_padding`` before,
``no_padding_2_padding`` after). Each contender reports forward and forward+backward ms (best of
the repeats, contenders in turn), the peak GiB (CUDA) and the largest |log-prob difference| over
response tokens against an fp32 padded forward (computed a few rows at a time, so it fits where
the padded batch itself does not).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from nopad._apps.progress import QUIET, Progress, sync
from nopad.batches._padding import left_right_2_no_padding, no_padding_2_padding
from nopad.engines._fsdp import packed_logprobs, padded_logprobs, prepare_model_inputs, prepare_model_outputs
from nopad.modeling._attention import available_kernels
from nopad.modeling._routing import survey as route_survey
from nopad.synthetic import synthetic_batch, tiny_causal_lm


@dataclass(frozen=True)
class ModelShape:
    """A batch (B rows, prompt and response widths) on a Llama of ``hidden`` x ``layers``."""

    batch: int
    prompt: int
    response: int
    hidden: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    vocab: int = 32_000
    arch: str = "llama"

    @property
    def label(self) -> str:
        return f"{self.arch} B={self.batch} P={self.prompt} R={self.response} h={self.hidden}"


# the four shapes of issue 11's table (an H200: 141 GB)
GPU_SHAPES = (
    ModelShape(4, 256, 512),
    ModelShape(32, 1024, 2048),
    ModelShape(8, 2048, 14_336),
    ModelShape(128, 512, 1536, hidden=2048),
)
# small enough for CI's two cores
CPU_SHAPES = (
    ModelShape(4, 16, 32, hidden=64, layers=2, heads=4, kv_heads=2, vocab=1000),
    ModelShape(16, 32, 64, hidden=64, layers=2, heads=4, kv_heads=2, vocab=1000),
)
# the families that carry state along the sequence: 32 long-tailed rows, sequences up to 256 tokens
# (several 64-token delta-rule chunks, 32-token Mamba2 chunks), every layer kind of the hybrid
STATE_CPU_SHAPES = (ModelShape(32, 64, 192, hidden=64, layers=4, heads=4, kv_heads=2, vocab=1000),)


def shapes_for(arch: str, device: str) -> tuple[ModelShape, ...]:
    """The default shapes of ``arch`` on ``device``."""
    base: tuple[ModelShape, ...]
    if torch.device(device).type == "cuda":
        base = GPU_SHAPES
    else:
        base = CPU_SHAPES if arch in ("llama", "qwen2") else STATE_CPU_SHAPES
    return tuple(dataclasses.replace(shape, arch=arch) for shape in base)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def build_model(shape: ModelShape, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    model = tiny_causal_lm(
        shape.arch,
        vocab=shape.vocab,
        hidden=shape.hidden,
        layers=shape.layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
    )
    return model.to(device=device, dtype=dtype)


# transformers' packed sdpa builds a dense T x T mask: past this many tokens it is left out (B=128: 4.8 GB)
HF_PACKED_SDPA_MAX_TOKENS = 32_768


def _contenders(model: torch.nn.Module, data: TensorDict, kernels: list[str]) -> dict[str, Callable[[], torch.Tensor]]:
    def packed(kernel: str | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            micro = left_right_2_no_padding(data)
            if kernel is None:  # transformers' own packed path: restarting position ids, its sdpa's block mask
                inputs, args = prepare_model_inputs(micro)
                log_probs = prepare_model_outputs(model(**inputs), args)["log_probs"]
            else:
                log_probs = packed_logprobs(model, micro, attention=kernel)
            return no_padding_2_padding(log_probs, micro)

        return run

    runs = {"padded sdpa": lambda: padded_logprobs(model, data)}
    if any(module for module in route_survey(model).rebound):
        runs["per sequence"] = lambda: _per_sequence(model, data)
    if int(data["attention_mask"].sum()) <= HF_PACKED_SDPA_MAX_TOKENS:
        runs["packed, HF sdpa"] = packed(None)
    runs.update({f"packed, {kernel}": packed(kernel) for kernel in kernels})
    return runs


def _per_sequence(model: torch.nn.Module, data: TensorDict) -> torch.Tensor:
    """(B, R) response log-probs, each sequence run alone (no padding, no packing: B forwards)."""
    rows = []
    R = data["response_mask"].shape[1]
    for b in range(data.batch_size[0]):
        mask = data["attention_mask"][b].bool()
        ids = data["input_ids"][b][mask][None]
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=ids.device)[None], use_cache=False)
        n_resp = int(data["response_mask"][b].sum())
        scaled = logits.logits[0, -n_resp - 1 : -1].float().log_softmax(-1)
        lp = scaled.gather(-1, ids[0, -n_resp:, None])[:, 0]
        rows.append(torch.nn.functional.pad(lp, (0, R - n_resp)))
    return torch.stack(rows)


def measure_call(
    run: Callable[[], torch.Tensor], device: torch.device, backward: bool
) -> tuple[float, float | None, torch.Tensor | None]:
    """ms of one call, its peak GiB and its output (None after an out-of-memory)."""
    _reset_peak(device)
    try:
        sync(device)
        start = time.perf_counter()
        if backward:
            out = run()
            out.float().sum().backward()
        else:
            with torch.no_grad():
                out = run()
        sync(device)
        return (time.perf_counter() - start) * 1e3, _peak_gib(device), out.detach()
    except torch.cuda.OutOfMemoryError:
        return float("inf"), _peak_gib(device), None


def time_contenders(
    runs: dict[str, Callable[[], torch.Tensor]],
    model: torch.nn.Module,
    exact: torch.Tensor,
    device: torch.device,
    repeats: int,
    label: str,
    progress: Progress,
) -> tuple[dict[str, float], dict[str, float], dict[str, float | None], dict[str, float | None]]:
    """Each contender's best forward ms, best forward + backward ms, peak GiB and largest |difference|
    from ``exact``, over a warm-up round and ``repeats`` rounds with the contenders in turn (so drift
    on a shared machine hits them all); one progress step per contender and round."""
    fwd, fwd_bwd = dict.fromkeys(runs, float("inf")), dict.fromkeys(runs, float("inf"))
    peak: dict[str, float | None] = dict.fromkeys(runs)
    diff: dict[str, float | None] = dict.fromkeys(runs)
    progress.add(len(runs) * (repeats + 1))
    for round_ in range(repeats + 1):  # the first round warms up (kernels, allocator, lazy imports)
        for name, run in runs.items():
            with progress.step(f"{label}: {name}, {'warm-up' if round_ == 0 else f'round {round_}'}"):
                model.zero_grad(set_to_none=True)
                ms, _, out = measure_call(run, device, backward=False)
                fwd[name] = min(fwd[name], ms)
                if out is not None:
                    diff[name] = float((out.float() - exact).abs().max())
                del out
                ms, peak[name], _ = measure_call(run, device, backward=True)
                fwd_bwd[name] = min(fwd_bwd[name], ms)
    model.zero_grad(set_to_none=True)
    return fwd, fwd_bwd, peak, diff


def finite_ms(ms: float) -> float | None:
    """None for a run that ran out of memory (inf), so tables print "-" and JSON stays JSON."""
    return ms if math.isfinite(ms) else None


def bench_model_shape(
    shape: ModelShape, device: str = "cpu", repeats: int = 3, seed: int = 0, progress: Progress = QUIET
) -> list[dict]:
    """Rows of {shape, contender, fwd_ms, fwd_bwd_ms, peak_gib, max_abs_logprob_diff, real/padded}.

    ``progress`` gets one step per contender and round (announced once the contenders are known)."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    data = synthetic_batch(shape.batch, shape.prompt, shape.response, seed=seed, device=device, vocab=shape.vocab)
    model = build_model(shape, dev, torch.float32)
    with torch.no_grad():
        exact = padded_logprobs(model, data, rows_per_forward=max(1, 4096 // (shape.prompt + shape.response)))
    model.to(dtype)  # in place, once the fp32 reference is taken
    kernels = available_kernels(dev, dtype)
    if len(kernels) > 1:  # the dense fallback is for CPUs and fp32; beside a flash kernel it only takes T x T memory
        kernels.remove("sdpa")
    runs = _contenders(model, data, kernels)
    fwd, fwd_bwd, peak, diff = time_contenders(runs, model, exact, dev, repeats, shape.label, progress)
    real = int(data["attention_mask"].sum())
    return [
        {
            "shape": shape.label,
            "real/padded": f"{real}/{data['attention_mask'].numel()}",
            "contender": name,
            "fwd_ms": finite_ms(fwd[name]),
            "fwd_bwd_ms": finite_ms(fwd_bwd[name]),
            "x_padded_fwd_bwd": finite_ms(fwd_bwd["padded sdpa"] / fwd_bwd[name]),
            "peak_gib": peak[name],
            "max_abs_logprob_diff": diff[name],
        }
        for name in runs
    ]


def bench_model(
    device: str = "cpu",
    shapes: tuple[ModelShape, ...] | None = None,
    repeats: int = 3,
    on_shape: Callable[[list[dict]], None] | None = None,
    arch: str = "llama",
    progress: Progress = QUIET,
) -> list[dict]:
    """:func:`bench_model_shape` over ``shapes`` (default :func:`shapes_for` ``arch``: the GPU table's
    four on CUDA, small ones on CPU); ``on_shape`` sees each shape's rows as soon as they are measured."""
    if shapes is None:
        shapes = shapes_for(arch, device)
    rows: list[dict] = []
    for shape in shapes:
        measured = bench_model_shape(shape, device, repeats, progress=progress)
        if on_shape is not None:
            on_shape(measured)
        rows += measured
    return rows


def plot_model(rows: list[dict], path: str) -> None:
    """Forward+backward ms per shape, one bar per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    fig, ax = plt.subplots(figsize=(3 + 2.5 * len(shapes), 4.5))
    width = 0.8 / len(contenders)
    for i, name in enumerate(contenders):
        values = [
            next((r["fwd_bwd_ms"] for r in rows if r["shape"] == s and r["contender"] == name), 0.0) for s in shapes
        ]
        ax.bar(
            [x + i * width for x in range(len(shapes))],
            [v or 0 for v in values],
            width,
            label=name,
        )
    ax.set_xticks([x + width * (len(contenders) - 1) / 2 for x in range(len(shapes))], shapes, fontsize=8)
    ax.set(
        ylabel="forward + backward ms (best of repeats)",
        yscale="log",
        title="response log-probs: padded vs packed, per attention kernel (one run)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
