"""`nopad bench --model --compile`: a routed model's packed forward under ``torch.compile``, against
the eager packed forward and the compiled padded one, on the same batches of random lengths.

For one shape (N batches of a random number of rows, each of long-tailed prompt and response
lengths) it runs, on one random-weight model:

- ``eager packed``: ``use_packed_attention``'s model, not compiled (the packed row and its
  boundaries from ``prepare_model_inputs``, the log-probs from ``prepare_model_outputs``);
- ``compiled packed``: the same model ``torch.compile``-d;
- ``compiled packed, bucket N`` (with ``bucket``): the row length-bucketed (``prepare_model_inputs``'
  ``bucket``), compiled the same way, its padding reported;
- ``compiled padded``: the plain model (sdpa, attention mask) compiled the same way.

``dynamic`` is ``torch.compile``'s (True: symbolic sizes from the start; None, torch's default:
static first, then what changed made symbolic; False: one graph per shape). Each compiled
contender's first pass (forward + backward over the N batches, one batch at a time, dynamo's caches
reset before it) takes its compiles: its seconds, the graphs dynamo built and how many of them came
after the first batch (recompiles: shapes the first batch's graphs did not cover) and the graph
breaks, from dynamo's counters. Then
:func:`nopad._apps.bench_model.time_contenders` takes the steady state: forward and forward +
backward over the N batches, best of the repeats with the contenders in turn, peak GiB (CUDA) and
the largest |log-prob difference| over response tokens against an fp32 eager padded forward.
Packed timings include the conversions a trainer pays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from tensordict import TensorDict
from torch._dynamo.utils import counters

from nopad._apps.bench_model import ModelShape, build_model, finite_ms, measure_call, time_contenders
from nopad._apps.progress import QUIET, Progress
from nopad.batches._padding import left_right_2_no_padding, no_padding_2_padding
from nopad.core._layout import bucket_length
from nopad.engines._fsdp import padded_logprobs, prepare_model_inputs, prepare_model_outputs
from nopad.modeling import use_packed_attention
from nopad.synthetic import synthetic_batch

EAGER, COMPILED, PADDED = "eager packed", "compiled packed", "compiled padded"


@dataclass(frozen=True)
class CompileShape:
    """``batches`` batches of ``rows // 2`` to ``rows`` rows (drawn per batch), prompts up to
    ``prompt`` and responses up to ``response`` tokens (long-tailed), on the model ``model``."""

    batches: int
    rows: int
    prompt: int
    response: int
    model: ModelShape

    @property
    def label(self) -> str:
        m = self.model
        batches = f"{self.batches} batches of B<={self.rows} P={self.prompt} R={self.response}"
        return f"{m.arch} h={m.hidden} x{m.layers}, {batches}"


CPU_COMPILE = CompileShape(8, 16, 64, 192, ModelShape(0, 0, 0, hidden=256, layers=2, heads=8, kv_heads=4, vocab=4000))
# a 1,024-wide 8-layer Llama, batches of up to 32 rows of up to 3,072 tokens
GPU_COMPILE = CompileShape(16, 32, 1024, 2048, ModelShape(0, 0, 0))


def compile_batches(shape: CompileShape, device: str, seed: int = 0) -> list[TensorDict]:
    """The shape's padded batches: each its own row count and lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(max(1, shape.rows // 2), shape.rows + 1, (shape.batches,), generator=g).tolist()
    return [
        synthetic_batch(n, shape.prompt, shape.response, seed=seed + i, device=device, vocab=shape.model.vocab)
        for i, n in enumerate(rows)
    ]


def _packed(model: torch.nn.Module, data: TensorDict, bucket: int | None) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        micro = left_right_2_no_padding(data)
        inputs, args = prepare_model_inputs(micro, attn_implementation="nopad_varlen", bucket=bucket)
        log_probs = prepare_model_outputs(model(**inputs), args)["log_probs"]
        return no_padding_2_padding(log_probs, micro)

    return run


def _padded(model: torch.nn.Module, data: TensorDict) -> Callable[[], torch.Tensor]:
    return lambda: padded_logprobs(model, data)


def _contenders(
    routed: torch.nn.Module,
    plain: torch.nn.Module,
    data: list[TensorDict],
    backend: str,
    dynamic: bool | None,
    bucket: int | None,
) -> dict[str, list[Callable[[], torch.Tensor]]]:
    """Each contender's per-batch calls, (B, R) response log-probs each."""
    compiled = cast(torch.nn.Module, torch.compile(routed, backend=backend, dynamic=dynamic))
    padded = cast(torch.nn.Module, torch.compile(plain, backend=backend, dynamic=dynamic))
    runs = {
        EAGER: [_packed(routed, one, None) for one in data],
        COMPILED: [_packed(compiled, one, None) for one in data],
    }
    if bucket is not None:
        runs[f"{COMPILED}, bucket {bucket}"] = [_packed(compiled, one, bucket) for one in data]
    runs[PADDED] = [_padded(padded, one) for one in data]
    return runs


def _in_turn(calls: list[Callable[[], torch.Tensor]]) -> Callable[[], torch.Tensor]:
    """One call over the batches: their (B, R) log-probs stacked."""
    return lambda: torch.cat([call() for call in calls])


def first_pass(calls: list[Callable[[], torch.Tensor]], device: torch.device) -> dict[str, float | int]:
    """Seconds of forward + backward over the batches in turn (the compiles, from empty caches), with
    dynamo's graphs, those built after the first batch (recompiles) and graph breaks."""
    torch._dynamo.reset()  # this contender's graphs alone (an earlier one's recompile in the warm-up round)
    counters.clear()
    seconds, after_first = 0.0, 0
    for index, call in enumerate(calls):
        ms, _, _ = measure_call(call, device, backward=True)
        seconds += ms / 1e3
        if index == 0:
            after_first = counters["stats"]["unique_graphs"]
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    return {"first_pass_s": seconds, "graphs": graphs, "recompiles": graphs - after_first, "graph_breaks": breaks}


def _tokens(data: list[TensorDict], bucket: int | None) -> tuple[int, int, int]:
    """Real tokens, the padded form's slots and the bucketed rows' tokens over the batches."""
    real = [int(one["attention_mask"].sum()) for one in data]
    slots = sum(one["attention_mask"].numel() for one in data)
    bucketed = sum(real) if bucket is None else sum(bucket_length(n, bucket) for n in real)
    return sum(real), slots, bucketed


def bench_compile(
    shape: CompileShape,
    device: str = "cpu",
    repeats: int = 3,
    backend: str = "inductor",
    dynamic: bool | None = True,
    bucket: int | None = None,
    seed: int = 0,
    progress: Progress = QUIET,
) -> list[dict]:
    """Rows of {shape, contender, tokens, padding, first_pass_s, graphs, recompiles, graph_breaks,
    fwd_ms, fwd_bwd_ms, x_eager_packed_fwd_bwd, x_compiled_padded_fwd_bwd, peak_gib,
    max_abs_logprob_diff}; graph counts are None for the eager contender. ``nopad bench`` passes
    :data:`GPU_COMPILE` on CUDA, :data:`CPU_COMPILE` elsewhere."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    data = compile_batches(shape, device, seed)
    plain = build_model(shape.model, dev, torch.float32)
    with torch.no_grad():
        rows = max(1, 4096 // (shape.prompt + shape.response))  # a few rows a forward: fits where the batch does not
        exact = torch.cat([padded_logprobs(plain, one, rows_per_forward=rows) for one in data])
    plain = plain.to(dtype).train()  # what a trainer compiles (the random models' dropout is 0)
    routed = build_model(shape.model, dev, dtype).train()
    routed.load_state_dict(plain.state_dict())
    routed = use_packed_attention(routed)
    calls = _contenders(routed, plain, data, backend, dynamic, bucket)
    stats: dict[str, dict] = {}
    progress.add(len(calls))
    for name, per_batch in calls.items():
        with progress.step(f"{shape.label}: {name}, first pass"):
            stats[name] = first_pass(per_batch, dev)
    runs = {name: _in_turn(per_batch) for name, per_batch in calls.items()}
    both = torch.nn.ModuleList([plain, routed])  # zero_grad of both between calls
    fwd, fwd_bwd, peak, diff = time_contenders(runs, both, exact, dev, repeats, shape.label, progress)
    real, slots, bucketed = _tokens(data, bucket)
    tokens = dict.fromkeys(runs, real) | {PADDED: slots}
    if bucket is not None:
        tokens[f"{COMPILED}, bucket {bucket}"] = bucketed
    return [
        {
            "shape": shape.label,
            "contender": name,
            "tokens": tokens[name],
            "padding": round(tokens[name] / real - 1, 4),
            "first_pass_s": round(stats[name]["first_pass_s"], 3),
            **{key: None if name == EAGER else stats[name][key] for key in ("graphs", "recompiles", "graph_breaks")},
            "fwd_ms": finite_ms(fwd[name]),
            "fwd_bwd_ms": finite_ms(fwd_bwd[name]),
            "x_eager_packed_fwd_bwd": finite_ms(fwd_bwd[EAGER] / fwd_bwd[name]),
            "x_compiled_padded_fwd_bwd": finite_ms(fwd_bwd[PADDED] / fwd_bwd[name]),
            "peak_gib": peak[name],
            "max_abs_logprob_diff": diff[name],
        }
        for name in runs
    ]
