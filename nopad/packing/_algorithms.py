"""Bin packing of sequence lengths into rows of a fixed token capacity.

Every algorithm takes integer ``lengths`` and a ``capacity`` and returns ``bins``: a list of bins,
each a list of item indices (positions in ``lengths``). They run on the host over plain integers;
a packer calls them once per batch on lengths it already fetched, never per token.

    first_fit_decreasing           O(n log n): a max-segment-tree finds the leftmost bin that fits
    best_fit_decreasing            O(n log C): a sorted set of distinct remaining capacities, bisected
    modified_first_fit_decreasing  Johnson & Garey's MFFD (71/60 OPT + 1), large/medium/small phases
    concatenative                  next fit in the given order (keeps order; what a streaming packer does)
    first_fit_shuffle              NeMo-RL's: a seeded shuffle of the items, then first fit, O(n log n)
"""

from __future__ import annotations

import heapq
import random
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from nopad.core._errors import check_int, input_error
from nopad.core._layout import ceil_div, host_lengths, round_up

Bins = list[list[int]]
Lengths = Sequence[int] | np.ndarray


def _fitting_lengths(lengths: Lengths, capacity: int) -> list[int]:
    """The lengths (THE reading, host path: no tensor made) as ints, each from 1 to ``capacity``."""
    capacity = check_int(capacity, "capacity", low=1)
    arr = host_lengths(lengths, "lengths")
    if arr.size:
        bad = np.flatnonzero((arr <= 0) | (arr > capacity))
        if bad.size:
            i = int(bad[0])
            raise input_error(f"lengths item {i}", None, f"1 <= length <= capacity {capacity}", f"{int(arr[i])}")
    return arr.tolist()


def _decreasing_order(lengths: list[int]) -> list[int]:
    """Item indices by decreasing length; ties keep input order (stable), so results are deterministic."""
    return np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable").tolist()


class _FirstFitTree:
    """Max segment tree over bin remaining capacities: the leftmost bin with room >= s in O(log n)."""

    def __init__(self, max_bins: int, capacity: int):
        size = 1
        while size < max(max_bins, 1):
            size *= 2
        self.size, self.capacity = size, capacity
        self.tree = [capacity] * (2 * size)  # unopened bins are full-capacity bins
        self.opened = 0

    def place(self, s: int) -> int:
        tree, node = self.tree, 1
        while node < self.size:  # descend to the leftmost leaf whose room fits s
            node = 2 * node if tree[2 * node] >= s else 2 * node + 1
        bin_id = node - self.size
        tree[node] -= s
        while node > 1:  # refresh the maxima above, up to the first that does not change
            left = tree[node & ~1]
            right = tree[node | 1]
            node >>= 1
            room = left if left >= right else right
            if tree[node] == room:
                break
            tree[node] = room
        if bin_id >= self.opened:
            self.opened = bin_id + 1
        return bin_id


def _first_fit_into(order: list[int], lengths: list[int], capacity: int, bins: Bins) -> Bins:
    """First fit of ``order`` into new bins appended after ``bins`` (which stay untouched)."""
    tree = _FirstFitTree(len(order), capacity)
    new: Bins = []
    for i in order:
        b = tree.place(lengths[i])
        if b == len(new):
            new.append([])
        new[b].append(i)
    return bins + new


def first_fit_decreasing(lengths: Lengths, capacity: int) -> Bins:
    """Each item, longest first, goes to the first (oldest) bin with room. O(n log n)."""
    ls = _fitting_lengths(lengths, capacity)
    return _first_fit_into(_decreasing_order(ls), ls, capacity, [])


def _best_fit_placement(ls: list[int], capacity: int) -> tuple[list[int], list[int]]:
    """Best fit decreasing as two parallel lists: the items longest first, and the bin each went to.

    Bins are grouped by remaining room; a sorted list of the distinct rooms in use is bisected
    for the smallest room >= the item, so no item scans the open bins. Among bins with the same
    room the one that reached it last is used (a stack): bins with equal room are interchangeable,
    so this only fixes which of them, deterministically.
    """
    order = _decreasing_order(ls)
    placed: list[int] = []
    rooms: list[int] = []  # sorted distinct remaining capacities of open bins
    by_room: dict[int, list[int]] = {}  # room -> bin ids with that room (LIFO)
    opened = 0
    # one tight loop over plain ints: locals only, no per-item allocation beyond the room stacks
    find, insert, add, same_room = bisect_left, insort, placed.append, by_room.get
    for s in [ls[i] for i in order]:
        k = find(rooms, s)
        if k == len(rooms):
            b, room = opened, capacity
            opened += 1
        else:
            room = rooms[k]
            same = by_room[room]
            b = same.pop()
            if not same:
                del by_room[room]
                del rooms[k]
        add(b)
        left = room - s
        if left:  # a full bin can take nothing more; forget it
            stack = same_room(left)
            if stack is None:
                by_room[left] = [b]
                insert(rooms, left)
            else:
                stack.append(b)
    return order, placed


def best_fit_decreasing(lengths: Lengths, capacity: int) -> Bins:
    """Each item, longest first, goes to the bin it leaves with the least room. O(n log C).

    Within a bin, items are listed in the order they were placed (longest first).
    """
    order, placed = _best_fit_placement(_fitting_lengths(lengths, capacity), capacity)
    bins: Bins = [[] for _ in range(max(placed, default=-1) + 1)]
    for i, b in zip(order, placed):
        bins[b].append(i)
    return bins


def modified_first_fit_decreasing(lengths: Lengths, capacity: int) -> Bins:
    """Johnson & Garey's MFFD (worst case 71/60 OPT + 1 against FFD's 11/9).

    Items are large if > C/2, medium if in (C/3, C/2], small if in (C/6, C/3], tiny otherwise.
    The steps, in order, are (1) one bin per large item, largest first; (2) forward over those bins,
    if the smallest medium fits, add the largest medium that fits; (3) backward over the large
    bins without a medium, if the two smallest smalls fit, add the smallest small and then the
    largest small that still fits; (4) forward over all bins, while the smallest remaining item
    fits, add the largest that fits; (5) first fit decreasing for what is left, in new bins.
    """
    ls = _fitting_lengths(lengths, capacity)
    order = _decreasing_order(ls)
    large = [i for i in order if 2 * ls[i] > capacity]
    medium = [i for i in order if 3 * ls[i] > capacity >= 2 * ls[i]]
    small = [i for i in order if 6 * ls[i] > capacity >= 3 * ls[i]]
    bins: Bins = [[i] for i in large]
    room = [capacity - ls[i] for i in large]

    # remaining items of a class, ascending by length, with parallel keys for bisect
    def ascending(items: list[int]) -> tuple[list[int], list[int]]:
        items = items[::-1]
        return [ls[i] for i in items], items

    med_keys, med_items = ascending(medium)
    has_medium = [False] * len(bins)
    for b in range(len(bins)):
        if not med_keys or med_keys[0] > room[b]:
            continue
        k = bisect_right(med_keys, room[b]) - 1
        room[b] -= med_keys.pop(k)
        bins[b].append(med_items.pop(k))
        has_medium[b] = True

    sm_keys, sm_items = ascending(small)
    for b in reversed(range(len(bins))):
        if has_medium[b] or len(sm_keys) < 2 or sm_keys[0] + sm_keys[1] > room[b]:
            continue
        room[b] -= sm_keys.pop(0)
        bins[b].append(sm_items.pop(0))
        k = bisect_right(sm_keys, room[b]) - 1  # >= 0: the second smallest fits
        room[b] -= sm_keys.pop(k)
        bins[b].append(sm_items.pop(k))

    taken = {i for bin_ in bins for i in bin_}
    rest = [i for i in order if i not in taken]
    all_keys, all_items = ascending(rest)
    for b in range(len(bins)):
        while all_keys and all_keys[0] <= room[b]:
            k = bisect_right(all_keys, room[b]) - 1
            room[b] -= all_keys.pop(k)
            bins[b].append(all_items.pop(k))
    return _first_fit_into(all_items[::-1], ls, capacity, bins)


def first_fit_shuffle(lengths: Lengths, capacity: int, seed: int = 0) -> Bins:
    """Items in a seeded random order, each to the first (oldest) bin with room. O(n log n).

    NeMo-RL's ``first_fit_shuffle``: the order is ``random.Random(seed).shuffle`` of the item
    indices, so the same lengths and seed always give the same bins. The shuffle mixes long and
    short sequences in every bin (no bin of only the longest items, as decreasing orders make).
    """
    ls = _fitting_lengths(lengths, capacity)
    order = list(range(len(ls)))
    random.Random(check_int(seed, "seed")).shuffle(order)
    return _first_fit_into(order, ls, capacity, [])


def concatenative(lengths: Lengths, capacity: int) -> Bins:
    """Next fit in the given order: a bin closes as soon as the next item does not fit. O(n)."""
    ls = _fitting_lengths(lengths, capacity)
    bins: Bins = []
    room = 0
    for i, s in enumerate(ls):
        if s > room:
            bins.append([])
            room = capacity
        bins[-1].append(i)
        room -= s
    return bins


ALGORITHMS: dict[str, Callable[[Lengths, int], Bins]] = {
    "first_fit_decreasing": first_fit_decreasing,
    "best_fit_decreasing": best_fit_decreasing,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
    "concatenative": concatenative,
    "first_fit_shuffle": first_fit_shuffle,
}


def bin_of_items(lengths: Lengths, capacity: int, algorithm: str = "best_fit_decreasing") -> np.ndarray:
    """(n,) int64: the bin each item goes to under ``algorithm``, bins numbered as ``pack_lengths`` lists them.

    What a row builder needs (bins as one array, not n lists); best fit decreasing writes it directly.
    """
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise input_error("algorithm", None, f"one of {sorted(ALGORITHMS)}", f"{algorithm!r}")
    ls = _fitting_lengths(lengths, capacity)
    capacity = int(capacity)
    bin_of = np.empty(len(ls), dtype=np.int64)
    if algorithm == "best_fit_decreasing":
        order, placed = _best_fit_placement(ls, capacity)
        bin_of[order] = placed
        return bin_of
    bins = ALGORITHMS[algorithm](ls, capacity)
    sizes = [len(b) for b in bins]
    if bin_of.size:
        bin_of[np.fromiter(chain.from_iterable(bins), dtype=np.int64, count=len(ls))] = np.repeat(
            np.arange(len(bins)), sizes
        )
    return bin_of


def _split_largest_bins(bins: Bins, lengths: list[int], target: int) -> Bins:
    """Split the fullest multi-item bin in two (greedy halves) until there are ``target`` bins."""
    heap = [(-sum(lengths[i] for i in b), n, b) for n, b in enumerate(bins)]
    heapq.heapify(heap)
    stuck: list[tuple[int, int, list[int]]] = []
    serial = len(bins)
    while len(heap) + len(stuck) < target:
        if not heap:
            raise input_error(
                "bins",
                None,
                f"at least as many items as the {target} bins asked for",
                f"{len(lengths)} items",
            )
        load, n, b = heapq.heappop(heap)
        if len(b) < 2:
            stuck.append((load, n, b))
            continue
        halves: tuple[list[int], list[int]] = ([], [])
        loads = [0, 0]
        for i in sorted(b, key=lambda i: -lengths[i]):
            h = 0 if loads[0] <= loads[1] else 1
            halves[h].append(i)
            loads[h] += lengths[i]
        rank = {i: k for k, i in enumerate(b)}
        for h in (0, 1):
            heapq.heappush(heap, (-loads[h], serial, sorted(halves[h], key=rank.__getitem__)))
            serial += 1
    return [b for _, _, b in sorted(heap + stuck, key=lambda t: t[1])]


def pack_lengths(
    lengths: Lengths,
    capacity: int,
    *,
    algorithm: str = "best_fit_decreasing",
    min_bins: int = 1,
    bins_multiple_of: int = 1,
) -> Bins:
    """Pack ``lengths`` into bins of ``capacity`` tokens with the named algorithm.

    ``min_bins`` and ``bins_multiple_of`` (a data-parallel size, so every rank gets the same number
    of micro-batches) raise the bin count by splitting the fullest bins, never by adding empty ones;
    a ValueError says so when there are too few items to reach the count.
    """
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise input_error("algorithm", None, f"one of {sorted(ALGORITHMS)}", f"{algorithm!r}")
    min_bins = check_int(min_bins, "min_bins", low=0)
    bins_multiple_of = check_int(bins_multiple_of, "bins_multiple_of", low=1)
    ls = _fitting_lengths(lengths, capacity)
    capacity = int(capacity)
    bins = ALGORITHMS[algorithm](ls, capacity)
    target = max(len(bins), min_bins if ls else 0)
    target = round_up(target, bins_multiple_of)
    return _split_largest_bins(bins, ls, target) if target > len(bins) else bins


@dataclass(frozen=True)
class PackingMetrics:
    """Quality of a packing.

    utilisation: sum of lengths / (bins * capacity); waste: empty slots, bins * capacity - sum;
    balance: lightest bin load / heaviest (1.0 is perfectly even); lower_bound: ceil(sum / capacity),
    no packing can use fewer bins; ratio_to_lower_bound: bins / lower_bound.
    """

    bins: int
    lower_bound: int
    ratio_to_lower_bound: float
    utilisation: float
    waste: int
    balance: float


def packing_metrics(bins: Bins, lengths: Lengths, capacity: int) -> PackingMetrics:
    """Metrics of ``bins`` (item indices into ``lengths``) for rows of ``capacity`` tokens.

    ``bins`` must be a packing of these lengths: every index an item, no bin over the capacity
    (a bin over it would report a utilisation above 1 and a negative waste).
    """
    capacity = check_int(capacity, "capacity", low=1)
    ls = host_lengths(lengths, "lengths", low=1)
    if not isinstance(bins, (list, tuple)):
        raise input_error("bins", None, "a list of bins, each a list of item indices", type(bins).__name__)
    for b, items in enumerate(bins):
        index = np.asarray(items)
        if index.ndim != 1 or (
            index.size and (index.dtype.kind not in "iu" or index.min() < 0 or index.max() >= len(ls))
        ):
            raise input_error(f"bins[{b}]", None, f"item indices in [0, {len(ls)})", f"{list(items)[:8]}")
    loads = [int(ls[b].sum()) for b in bins] if bins else [0]
    over = [b for b, load in enumerate(loads) if load > capacity]
    if over:
        raise input_error(
            f"bins[{over[0]}]", None, f"at most the capacity of {capacity} tokens", f"{loads[over[0]]} tokens"
        )
    total = int(ls.sum())
    lower = ceil_div(total, capacity)
    slots = len(bins) * capacity
    return PackingMetrics(
        bins=len(bins),
        lower_bound=lower,
        ratio_to_lower_bound=len(bins) / lower if lower else 1.0,
        utilisation=total / slots if slots else 0.0,
        waste=slots - total,
        balance=min(loads) / max(loads) if max(loads) else 1.0,
    )
