"""Packing quality and speed: every algorithm on the same long-tailed lengths (`nopad bench --packing`)."""

from __future__ import annotations

import time

import numpy as np

from nopad.packing.algorithms import ALGORITHMS, packing_metrics
from nopad.synthetic import lognormal_lengths


def packing_bench(n: int = 100_000, capacity: int = 8192, seed: int = 0) -> list[dict[str, object]]:
    """Pack the same ``n`` long-tailed lengths with each algorithm; one row of metrics per algorithm.

    Each packing is checked (every item exactly once, no bin over capacity) before it is reported.
    """
    lengths = lognormal_lengths(n, capacity, seed)
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
