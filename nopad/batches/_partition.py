"""Partitions of rows on the host: Karmarkar-Karp (largest differencing) k-way partitioning, the
partitions verl's ``karmarkar_karp`` returns item for item at a fraction of its cost; and the steps
of cutting rows into token-budget micro-batches.

A state is k sets; the heap pops the two states with the largest spread and merges set i of the
first with set k-1-i of the second. Three facts make this cheap and exact:

- Sets compare by (sum, count, first item): items of different sets differ, so comparing their
  item lists (as verl's sets do) is decided by the first item. A set is one tuple, ordered by that
  key, and the state with the larger spread (then the larger top set) pops first: a total order,
  so the pops do not depend on the heap's layout.
- A state keeps only its non-empty sets (the rest are empty and interchangeable), and the items of
  a set form a linked list, concatenated in O(1): merging two states costs their non-empty sets.
- Most merges meet a state of one set (every state starts as one item): that set goes into its
  place by binary search, where verl sorts k sets with a Python comparison per pair; and a state
  with room that takes one such set pops first again, so it takes the whole run of them that
  follows it in the heap in one sort.
"""

from __future__ import annotations

import bisect
import gc
import heapq
from typing import Any

import numpy as np
import torch

from nopad.core._layout import host_starts

# A set: (-sum, -count, -first item, first item, last item); a state: the list of its non-empty sets,
# ascending, so in descending order of (sum, count, first item). ``after[i]``: the item after i in its set.
_Set = tuple[int, int, int, int, int]


def _joined(x: _Set, y: _Set, after: list[int]) -> _Set:
    """Set ``x`` with ``y``'s items after its own (both non-empty)."""
    after[x[4]] = y[3]
    return (x[0] + y[0], x[1] + y[1], x[2], x[3], y[4])


def _merge(a: list[_Set], b: list[_Set], k: int, after: list[int]) -> list[_Set]:
    """Set i of state ``a`` takes set k-1-i of state ``b``. ``a``'s sets fill positions [0, len a),
    ``b``'s reversed fill [k - len b, k); they meet where both hold items."""
    overlap = len(a) + len(b) - k
    if len(b) == 1:  # b's one set meets a's position k-1, empty unless a is full
        bisect.insort(a, _joined(a.pop(), b[0], after) if overlap > 0 else b[0])
        return a
    if len(a) == 1 and overlap <= 0:
        bisect.insort(b, a[0])
        return b
    lo = len(a) - max(overlap, 0)  # a[lo:] meets the first `overlap` sets of b reversed
    rb = b[::-1]
    merged = a[:lo] + [_joined(x, y, after) for x, y in zip(a[lo:], rb)] + rb[max(overlap, 0) :]
    merged.sort()
    return merged


def _heap_key(state: list[_Set], k: int) -> tuple[int, int, int, int]:
    """Smallest pops first: the largest spread, then the largest top set (sum, count, first item)."""
    top = state[0]
    bottom = -state[-1][0] if len(state) == k else 0
    return bottom + top[0], top[0], top[1], top[2]


def karmarkar_karp_arrays(values: np.ndarray, k: int, equal_size: bool) -> list[list[int]]:
    """k partitions of the indices of ``values`` (int64, >= 0), each in the order its items joined.

    The final sets in descending order of (sum, count, first item); with ``equal_size`` every
    partition gets len(values) / k items (the caller checks divisibility). Host only.
    """
    collecting = gc.isenabled()
    gc.disable()  # thousands of small tuples and lists, no cycles: a collection midway only costs time
    try:
        values = np.asarray(values)
        order = np.argsort(values, kind="stable").tolist()  # ascending (value, index), as verl sorts its pairs
        return _karmarkar_karp(values.tolist(), order, k, equal_size)
    finally:
        if collecting:
            gc.enable()


def _karmarkar_karp(work: list[int], order: list[int], k: int, equal_size: bool) -> list[list[int]]:
    n = len(work)
    after = [-1] * n
    states: list[list[_Set]]
    if equal_size or k == 1:
        states = [sorted((-work[i], -1, -i, i, i) for i in order[start : start + k]) for start in range(0, n, k)]
        heap = [(_heap_key(s, k), i) for i, s in enumerate(states)]
    else:  # one item a state, its key (spread, top set) is the item's
        states = [[(-work[i], -1, -i, i, i)] for i in order]
        heap = [((-work[i], -work[i], -1, -i), j) for j, i in enumerate(order)]
    heapq.heapify(heap)
    while len(heap) > 1:
        first = heapq.heappop(heap)[1]
        a = states[first]
        if len(a) < k and len(states[heap[0][1]]) == 1:
            # Most merges (1,011 of 1,023 at 1,024 items into 133): a state with room takes a state of
            # one set. Its key (its top set; no bottom while it has room) stays, as the set taken is
            # lighter than its top, so it pops first again and takes the next one: the whole run of
            # one-set states that follow it in the heap, until it is full, in one sort.
            while heap and len(a) < k and len(states[heap[0][1]]) == 1:
                second = heapq.heappop(heap)[1]
                a.append(states[second][0])
                states[second] = []
            a.sort()
            heapq.heappush(heap, (_heap_key(a, k), first))
            continue
        second = heap[0][1]  # popped by the heapreplace below, which pushes the merge in the same sift
        merged = _merge(a, states[second], k, after)
        states[first], states[second] = merged, []
        heapq.heapreplace(heap, (_heap_key(merged, k), first))
    final = states[heap[0][1]]
    return [_walk(s[3], after) for s in final] + [[] for _ in range(k - len(final))]


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
    """Whether every partition's tokens fit the budget (one gather and one reduction for all)."""
    if not partitions or not all(partitions):
        return bool(partitions) and all(int(tokens[p].sum()) <= budget for p in partitions)
    sizes = np.fromiter((len(p) for p in partitions), dtype=np.int64, count=len(partitions))
    flat = tokens[np.fromiter((i for p in partitions for i in p), dtype=np.int64, count=int(sizes.sum()))]
    return bool((np.add.reduceat(flat, host_starts(sizes)) <= budget).all())


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


def reduce_over_group(values: list[int], group: Any, op: str = "max") -> list[int]:
    """Elementwise ``op`` ("max" or "min") of a few ints over a process group: ONE all_reduce (on the
    GPU for NCCL). THE collective of the micro-batch count."""
    backend = torch.distributed.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.MIN
    torch.distributed.all_reduce(tensor, op=reduce_op, group=group)
    return tensor.tolist()


def order_partitions(partitions: list[list[int]], group: int, row_work: np.ndarray | None) -> list[list[int]]:
    """Partitions of groups -> partitions of rows, each ascending; with ``row_work`` (per row) in verl's
    balanced order: by (workload, first row) descending, then the even places reversed ahead of the
    odd ones, so the heaviest sit in the middle and the lightest at both ends."""
    if group == 1:
        rows = [sorted(p) for p in partitions]
    else:
        rows = [[g * group + i for g in sorted(p) for i in range(group)] for p in partitions]
    if row_work is None or not rows:
        return rows
    sizes = np.fromiter((len(p) for p in rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter((i for p in rows for i in p), dtype=np.int64, count=int(sizes.sum()))
    starts = host_starts(sizes)
    loads = np.add.reduceat(row_work[flat], starts[sizes > 0]) if flat.size else np.zeros(0, dtype=np.int64)
    load = np.zeros(len(rows), dtype=np.int64)
    load[sizes > 0] = loads  # an empty partition weighs 0
    # descending (workload, first row), ties (empty partitions only) in their own order as a stable sort
    keyed = sorted(zip(load.tolist(), (p[0] if p else -1 for p in rows), range(0, -len(rows), -1)), reverse=True)
    rows = [rows[-i] for _, _, i in keyed]
    return rows[::2][::-1] + rows[1::2]
