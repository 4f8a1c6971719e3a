"""`nopad bench --head`: the output head's peak memory and forward+backward time, logits vs chunked.

Each (contender, T) runs in a fresh child process: a process's resident set never shrinks, so the
peak of one configuration would hide the next. The child builds the inputs (hidden (T, H), the
(V, H) output weight, labels), notes its memory, runs log-prob + entropy forward and backward
(the loss weighs both) ``repeats`` times and reports the best time and the peak memory above the
inputs: on a CPU the process's peak resident set (``ru_maxrss``) minus the one after the inputs
were built, on CUDA ``max_memory_allocated`` minus the allocation after the inputs. The gradients
of hidden and weight count as memory above the inputs, the same for every contender.

Contenders:

    logits    (T, V) logits, then nopad's ``token_log_probs`` (what ``packed_logprobs(head="logits")`` does)
    chunked   nopad's ``head_log_probs`` (what ``packed_logprobs`` does by default)
    resp25    the chunked head on 25% of the T rows (``tokens="response"``: one gather, the head, one
    resp50    scatter back to (T,)), 50%; against 25% (50%) of ``chunked``'s time
    tp2, tp4  the chunked head split over 2 / 4 gloo ranks, each holding a (V / tp, H) shard of the
              weight (``head_log_probs(tp_group=)``; CPU only): the slowest rank's time, the largest
              rank's peak; the ranks share the measuring process's threads
    verl      verl 0.9.1's ``FusedLinearForPPO`` (torch backend, chunks of 512), where verl is importable
    liger     Liger-Kernel's fused linear cross-entropy with entropy and temperature (verl's ``liger``
              backend: ``LigerFusedLinearScaledCrossEntropyFunction``), on CUDA where it is installed
    chunked_lp   the tiles, log-probs only            } where cut_cross_entropy loads, on CUDA: the
    fused_lp     cut_cross_entropy, log-probs only    } fused kernel against the tiles on its own terms

Every configuration announces itself on stderr when it starts and prints its result when it ends
(one line each, ``--quiet`` none): a long run is never silent.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from nopad.core._errors import input_error

GIB = 1024**3
CONTENDERS = ("logits", "chunked", "resp25", "resp50", "tp2", "tp4", "verl", "liger", "chunked_lp", "fused_lp")
FUSED = ("chunked_lp", "fused_lp")
FRACTIONS = {"resp25": 0.25, "resp50": 0.5}
TP = {"tp2": 2, "tp4": 4}


def _inputs(
    tokens: int, hidden: int, vocab: int, device: str, dtype: torch.dtype, seed: int = 0, shard: int = 1
) -> dict[str, Any]:
    """Drawn in place, on the device, in their dtype: nothing larger than an input is ever allocated,
    so the memory noted after this is the inputs' own. ``shard``: the weight is one rank's (V / shard, H)
    rows of a vocabulary-parallel layer (the labels stay global)."""
    torch.manual_seed(seed)
    h = torch.empty(tokens, hidden, device=device, dtype=dtype).normal_(0.0, 2.0).requires_grad_()
    w = torch.empty(vocab // shard, hidden, device=device, dtype=dtype).normal_(0.0, hidden**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)
    weights = torch.randn(2, tokens, device=device)
    return {"hidden": h, "weight": w, "labels": labels, "weights": weights}


def _response_rows(tokens: int, fraction: float, device: str) -> Any:
    """The scored positions of ``tokens`` in rows of 512 whose last ``fraction`` are the response."""
    from nopad.modeling._logprobs import ScoredTokens

    row = 512
    index = torch.arange(tokens, device=device)
    per_row = index % row
    keep = (per_row >= row - round(fraction * row)) | (index >= tokens - tokens % row)  # a short tail row: all
    return ScoredTokens(index[keep], None, tokens, "response")


def _step(contender: str, x: dict[str, Any], temperature: float, chunk_size: int | None) -> None:
    from nopad.modeling._logprobs import head_log_probs, token_log_probs

    hidden, weight, labels = x["hidden"], x["weight"], x["labels"]
    if contender in FRACTIONS:  # what chunked_head does for tokens="response"
        scored = x["scored"]
        lp, ent = head_log_probs(scored.rows(hidden), weight, scored.rows(labels), temperature, True, chunk_size)
        assert ent is not None
        lp, ent = scored.place(lp), scored.place(ent)
    elif contender in TP:
        lp, ent = head_log_probs(hidden, weight, labels, temperature, True, chunk_size, tp_group=x["group"])
    elif contender == "liger":
        from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction as liger

        nll, ent = liger.apply(hidden, weight, labels, temperature, -100, 1, True)
        lp = -nll
    elif contender == "logits":
        lp, ent = token_log_probs(hidden @ weight.T, labels, temperature, with_entropy=True)
    elif contender == "chunked":
        lp, ent = head_log_probs(hidden, weight, labels, temperature, True, chunk_size)
    elif contender == "verl":
        from verl.utils.experimental.torch_functional import FusedLinearForPPO

        lp, ent = FusedLinearForPPO()(hidden, weight, labels, temperature)
    elif contender in FUSED:
        kernel = "tiles" if contender == "chunked_lp" else "cut_cross_entropy"
        lp, ent = head_log_probs(hidden, weight, labels, temperature, False, chunk_size, kernel=kernel)
    else:
        raise input_error("contender", None, f"one of {list(CONTENDERS)}", repr(contender))
    loss = (lp * x["weights"][0]).sum()
    if contender not in FUSED:
        assert ent is not None
        loss = loss + (ent.float() * x["weights"][1]).sum()
    loss.backward()
    hidden.grad = weight.grad = None


def _rss_peak_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def measure(
    contender: str,
    tokens: int,
    *,
    hidden: int = 896,
    vocab: int = 151_936,
    device: str = "cpu",
    dtype: str = "float32",
    repeats: int = 1,
    temperature: float = 0.9,
    chunk_size: int | None = None,
    threads: int | None = None,
    group: Any = None,
) -> dict[str, Any]:
    """One configuration, in THIS process (the CLI runs it in a child): {ms, cpu_ms, peak_gib} above the inputs.

    A TP contender runs its ranks in processes of their own (gloo) and reports the slowest rank's time
    and the largest peak; each rank measures its shard with ``group``, the ranks' process group."""
    if contender in TP and group is None:
        return _measure_tp(dict(locals()))  # this call's arguments, for the ranks
    if threads is not None:
        torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    cuda = device.startswith("cuda")
    fraction = FRACTIONS.get(contender)
    shard = TP.get(contender, 1)

    def inputs(T: int, V: int) -> dict[str, Any]:
        x = _inputs(T, hidden, V, device, torch_dtype, shard=shard)
        if shard > 1:
            x["group"] = group
        if fraction is not None:
            x["scored"] = _response_rows(T, fraction, device)
        return x

    _step(contender, inputs(8, 64 * shard), temperature, chunk_size)  # one-time set-up
    x = inputs(tokens, vocab)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = _rss_peak_bytes()
    best, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        _step(contender, x, temperature, chunk_size)
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
        if wall < best:
            best, cpu = wall, time.process_time() - start_cpu
    peak = torch.cuda.max_memory_allocated(device) if cuda else _rss_peak_bytes()
    return {"contender": contender, "T": tokens, "ms": best * 1e3, "cpu_ms": cpu * 1e3, "peak_gib": (peak - base) / GIB}


def _measure_tp(config: dict[str, Any]) -> dict[str, Any]:
    """The ranks of a TP contender (``config``: :func:`measure`'s arguments) on the CPU, each in its own
    process (gloo), sharing ``threads``."""
    import socket

    import torch.multiprocessing as mp

    size = TP[config["contender"]]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config.update(device="cpu", threads=max(1, (config["threads"] or torch.get_num_threads()) // size))
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_tp_rank, args=(size, port, config, results), nprocs=size, join=True, start_method="spawn")
        ranks = [results[r] for r in range(size)]
    slowest = max(ranks, key=lambda r: r["ms"])
    return {**slowest, "peak_gib": max(r["peak_gib"] for r in ranks)}


def _tp_rank(rank: int, size: int, port: int, config: dict[str, Any], results: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        results[rank] = measure(**{**config, "group": dist.group.WORLD})
    finally:
        dist.destroy_process_group()


def _child(config: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """:func:`measure` in a fresh interpreter (this checkout first on its path)."""
    code = (
        "import json, sys; from nopad._apps.bench_head import measure; "
        "print(json.dumps(measure(**json.loads(sys.argv[1]))))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # nopad/_apps/ -> the checkout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, json.dumps(config)], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"contender": config["contender"], "T": config["tokens"], "error": f"over {timeout:.0f} s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["killed (out of memory?)"])[-1]
        return {"contender": config["contender"], "T": config["tokens"], "error": last[-200:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def verl_importable() -> bool:
    return importlib.util.find_spec("verl") is not None


def liger_runnable(device: str) -> bool:
    """Whether Liger-Kernel's fused linear cross-entropy (the form with entropy) loads (CUDA only)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or a release without that function
        return False
    return True


def fused_runnable(device: str) -> bool:
    """Whether cut_cross_entropy's fused kernel loads and runs on ``device`` (CUDA only)."""
    from nopad.modeling._logprobs import kernel_installed

    return torch.device(device).type == "cuda" and kernel_installed("cut_cross_entropy")


def bench_head(
    tokens: tuple[int, ...] = (2048, 4096, 8192),
    *,
    hidden: int = 896,
    vocab: int = 151_936,
    device: str = "cpu",
    dtype: str = "float32",
    rounds: int = 1,
    repeats: int = 1,
    logits_max_tokens: int | None = None,
    chunk_size: int | None = None,
    threads: int | None = None,
    contenders: tuple[str, ...] = CONTENDERS,
    timeout: float | None = None,
    on_row=None,
    on_config=None,
) -> list[dict[str, Any]]:
    """Rows of {T, <contender>_ms, <contender>_gib, ratios} over ``tokens``.

    Each (contender, T) runs ``rounds`` times, each in a fresh child process, the contenders in
    turn (so a busy spell on a shared machine hits them alike), ``repeats`` timed calls per
    child; the best wall time is kept (with the process CPU time of that call, ``<contender>_cpu_ms``)
    and the largest peak. ``logits_max_tokens``: the logits path runs only up to this T (its
    (T, V) buffers grow by several GiB per 2,048 tokens at this vocabulary); None runs it everywhere.
    Contenders that cannot run here are left out (verl where it is not importable, TP off the CPU,
    Liger and cut_cross_entropy off CUDA or where they do not load). ``on_config(k, n, config,
    result)`` is called before each measurement (``result`` None) and after it.
    """
    contenders = runnable_contenders(contenders, device, vocab)
    runnable = {  # the logits path only up to logits_max_tokens
        T: [c for c in contenders if not (c == "logits" and logits_max_tokens is not None and T > logits_max_tokens)]
        for T in tokens
    }
    total = rounds * sum(len(runnable[T]) for T in tokens)
    common = dict(hidden=hidden, vocab=vocab, device=device, dtype=dtype, repeats=repeats)
    common.update(chunk_size=chunk_size, threads=threads)
    done = 0
    rows = []
    for T in tokens:
        row: dict[str, Any] = {"T": T}
        for contender in contenders:
            row[f"{contender}_ms"] = row[f"{contender}_cpu_ms"] = row[f"{contender}_gib"] = None
        for _ in range(rounds):
            for contender in runnable[T]:
                config = dict(contender=contender, tokens=T, **common)
                done += 1
                if on_config is not None:
                    on_config(done, total, config, None)
                result = _child(config, timeout)
                if on_config is not None:
                    on_config(done, total, config, result)
                if "error" in result:
                    row[f"{contender}_error"] = result["error"]
                    continue
                if row[f"{contender}_ms"] is None or result["ms"] < row[f"{contender}_ms"]:
                    row[f"{contender}_ms"], row[f"{contender}_cpu_ms"] = result["ms"], result["cpu_ms"]
                row[f"{contender}_gib"] = max(row[f"{contender}_gib"] or 0.0, result["peak_gib"])
        pairs = [("chunked", "logits"), ("chunked", "verl"), ("chunked", "liger"), ("fused_lp", "chunked_lp")]
        pairs += [(tp, "chunked") for tp in TP]
        for ours, other in pairs:
            if row.get(f"{other}_ms") and row.get(f"{ours}_ms"):
                row[f"{ours}/{other} time"] = row[f"{ours}_ms"] / row[f"{other}_ms"]
        for name, fraction in FRACTIONS.items():  # against that share of the all-token head's time
            if row.get(f"{name}_ms") and row.get("chunked_ms"):
                row[f"{name}/({fraction:g} chunked) time"] = row[f"{name}_ms"] / (fraction * row["chunked_ms"])
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def runnable_contenders(contenders: tuple[str, ...], device: str, vocab: int) -> tuple[str, ...]:
    """``contenders`` less those that cannot run here."""
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        raise input_error("contenders", None, f"names from {list(CONTENDERS)}", repr(unknown))
    cpu = torch.device(device).type == "cpu"
    skip = set()
    if not verl_importable():
        skip.add("verl")
    if not liger_runnable(device):
        skip.add("liger")
    if not fused_runnable(device):
        skip |= set(FUSED)
    skip |= {c for c, size in TP.items() if not cpu or vocab % size}
    return tuple(c for c in contenders if c not in skip)


def growth(rows: list[dict[str, Any]], contender: str = "chunked") -> float | None:
    """Peak memory at the largest T minus at the smallest (GiB), for one contender."""
    measured = [r for r in rows if r.get(f"{contender}_gib") is not None]
    if len(measured) < 2:
        return None
    return measured[-1][f"{contender}_gib"] - measured[0][f"{contender}_gib"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``nopad bench --head`` adds (each prefixed ``--head-``)."""
    parser.add_argument("--head-tokens", type=int, nargs="+", default=None, help="T values (default: by device)")
    parser.add_argument("--head-hidden", type=int, default=896)
    parser.add_argument("--head-vocab", type=int, default=151_936)
    parser.add_argument("--head-dtype", choices=("float32", "bfloat16"), default=None, help="default: by device")
    parser.add_argument(
        "--head-logits-max",
        type=int,
        default=None,
        help="run the logits path only up to this T (default: 4096 on a CPU, every T on CUDA)",
    )
    parser.add_argument("--head-chunk-size", type=int, default=None, help="the chunked head's tokens per tile")
    parser.add_argument(
        "--head-threads", type=int, default=None, help="intra-op threads in each measuring process (default: torch's)"
    )
    parser.add_argument(
        "--head-contenders",
        nargs="+",
        choices=CONTENDERS,
        default=None,
        metavar="NAME",
        help=f"which to measure, of {' '.join(CONTENDERS)} (default: every one that runs here)",
    )
    parser.add_argument(
        "--head-rounds", type=int, default=None, help="fresh processes per configuration, best kept (default: 1)"
    )


def run(args: argparse.Namespace, format_table: Callable[[list[dict[str, Any]]], str]) -> int:
    """``nopad bench --head`` (``format_table`` is the bench's table printer)."""
    cuda = args.device.startswith("cuda")
    # CPU: modest sizes by default (each call at T = 2,048 takes about 13 s on two cores; every
    # configuration runs in a process of its own): pass --head-tokens for more
    tokens = tuple(args.head_tokens or ((4096, 8192, 16384, 32768) if cuda else (1024, 2048)))
    dtype = args.head_dtype or ("bfloat16" if cuda else "float32")
    logits_max = args.head_logits_max if args.head_logits_max is not None else (None if cuda else 4096)
    # CPU: one fresh process per configuration (--head-rounds for more, taken in turn); CUDA: the best
    # of up to 3 calls in it (the first pays for the kernels' set-up)
    repeats = max(1, min(args.repeats, 3)) if cuda else 1
    rounds = args.head_rounds or 1
    contenders = runnable_contenders(tuple(args.head_contenders or CONTENDERS), args.device, args.head_vocab)
    quiet = getattr(args, "quiet", False)
    if not args.json:
        print(
            f"device={args.device}  dtype={dtype}  H={args.head_hidden}  V={args.head_vocab}  "
            f"threads={args.head_threads or torch.get_num_threads()}  log-prob + entropy, forward + backward; "
            f"best of {rounds} process(es) x {repeats} call(s), taken in turn; peak memory above the inputs "
            "(gradients included)"
        )
        if logits_max is not None and any(T > logits_max for T in tokens):
            print(
                f"the logits path runs only up to T={logits_max} (--head-logits-max): its (T, V) buffers "
                f"need several GiB more per 2,048 tokens at this vocabulary"
            )
        if not verl_importable():
            print("verl is not importable here: no FusedLinearForPPO column (run in verl's environment for it)")
        print(f"contenders: {' '.join(contenders)}", flush=True)

    def show(row):
        if not args.json:
            print(format_table([row]), flush=True)

    def progress(k: int, n: int, config: dict[str, Any], result: dict[str, Any] | None) -> None:
        """One line on stderr when a configuration starts and one when it ends: never silent for minutes."""
        if quiet:
            return
        what = f"[{k}/{n}] {config['contender']} T={config['tokens']}"
        if result is None:
            line = f"{what} ..."
        elif "error" in result:
            line = f"{what}: {result['error']}"
        else:
            line = f"{what}: {result['ms'] / 1e3:.2f} s, {result['peak_gib']:.3f} GiB above the inputs"
        print(f"nopad bench --head {line}", file=sys.stderr, flush=True)

    rows = bench_head(
        tokens,
        hidden=args.head_hidden,
        vocab=args.head_vocab,
        device=args.device,
        dtype=dtype,
        rounds=rounds,
        repeats=repeats,
        logits_max_tokens=logits_max,
        chunk_size=args.head_chunk_size,
        threads=args.head_threads,
        contenders=contenders,
        on_row=show,
        on_config=progress,
    )
    grew = growth(rows)
    if args.json:
        print(json.dumps({"head": rows, "chunked_growth_gib": grew}, indent=2))
        return 0
    print(f"\n{format_table(_uniform(rows))}")
    if grew is not None:
        print(f"\nchunked head: peak memory grows by {grew:.3f} GiB from T={rows[0]['T']} to T={rows[-1]['T']}")
    return 0


def _uniform(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k) for k in keys} for r in rows]
