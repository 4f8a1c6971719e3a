"""TRL's row chunks as a token budget (``token_budget_chunks``, private: the install routes TRL's
``batch_size`` through it and TRL is not needed to test the cut itself): the same cuts as the naive
greedy loop over rows inside a bisection on the budget, over a grid of batches, in a number of steps
that does not grow with the rows."""

from __future__ import annotations

import bisect

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nopad.integrations.trl import _install


def naive_chunks(lengths: list[int], batch_size: int) -> list[tuple[int, int]]:
    """The reference: TRL's chunks, then the least budget whose greedy row-by-row cut needs no more."""
    rows = len(lengths)
    bounds = [(start, min(start + batch_size, rows)) for start in range(0, rows, batch_size)]
    if len(bounds) <= 1:
        return bounds

    def cut(budget):
        out, start, held = [], 0, 0
        for row, length in enumerate(lengths):
            if row > start and held + length > budget:
                out.append((start, row))
                start, held = row, 0
            held += length
        return [*out, (start, rows)]

    budgets = range(max(lengths), max(sum(lengths[a:b]) for a, b in bounds) + 1)
    return next(cut(b) for b in budgets if len(cut(b)) <= len(bounds))


def mask_of(lengths: list[int]) -> torch.Tensor:
    width = max(lengths) + 1
    return (torch.arange(width) >= width - torch.tensor(lengths).unsqueeze(1)).long()  # left-padded


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=30), st.integers(1, 12))
def test_token_budget_cuts_equal_the_naive_loop_over_rows(lengths, batch_size):
    assert _install.token_budget_chunks(mask_of(lengths), batch_size, keep_rows=False) == naive_chunks(
        lengths, batch_size
    )


def test_token_budget_cut_takes_steps_by_chunks_and_budget_bits_not_by_rows(monkeypatch):
    calls, bisect_right = [], bisect.bisect_right

    def counted(*args):
        calls.append(1)
        return bisect_right(*args)

    monkeypatch.setattr(_install.bisect, "bisect_right", counted)
    steps = {}
    for rows in (64, 4096):
        calls.clear()
        lengths = torch.randint(1, 64, (rows,), generator=torch.Generator().manual_seed(rows)).tolist()
        lengths[rows // 3] = 63  # the same longest row, so the budget's range has the same bits
        _install.token_budget_chunks(mask_of(lengths), rows // 4, keep_rows=False)
        steps[rows] = len(calls)
    # 4 chunks: each bisection step's cut stops after at most 5 forwards; the budget's bisection
    # takes about log2(rows * 63 / 4) steps
    assert all(count <= 5 * (rows.bit_length() + 12) for rows, count in steps.items()), steps
    assert steps[4096] < 3 * steps[64], steps
