"""`nopad bench`: each conversion beside a per-row reference loop and the bare gather of the same bytes.

All timings of one table come from one run on one machine, so only their ratios are meaningful.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor

from nopad._apps.progress import QUIET, Progress, add_quiet_argument, sync
from nopad.batches._padding import left_right_2_no_padding, no_padding_2_padding, plan_left_right
from nopad.core._errors import check_int
from nopad.core._layout import IndexPlan, prepare_offsets, wrap_jagged
from nopad.core._ops import unpad_input
from nopad.core._torch_internals import put_checked
from nopad.diagnostics import OpCounter
from nopad.synthetic import synthetic_batch


# ---- the references ------------------------------------------------------------------------------
def reference_left_right(data: TensorDict) -> TensorDict:
    """verl 0.9's way: unpad_input for the ids, then one boolean index per row for position ids."""
    out = data.copy()
    mask = data["attention_mask"]
    ids, indices, cu_seqlens, *_ = unpad_input(data["input_ids"].unsqueeze(-1), mask)
    rows = [data["position_ids"][b][..., mask[b].bool()] for b in range(mask.shape[0])]
    out["input_ids"] = torch.nested.nested_tensor_from_jagged(ids.squeeze(-1), cu_seqlens)
    out["position_ids"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    out.set_non_tensor("indices", indices)
    return out


def bare_gather(data: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """The floor: one nonzero on the mask and one index_select per field; no checks, no nesting.

    index_select, not ``x[indices]``: on a CPU it is the faster of the two (0.10 against 0.17 ms
    per field at B=1024), and the floor should be the fastest way to move the same bytes.
    """
    indices = data["attention_mask"].flatten().nonzero().flatten()
    return data["input_ids"].flatten().index_select(0, indices), data["position_ids"].flatten().index_select(0, indices)


def bare_nested(data: TensorDict) -> TensorDict:
    """The floor of this output: :func:`bare_gather` wrapped as jagged tensors in a TensorDict with
    the same metadata, nothing checked. What torch and tensordict cost before nopad does anything."""
    mask = data["attention_mask"]
    indices = mask.flatten().nonzero().flatten()
    offsets = prepare_offsets(mask.sum(-1))
    out = data.copy()
    for key in ("input_ids", "position_ids"):
        put_checked(out, key, wrap_jagged(data[key].flatten().index_select(0, indices), offsets))
    out.set_non_tensor("max_seq_len", mask.shape[1])
    out.set_non_tensor("max_response_len", data["response_mask"].shape[1])
    out.set_non_tensor("indices", indices)
    return out


def reference_no_padding(tensor: torch.Tensor, data: TensorDict) -> torch.Tensor:
    """verl 0.9's way: lengths from the mask, then one slice and one pad per row (tensor
    scalars as bounds, so every row costs host syncs), then a stack."""
    values = tensor.values()
    attention_mask, width = data["attention_mask"], data["response_mask"].shape[1]
    prompt_lens = attention_mask[:, :-width].sum(1)
    response_lens = attention_mask[:, -width:].sum(1)
    offsets = (prompt_lens + response_lens).cumsum(0)
    rows = [F.pad(values[e - r - 1 : e - 1], (0, width - r)) for r, e in zip(response_lens, offsets)]
    return torch.stack(rows)


def timeit(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Best wall time in milliseconds over ``repeats`` calls after one warm-up."""
    return time_interleaved([fn], device, repeats)[0]


def time_interleaved(fns: Sequence[Callable[[], object]], device: str, repeats: int) -> list[float]:
    """Best wall time in milliseconds of each function, calling them in turn ``repeats`` times.

    In turn, not each in its own block: every contender then runs in the state (caches, heap)
    the round before left, instead of the state its own previous call left, which on a CPU
    favours whatever allocates least. The minimum, not the mean: noise only ever adds time.
    """
    for fn in fns:
        fn()
    sync(device)
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            sync(device)
            best[i] = min(best[i], (time.perf_counter() - start) * 1e3)
    return best


def bench_conversions(
    batch_sizes=(8, 256, 1024),
    prompt_width: int = 256,
    resp_width: int = 512,
    device: str = "cpu",
    repeats: int = 5,
    progress: Progress = QUIET,
) -> list[dict]:
    """Rows of {conversion, B, nopad_ms, loop_ms, gather_ms, loop/nopad, nopad/gather}.

    Batch sizes, widths and repeats are ints >= 1 (repeats=0 timed nothing: every time inf).
    ``progress`` counts one step per row measured."""
    batch_sizes = [check_int(b, "batch_sizes", low=1) for b in batch_sizes]
    prompt_width, resp_width = (
        check_int(prompt_width, "prompt_width", low=1),
        check_int(resp_width, "resp_width", low=1),
    )
    repeats = check_int(repeats, "repeats", low=1)
    rows = []
    for B in batch_sizes:
        rows += _bench_batch(B, prompt_width, resp_width, device, repeats, progress)
    return rows


def _bench_batch(
    B: int, prompt_width: int, resp_width: int, device: str, repeats: int, progress: Progress = QUIET
) -> list[dict]:
    data = synthetic_batch(B, prompt_width, resp_width, device=device)
    out = left_right_2_no_padding(data)
    total = out.get_non_tensor("indices").shape[0]
    row = functools.partial(_row, B, device, repeats)
    gather = lambda: bare_gather(data)
    with progress.step(f"B={B} padded -> nested"):
        to_nested = row(
            "padded -> nested", lambda: left_right_2_no_padding(data), lambda: reference_left_right(data), gather
        )
    # the rollout hands the batch over from the host, where its mask is known: a plan made there,
    # timed with the conversion (its host work included); counted on the conversion alone
    masks = data["attention_mask"].cpu(), data["response_mask"].cpu()
    with progress.step(f"B={B} padded -> nested, host plan"):
        with_host_plan = row(
            "padded -> nested, host plan",
            lambda: left_right_2_no_padding(data, plan=plan_left_right(*masks)),
            to_nested["loop_ms"],
            gather,
            counted=functools.partial(left_right_2_no_padding, data, plan=plan_left_right(*masks)),
        )
    offsets = out["input_ids"].offsets()
    logp = torch.nested.nested_tensor_from_jagged(torch.randn(total, device=device), offsets)
    src = torch.randint(0, total, (B * resp_width,), device=device)
    with progress.step(f"B={B} nested -> padded"):
        to_padded = row(
            "nested -> padded",
            lambda: no_padding_2_padding(logp, out),
            lambda: reference_no_padding(logp, data),
            lambda: logp.values().index_select(0, src),
        )
    return [to_nested, with_host_plan, to_padded]


def bench_padded_to_nested_steps(
    B: int = 1024, prompt_width: int = 256, resp_width: int = 512, device: str = "cpu", repeats: int = 60
) -> list[dict]:
    """Where padded -> nested spends its time: each step added to the one before, all timed in turn
    with the bare gather. Rows of {steps, ms, /gather}."""
    data = synthetic_batch(B, prompt_width, resp_width, device=device)
    am, rm, ids, pos = (data[k] for k in ("attention_mask", "response_mask", "input_ids", "position_ids"))

    def gathers():
        indices = plan_left_right(am, rm).indices
        return ids.flatten().index_select(0, indices), pos.flatten().index_select(0, indices)

    def nested():
        plan = plan_left_right(am, rm)
        return plan.nest(ids), plan.nest(pos)

    steps = {
        "bare gather (the floor)": lambda: bare_gather(data),
        "bare gather as jagged tensors in a TensorDict, unchecked": lambda: bare_nested(data),
        "plan_left_right + indices (validate, 1 sync)": lambda: plan_left_right(am, rm).indices,
        "+ the two index_selects": gathers,
        "+ jagged nested tensors": nested,
        "+ the TensorDict (left_right_2_no_padding)": lambda: left_right_2_no_padding(data),
        "+ check_response_mask=True": lambda: left_right_2_no_padding(data, check_response_mask=True),
    }
    times = time_interleaved(list(steps.values()), device, repeats)
    return [{"steps": name, "ms": t, "/gather": t / times[0]} for name, t in zip(steps, times)]


# ---- Megatron THD preprocessing -----------------------------------------------------------------
def reference_preprocess_thd(input_ids_nested: Tensor, *, cp_size: int, cp_rank: int, need_roll: bool) -> tuple:
    """Per-sequence zigzag THD shard (verl's preprocess_thd_engine style), the benchmark's baseline.

    Indexes one sequence of the nested tensor at a time, rolls it, pads it to a multiple of 2*cp
    (cp > 1), splits it into 2*cp chunks and keeps chunks r and 2*cp-1-r. Deliberately a Python loop.
    """
    align = 2 * cp_size if cp_size > 1 else 1
    tokens, positions = [], []
    for i in range(input_ids_nested.shape[0]):
        seq = input_ids_nested[i]
        n = seq.shape[0]
        if need_roll:
            seq = torch.roll(seq, -1, 0)
        pad = (-n) % align
        seq = torch.cat([seq, seq.new_zeros(pad, *seq.shape[1:])])
        pos = torch.cat([torch.arange(n, device=seq.device), seq.new_zeros(pad, dtype=torch.int64)])
        if cp_size == 1:
            tokens.append(seq)
            positions.append(pos)
            continue
        seq_chunks, pos_chunks = seq.chunk(align), pos.chunk(align)
        keep = (cp_rank, align - 1 - cp_rank)
        tokens += [seq_chunks[k] for k in keep]
        positions += [pos_chunks[k] for k in keep]
    return torch.cat(tokens).unsqueeze(0), torch.cat(positions).unsqueeze(0)


def bench_thd(
    batch_sizes: tuple[int, ...] = (8, 256, 1024),
    *,
    max_len: int = 768,
    cp_size: int = 2,
    repeats: int = 3,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: Progress = QUIET,
) -> list[tuple[int, float, float, float]]:
    """Time :func:`~nopad.engines._megatron.preprocess_thd` (need_roll, zigzag) against the per-sequence loop.

    Random lengths in [1, max_len]; rank 0 of ``cp_size``; tensors on ``device``. Checks both agree,
    then returns rows ``(B, ref_ms, nopad_ms, ref_ms / nopad_ms)`` (best of ``repeats``); ``progress``
    counts one step per B.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch in batch_sizes:
        with progress.step(f"B={batch} preprocess_thd"):
            rows.append(_bench_thd_batch(batch, gen, max_len, cp_size, repeats, device))
    return rows


def _bench_thd_batch(
    batch: int, gen: torch.Generator, max_len: int, cp_size: int, repeats: int, device: str | torch.device
) -> tuple[int, float, float, float]:
    from nopad.engines._megatron import ThdPlan, preprocess_thd

    lengths = torch.randint(1, max_len + 1, (batch,), generator=gen)
    values = torch.randint(0, 32000, (int(lengths.sum()),), generator=gen)
    nested = torch.nested.nested_tensor_from_jagged(values.to(device), prepare_offsets(lengths).to(device))
    ref = lambda: reference_preprocess_thd(nested, cp_size=cp_size, cp_rank=0, need_roll=True)
    ours = lambda: preprocess_thd(nested, cp_size=cp_size, cp_rank=0, need_roll=True)
    ref_tokens, _ = ref()
    # verl's roll puts a sequence's first token in its last label slot; nopad puts the pad id (0)
    last = ThdPlan.from_nested(nested, cp_size=cp_size, cp_rank=0).shard(IndexPlan.from_nested(nested).last_token_mask)
    if not torch.equal(torch.where(last, 0, ref_tokens), ours()[0]):
        raise AssertionError(f"bench_thd: preprocess_thd disagrees with the reference at B={batch}")
    ref_ms = timeit(ref, str(device), 1 if batch >= 512 else repeats)
    ours_ms = timeit(ours, str(device), repeats)
    return batch, ref_ms, ours_ms, ref_ms / ours_ms


def _row(B, device, repeats, name, ours, loop, gather, counted=None) -> dict:
    """``loop``: the per-row reference to time, or its time (ms) when another row already took it.
    Ops and syncs are counted on one call of ``counted`` (default ``ours``)."""
    with OpCounter() as counter:
        (counted or ours)()
    # the loop runs on its own: its thousands of small allocations would flush what the other two use
    t_ours, t_gather = time_interleaved([ours, gather], device, repeats)
    t_loop = loop if isinstance(loop, float) else timeit(loop, device, repeats)
    return {
        "conversion": name,
        "B": B,
        "ops": counter.ops,
        "syncs": counter.syncs,
        "nopad_ms": t_ours,
        "loop_ms": t_loop,
        "gather_ms": t_gather,
        "loop/nopad": t_loop / t_ours,
        "nopad/gather": t_ours / t_gather,
    }


def format_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])

    def fmt(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2e}" if 0 < abs(v) < 1e-2 else f"{v:.3f}"
        return str(v)

    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(fmt(r[c]).rjust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["conversion"] for r in rows))  # in the order measured
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        sel = [r for r in rows if r["conversion"] == name]
        Bs = [r["B"] for r in sel]
        for key, label, style in (
            ("loop_ms", "per-row loop (verl 0.9)", "o--"),
            ("nopad_ms", "nopad", "s-"),
            ("gather_ms", "bare gather (floor)", "^:"),
        ):
            ax.plot(Bs, [r[key] for r in sel], style, label=label)
        ax.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="ms (best of repeats)", title=name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("nopad vs a per-row loop: time against batch size (one run, one machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[8, 256, 1024], metavar="B", help="rows per batch"
    )
    parser.add_argument("--prompt-len", type=int, default=256, help="padded prompt width")
    parser.add_argument("--response-len", type=int, default=512, help="padded response width")
    parser.add_argument("--device", default="cpu", help="a torch device: cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--repeats", type=int, default=10, help="timed calls per contender, the best kept (--model: at most 5)"
    )
    parser.add_argument(
        "--packing",
        action="store_true",
        help="also run the packing benchmarks: bins of 100,000 lengths, rows built from 20,000 conversations, "
        "a packed file of 50,000 written and read",
    )
    parser.add_argument("--engines", action="store_true", help="also run the Megatron THD preprocessing benchmark")
    parser.add_argument("--steps", action="store_true", help="also split padded -> nested at the largest B into steps")
    parser.add_argument(
        "--batches",
        action="store_true",
        help="also the rows of nested batches: mini-batch select, token-budget micro-batches, the join and "
        "restore of outputs and the partition alone, against verl's utilities (a per-row loop without verl)",
    )
    parser.add_argument(
        "--batch-rows",
        type=int,
        nargs="+",
        default=[256, 1024, 4096],
        metavar="B",
        help="batch sizes of --batches (verl's side takes about a minute at 4096)",
    )
    parser.add_argument("--all", action="store_true", help="conversions, steps, engines, batches and packing")
    parser.add_argument(
        "--model",
        action="store_true",
        help="instead: a causal LM's log-probs, padded vs packed with each attention kernel",
    )
    from nopad.synthetic import ARCHS

    parser.add_argument(
        "--arch",
        default="llama",
        choices=sorted(ARCHS),
        help="the model family of --model (qwen3_5, bamba, ...: layers that carry state)",
    )
    parser.add_argument(
        "--share-prefixes",
        action="store_true",
        help="with --model: GRPO groups (n samples of a prompt, n in 1, 4, 8, 16), padded, packed and packed "
        "with each group's prompt computed once",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --model: torch.compile's packed forward against eager packed and compiled padded over "
        "batches of random lengths: first-pass compile time, graphs, recompiles, steady-state time",
    )
    parser.add_argument(
        "--compile-batches", type=int, default=None, metavar="N", help="batches of --compile (default 8; 16 on CUDA)"
    )
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend of --compile (inductor, aot_eager, ...)"
    )
    parser.add_argument(
        "--dynamic",
        default="true",
        choices=("true", "false", "auto"),
        help="torch.compile's dynamic of --compile (auto: torch's default, None)",
    )
    parser.add_argument(
        "--bucket",
        type=int,
        default=None,
        metavar="N",
        help="with --compile: also the packed row length-bucketed (prepare_model_inputs' bucket=N), its padding shown",
    )
    parser.add_argument(
        "--head",
        action="store_true",
        help="instead: the output head's peak memory and forward+backward time, logits vs chunked (and verl's)",
    )
    from nopad._apps.bench_head import add_arguments as add_head_arguments

    add_head_arguments(parser)
    parser.add_argument(
        "--trl",
        action="store_true",
        help="instead: the per-token log-prob call of one GRPO step, TRL 1.16 alone against "
        "nopad.integrations.trl.install(): time and peak memory (needs trl)",
    )
    from nopad._apps.bench_trl import add_arguments as add_trl_arguments

    add_trl_arguments(parser)
    parser.add_argument(
        "--plot", metavar="FILE.png", help="write time against batch size to this PNG (default: no plot)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_quiet_argument(parser)


def run_model(args: argparse.Namespace) -> int:
    from nopad._apps.bench_model import bench_model, plot_model

    repeats = min(args.repeats, 5)
    if not args.json:
        print(
            f"device={args.device}  threads={torch.get_num_threads()}  (best of {repeats}; "
            "packed includes both conversions; diff against an fp32 padded forward)"
        )
    # a table per shape as soon as it is measured: the large GPU shapes take a while each
    show = None if args.json else (lambda rows: print(f"\n{format_table(rows)}", flush=True))
    if args.compile:
        return _run_compile(args, repeats, show)
    if args.share_prefixes:
        from nopad._apps.bench_prefixes import bench_groups

        with Progress("nopad bench --model --share-prefixes", 0, quiet=args.quiet) as progress:
            rows = bench_groups(args.device, repeats=repeats, on_shape=show, progress=progress)
        if args.json:
            print(json.dumps({"share_prefixes": rows}, indent=2))
        return 0
    with Progress("nopad bench --model", 0, quiet=args.quiet) as progress:
        rows = bench_model(args.device, repeats=repeats, on_shape=show, arch=args.arch, progress=progress)
    if args.json:
        print(json.dumps({"model": rows}, indent=2))
    if args.plot:
        plot_model(rows, args.plot)
    return 0


def _run_compile(args: argparse.Namespace, repeats: int, show: Callable[[list[dict]], None] | None) -> int:
    import dataclasses

    from nopad._apps.bench_compile import CPU_COMPILE, GPU_COMPILE, bench_compile

    shape = GPU_COMPILE if torch.device(args.device).type == "cuda" else CPU_COMPILE
    shape = dataclasses.replace(shape, model=dataclasses.replace(shape.model, arch=args.arch))
    if args.compile_batches is not None:
        shape = dataclasses.replace(shape, batches=check_int(args.compile_batches, "--compile-batches", low=1))
    bucket = None if args.bucket is None else check_int(args.bucket, "--bucket", low=1)
    dynamic = {"true": True, "false": False, "auto": None}[args.dynamic]
    if not args.json:
        print(f"torch {torch.__version__}  backend={args.backend}  dynamic={dynamic}")
    with Progress("nopad bench --model --compile", 0, quiet=args.quiet) as progress:
        rows = bench_compile(shape, args.device, repeats, args.backend, dynamic, bucket, progress=progress)
    if show is not None:
        show(rows)
    else:
        print(json.dumps({"compile": rows}, indent=2))
    return 0


def _steps(args: argparse.Namespace) -> int:
    """The progress steps of a run: one per row measured (per batch size and conversion, ...)."""
    from nopad._apps.bench_rows import STEPS_PER_BATCH
    from nopad.packing._algorithms import ALGORITHMS

    steps = 3 * len(args.batch_sizes) + int(args.steps) + len(args.batch_sizes) * int(args.engines)
    steps += STEPS_PER_BATCH * len(args.batch_rows) * int(args.batches)
    return steps + (2 * len(ALGORITHMS) + 3) * int(args.packing)


def _bench_all(args: argparse.Namespace, progress: Progress) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {}
    results["conversions"] = bench_conversions(
        args.batch_sizes, args.prompt_len, args.response_len, args.device, args.repeats, progress=progress
    )
    if args.steps:
        B = max(args.batch_sizes)
        with progress.step(f"B={B} padded -> nested in steps"):
            results[f"padded -> nested in steps (B={B})"] = bench_padded_to_nested_steps(
                B, args.prompt_len, args.response_len, args.device, max(args.repeats, 60)
            )
    if args.engines:
        thd = bench_thd(tuple(args.batch_sizes), device=args.device, repeats=args.repeats, progress=progress)
        results["megatron preprocess_thd (need_roll, cp=2)"] = [
            {"B": B, "loop_ms": ref, "nopad_ms": ours, "loop/nopad": ratio} for B, ref, ours, ratio in thd
        ]
    if args.batches:
        from nopad._apps.bench_rows import BUDGET, bench_rows

        title = f"rows of nested batches (3 nested fields, lengths in [64, 4096), micro-batches of {BUDGET:,} tokens)"
        results[title] = bench_rows(tuple(args.batch_rows), repeats=args.repeats, device=args.device, progress=progress)
    if args.packing:
        from nopad._apps.bench_packing import CONVERSATION_MEDIAN, files_bench, packing_bench, rows_bench

        results["packing (100,000 lengths, capacity 8192)"] = packing_bench(progress=progress)
        title = f"packing rows built (20,000 conversations, median {CONVERSATION_MEDIAN} tokens, pack length 8192)"
        results[title] = rows_bench(repeats=max(1, min(args.repeats, 3)), progress=progress)
        title = "packed file (50,000 conversations, pack length 4096, best fit)"
        results[title] = files_bench(progress=progress)
    return results


def run(args: argparse.Namespace) -> int:
    if args.model:
        return run_model(args)
    if args.head:
        from nopad._apps.bench_head import run as run_head

        return run_head(args, format_table)
    if args.trl:
        from nopad._apps.bench_trl import run as run_trl

        return run_trl(args, format_table)
    if args.all:
        args.engines = args.packing = args.steps = args.batches = True
    with Progress("nopad bench", _steps(args), quiet=args.quiet) as progress:
        results = _bench_all(args, progress)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(
            f"device={args.device}  prompt_width={args.prompt_len}  response_width={args.response_len}  "
            f"threads={torch.get_num_threads()}  (best of {args.repeats}; ratios from one run)"
        )
        for name, rows in results.items():
            print(f"\n== {name} ==\n{format_table(rows)}")
    if args.plot:
        plot(results["conversions"], args.plot)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    return 0


__all__ = [
    "bench_conversions",
    "bench_thd",
    "reference_preprocess_thd",
    "bare_gather",
    "bare_nested",
    "format_table",
    "plot",
    "reference_left_right",
    "synthetic_batch",
]
