"""Packing quality and speed (`nopad bench --packing`): bins of every algorithm on the same
long-tailed lengths, rows built from the same conversations with each algorithm, in tokens/s, and a
packed file written and read back."""

from __future__ import annotations

import math
import os
import tempfile
import time

import numpy as np

from nopad._apps.progress import QUIET, Progress
from nopad.packing._algorithms import ALGORITHMS, packing_metrics
from nopad.packing._offline import pack_conversations

CONVERSATION_MEDIAN = 402  # tokens: a chat-sized conversation


def lognormal_lengths(n: int, capacity: int, seed: int = 0) -> np.ndarray:
    """(n,) int64 lognormal lengths in [1, capacity] (median capacity/12, sigma 1.2): mostly short, a
    long tail up to the capacity. The packing benchmark's conversations (numpy: packing runs on the host)."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=np.log(capacity / 12), sigma=1.2, size=n)
    return np.clip(lengths.astype(np.int64), 1, capacity)


def packing_bench(
    n: int = 100_000, capacity: int = 8192, seed: int = 0, progress: Progress = QUIET
) -> list[dict[str, object]]:
    """Pack the same ``n`` long-tailed lengths with each algorithm; one row of metrics per algorithm
    (one ``progress`` step each).

    Each packing is checked (every item exactly once, no bin over capacity) before it is reported.
    """
    lengths = lognormal_lengths(n, capacity, seed)
    rows = []
    for name, algorithm in ALGORITHMS.items():
        with progress.step(f"bins of {n:,} lengths, {name}"):
            start = time.perf_counter()
            bins = algorithm(lengths, capacity)
            seconds = time.perf_counter() - start
        items = np.concatenate([np.asarray(b, dtype=np.int64) for b in bins])
        loads = np.array([lengths[b].sum() for b in bins])
        if not np.array_equal(np.sort(items), np.arange(n)) or loads.max() > capacity:
            raise AssertionError(f"{name}: invalid packing (items lost, repeated, or a bin over {capacity})")
        m = packing_metrics(bins, lengths, capacity)
        rows.append(
            {
                "algorithm": name,
                "bins": m.bins,
                "lower_bound": m.lower_bound,
                "ratio_to_lower_bound": m.ratio_to_lower_bound,
                "utilisation": m.utilisation,
                "seconds": seconds,
            }
        )
    return rows


def synthetic_conversations(n: int, pack_length: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` (ids, loss mask) pairs of int64 arrays, lengths lognormal in [1, pack_length] with median
    402 and sigma 1 (20,000 of them hold about 13 M tokens); random ids below 150,000, random 0/1 masks.

    Each pair is a view of two flat arrays, as a tokenized data set held in memory would be.
    """
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(CONVERSATION_MEDIAN), 1.0, n).astype(np.int64), 1, pack_length)
    total = int(lengths.sum())
    ids, mask = rng.integers(0, 150_000, total), rng.integers(0, 2, total)
    cuts = np.cumsum(lengths)[:-1]
    return list(zip(np.split(ids, cuts), np.split(mask, cuts)))


def rows_bench(
    n: int = 20_000, pack_length: int = 8192, seed: int = 0, repeats: int = 3, progress: Progress = QUIET
) -> list[dict[str, object]]:
    """Rows built by ``pack_conversations`` from the same ``n`` conversations with each algorithm.

    Times the whole call (bin packing, every row field, validation), best of ``repeats``; tokens/s
    counts the conversations' tokens. One row per algorithm (one ``progress`` step each): rows built
    against the lower bound ceil(tokens / pack_length).
    """
    convs = synthetic_conversations(n, pack_length, seed)
    tokens = sum(len(ids) for ids, _ in convs)
    table = []
    for name in ALGORITHMS:
        best, built = math.inf, 0
        with progress.step(f"rows of {n:,} conversations, {name}"):
            for _ in range(repeats):
                start = time.perf_counter()
                rows, report = pack_conversations(convs, pack_length, algorithm=name)
                best = min(best, time.perf_counter() - start)
                built = len(rows)
                del rows  # each run's columns are about 30 bytes a token: free them before the next
        if report.real_tokens != tokens:
            raise AssertionError(f"{name}: {report.real_tokens} tokens packed out of {tokens}")
        table.append(
            {
                "algorithm": name,
                "tokens": tokens,
                "rows": built,
                "lower_bound": -(-tokens // pack_length),
                "seconds": best,
                "M_tokens_per_s": tokens / best / 1e6,
            }
        )
    return table


def files_bench(
    n: int = 50_000, pack_length: int = 4096, seed: int = 0, progress: Progress = QUIET
) -> list[dict[str, object]]:
    """Pack ``n`` conversations with best fit, write the rows to a packed file and open it again
    (every row validated). One row per step (one ``progress`` step each), with seconds and M
    tokens/s, from one run each."""
    from nopad.packing._files import read_packed, write_packed
    from nopad.packing._tokenizer import TokenizerIdentity

    convs = synthetic_conversations(n, pack_length, seed)
    tokens = sum(len(ids) for ids, _ in convs)
    tokenizer = TokenizerIdentity("synthetic", "", 150_000)
    timed: dict[str, float] = {}
    with progress.step(f"a file of {n:,} conversations: pack"):
        start = time.perf_counter()
        rows, _ = pack_conversations(convs, pack_length, algorithm="best_fit_decreasing")
        timed["pack"] = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "packed.parquet")
        with progress.step(f"a file of {n:,} conversations: write"):
            start = time.perf_counter()
            write_packed(path, rows, pack_length=pack_length, tokenizer=tokenizer, pad_token_id=0)
            timed["write"] = time.perf_counter() - start
        with progress.step(f"a file of {n:,} conversations: read and validate"):
            start = time.perf_counter()
            opened = read_packed(path, tokenizer=tokenizer)
            timed["read and validate"] = time.perf_counter() - start
        if len(opened) != len(rows):
            raise AssertionError(f"{len(opened)} rows read back out of {len(rows)} written")
    return [
        {"step": step, "rows": len(rows), "tokens": tokens, "seconds": t, "M_tokens_per_s": tokens / t / 1e6}
        for step, t in timed.items()
    ]
