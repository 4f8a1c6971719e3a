"""Partitions of rows on the host: Karmarkar-Karp (largest differencing) k-way partitioning on arrays,
the partitions verl's ``karmarkar_karp`` returns item for item without a Python object per item or
per set; and the steps of cutting rows into token-budget micro-batches.

A state is k sets; the heap pops the two states with the largest spread and merges set i of the
first with set k-1-i of the second. Two facts make this cheap and exact:

- Sets compare by (sum, count, first item): items of different sets differ, so comparing their
  item lists (as verl's sets do) is decided by the first item. A set's order is that key, and the
  state with the larger spread (then the larger top set) pops first: a total order, so the pops do
  not depend on the heap's layout.
- A state keeps only its non-empty sets (the rest are empty and interchangeable), so merging two
  small states costs their size, not k. Items of a set form a linked list, concatenated in O(1).
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np
import torch

# A state: a (5, m) int64 array of its m non-empty sets in descending order, one column per set.
SUM, COUNT, FIRST, HEAD, TAIL = range(5)


def _sort_desc(sets: np.ndarray) -> np.ndarray:
    return sets[:, np.lexsort(sets[FIRST::-1])[::-1]]  # keys (first, count, sum): sum decides first


def _heap_key(sets: np.ndarray, k: int) -> tuple[int, int, int, int]:
    """Smallest pops first: the largest spread, then the largest top set (sum, count, first item)."""
    top, count, first = sets[: FIRST + 1, 0].tolist()
    bottom = int(sets[SUM, -1]) if sets.shape[1] == k else 0
    return bottom - top, -top, -count, -first


def _merge(a: np.ndarray, b: np.ndarray, k: int, following: np.ndarray) -> np.ndarray:
    """Set i of ``a`` takes the items of set k-1-i of ``b``. ``a``'s non-empty sets fill positions
    [0, m_a), ``b``'s reversed fill [k - m_b, k); they overlap where both hold items."""
    b = b[:, ::-1]
    overlap = a.shape[1] + b.shape[1] - k
    if overlap <= 0:
        return _sort_desc(np.concatenate([a, b], axis=1))
    lo = a.shape[1] - overlap  # a[:, lo:] meets b[:, :overlap]
    joined = a[:, lo:].copy()
    joined[SUM:FIRST] += b[SUM:FIRST, :overlap]
    following[joined[TAIL]] = b[HEAD, :overlap]  # link a's last item to b's first
    joined[TAIL] = b[TAIL, :overlap]
    return _sort_desc(np.concatenate([a[:, :lo], joined, b[:, overlap:]], axis=1))


def karmarkar_karp_arrays(values: np.ndarray, k: int, equal_size: bool) -> list[list[int]]:
    """k partitions of the indices of ``values`` (int64, >= 0), each in the order its items joined.

    The final sets in descending order of (sum, count, first item); with ``equal_size`` every
    partition gets len(values) / k items (the caller checks divisibility). Host only.
    """
    n = len(values)
    order = np.lexsort((np.arange(n), values))  # ascending (value, index), as verl sorts its pairs
    following = np.full(n, -1, dtype=np.int64)
    width = k if equal_size else 1
    idx = order.reshape(-1, width)[:, ::-1]  # each state's sets, largest first
    columns = np.stack([values[idx], np.ones_like(idx), idx, idx, idx], axis=1)  # (states, 5, width)
    states: list[np.ndarray | None] = list(columns)
    heap = [(_heap_key(s, k), i) for i, s in enumerate(columns)]
    heapq.heapify(heap)
    while len(heap) > 1:
        _, first = heapq.heappop(heap)
        _, second = heapq.heappop(heap)
        merged = _merge(states[first], states[second], k, following)  # type: ignore[arg-type]
        states[first], states[second] = merged, None
        heapq.heappush(heap, (_heap_key(merged, k), first))
    heads = states[heap[0][1]][HEAD].tolist()  # type: ignore[index]
    after = following.tolist()
    return [_walk(head, after) for head in heads] + [[] for _ in range(k - len(heads))]


def _walk(head: int, after: list[int]) -> list[int]:
    items = []
    while head >= 0:
        items.append(head)
        head = after[head]
    return items


def first_fit(work: np.ndarray, tokens: np.ndarray, budget: int, start: int, step: int) -> tuple[int, list[list[int]]]:
    """The smallest count >= start (in steps) whose Karmarkar-Karp partition fits, and that partition;
    past the number of rows (a row over budget, or the steps overshoot) the count is returned unmet."""
    count = start
    while count <= len(work):
        partitions = karmarkar_karp_arrays(work, count, False)
        if fits(partitions, tokens, budget):
            return count, partitions
        count += step
    return count, []


def fits(partitions: list[list[int]], tokens: np.ndarray, budget: int) -> bool:
    return bool(partitions) and all(int(tokens[p].sum()) <= budget for p in partitions)


def split_until(partitions: list[list[int]], count: int, tokens: np.ndarray) -> list[list[int]]:
    """A fitting partition grown to ``count`` parts by halving its part of most tokens (among parts of
    two or more items) until there are enough: every half of a fitting part still fits."""
    parts = [sorted(p) for p in partitions]
    while len(parts) < count:
        splittable = [i for i, p in enumerate(parts) if len(p) > 1]
        i = max(splittable, key=lambda j: (int(tokens[parts[j]].sum()), -parts[j][0]))
        part = parts.pop(i)
        parts[i:i] = [part[: len(part) // 2], part[len(part) // 2 :]]
    return parts


def max_over_group(values: list[int], group: Any) -> list[int]:
    """Elementwise max of a few ints over a process group: ONE all_reduce (on the GPU for NCCL)."""
    backend = torch.distributed.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
    return tensor.tolist()


def order_partitions(partitions: list[list[int]], group: int, row_work: np.ndarray | None) -> list[list[int]]:
    """Partitions of groups -> partitions of rows, each ascending; with ``row_work`` (per row) in verl's
    balanced order: by (workload, first row) descending, then the even places reversed ahead of the
    odd ones, so the heaviest sit in the middle and the lightest at both ends."""
    rows = [[g * group + i for g in sorted(p) for i in range(group)] for p in partitions]
    if row_work is None:
        return rows
    rows.sort(key=lambda p: (int(row_work[p].sum()), p[0]), reverse=True)
    return rows[::2][::-1] + rows[1::2]
