"""Packing quality and speed: every algorithm on the same long-tailed lengths (`nopad bench --packing`)."""

from __future__ import annotations

import time

import numpy as np

from nopad.packing.algorithms import ALGORITHMS, packing_metrics

COLUMNS = ("algorithm", "bins", "lower_bound", "ratio_to_lower_bound", "utilisation", "seconds")


def long_tailed_lengths(n: int, capacity: int, seed: int = 0) -> np.ndarray:
    """Lognormal lengths (median capacity/12, sigma 1.2): mostly short, a long tail up to the capacity."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=np.log(capacity / 12), sigma=1.2, size=n)
    return np.clip(lengths.astype(np.int64), 1, capacity)


def packing_bench(n: int = 100_000, capacity: int = 8192, seed: int = 0) -> list[dict[str, object]]:
    """Pack the same ``n`` long-tailed lengths with each algorithm; one row of metrics per algorithm.

    Each packing is checked (every item exactly once, no bin over capacity) before it is reported.
    """
    lengths = long_tailed_lengths(n, capacity, seed)
    rows = []
    for name, algorithm in ALGORITHMS.items():
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


def format_table(rows: list[dict[str, object]]) -> str:
    lines = [f"{'algorithm':<30} {'bins':>7} {'lower':>7} {'ratio':>7} {'util':>7} {'seconds':>8}"]
    for r in rows:
        lines.append(
            f"{r['algorithm']:<30} {r['bins']:>7} {r['lower_bound']:>7} {r['ratio_to_lower_bound']:>7.4f} "
            f"{r['utilisation']:>7.4f} {r['seconds']:>8.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(packing_bench()))
