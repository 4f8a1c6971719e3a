"""Nested batches of every field kind for the row-algebra tests, and their rows one by one (the naive
reference every operation is checked against)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

import nopad
import nopad.batches
import nopad.core

# private: batches laid out as nopad's own conversions record them (host lengths in the memo)
from nopad.core._layout import remember_host_lengths


def nested_batch(lengths, *, seed: int = 0, response_lengths=None, width: int = 12, register: bool = True):
    """A TensorDict of B rows with every kind of entry a trainer's nested batch holds:

    input_ids (B, j) int64, position_ids mrope (B, 4, j), routed_experts (B, j, 3, 2) uint8,
    log_probs (B, j) float32 (all sharing one offsets), responses (B, j_r) float64 (its own
    offsets), attention_mask (B, width) and advantages (B,) dense, temperature NonTensorData,
    uid NonTensorStack, and a sub-TensorDict. ``register=False`` builds the offsets with torch alone,
    so nopad does not know their lengths on the host.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    B, total = len(lengths), int(lengths.sum())
    if response_lengths is None:
        response_lengths = (lengths // 2).tolist()
    resp = torch.as_tensor(response_lengths, dtype=torch.int64)

    def offsets_of(lens):
        offsets = nopad.core.prepare_offsets(lens)
        if register:  # as nopad's own conversions leave them: their lengths known on the host
            remember_host_lengths(offsets, lens.numpy().copy())
        return offsets

    def nest(values, offsets, ragged=1):
        lens = offsets.diff()
        seqlens = dict(min_seqlen=int(lens.min()), max_seqlen=int(lens.max())) if len(lens) else {}
        return torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=ragged, **seqlens)

    shared = offsets_of(lengths)
    td = TensorDict({}, batch_size=[B])
    td["input_ids"] = nest(torch.randint(0, 50_000, (total,), generator=g), shared)
    td["position_ids"] = nest(torch.randint(0, 100, (4, total), generator=g), shared, ragged=2)
    experts = torch.randint(0, 64, (total, 3, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    td["routed_experts"] = nest(experts, shared)
    td["log_probs"] = nest(torch.randn(total, generator=g), shared)
    td["responses"] = nest(torch.randn(int(resp.sum()), generator=g, dtype=torch.float64), offsets_of(resp))
    td["attention_mask"] = torch.randint(0, 2, (B, width), generator=g)
    td["advantages"] = torch.randn(B, generator=g)
    td["temperature"] = NonTensorData(0.7)
    td["uid"] = NonTensorStack.from_list([NonTensorData(f"uid-{seed}-{b}") for b in range(B)])
    td["extra"] = TensorDict({"scores": torch.randn(B, 2, generator=g)}, batch_size=[B])
    return td


NESTED_KEYS = ("input_ids", "position_ids", "routed_experts", "log_probs", "responses")
DENSE_KEYS = ("attention_mask", "advantages")


def nested_row(x: torch.Tensor, i: int) -> torch.Tensor:
    """Row i of a jagged tensor, cut by hand (``unbind`` fails on (B, C, j), pytorch #153238)."""
    offsets = x.offsets()
    lo, hi = int(offsets[i]), int(offsets[i + 1])
    if x._ragged_idx == 2:
        return x.values()[:, lo:hi]
    return x.values()[lo:hi]


def rows_of(td: TensorDict) -> list[dict]:
    """The batch one row at a time: the reference every row operation is compared against."""
    B = td.batch_size[0]
    rows: list[dict] = [{} for _ in range(B)]
    for key in td.keys():
        value = td.get(key)
        for i in range(B):
            if isinstance(value, TensorDict):
                rows[i][key] = rows_of(value)[i]
            elif isinstance(value, torch.Tensor) and value.is_nested:
                rows[i][key] = nested_row(value, i)
            elif isinstance(value, torch.Tensor):
                rows[i][key] = value[i]
            elif isinstance(value, NonTensorStack):
                rows[i][key] = value.tolist()[i]
            else:
                rows[i][key] = value.data
    return rows


def assert_rows(td: TensorDict, expected: list[dict]) -> None:
    """``td``'s rows equal ``expected`` bit for bit, and its nested fields are well-formed."""
    assert td.batch_size[0] == len(expected)
    got = rows_of(td)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.keys() == e.keys(), (i, g.keys(), e.keys())
        for key in e:
            _assert_equal(g[key], e[key], f"row {i} {key}")
    check_nested_fields(td)


def _assert_equal(got, want, where):
    if isinstance(want, dict):
        for key in want:
            _assert_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), where
    else:
        assert got == want, where


def check_nested_fields(td: TensorDict) -> None:
    """Every nested field: jagged, contiguous, int64 offsets from 0, min / max length records true."""
    for key in td.keys():
        value = td.get(key)
        if isinstance(value, TensorDict):
            check_nested_fields(value)
        if not (isinstance(value, torch.Tensor) and value.is_nested):
            continue
        assert value.layout == torch.jagged and value.is_contiguous(), key
        offsets = value.offsets()
        assert offsets.dtype == torch.int64 and int(offsets[0]) == 0, key
        lengths = offsets.diff()
        assert int(offsets[-1]) == value.values().shape[value._ragged_idx - 1], key
        if len(lengths):
            assert value._maybe_max_seqlen == int(lengths.max()), key
            assert value._maybe_min_seqlen == int(lengths.min()), key


@st.composite
def row_lengths(draw, max_batch: int = 7, max_len: int = 9):
    """Row lengths: B=1, empty rows, equal lengths, one long row."""
    B = draw(st.integers(1, max_batch))
    kind = draw(st.sampled_from(["random", "equal", "zeros_inside", "one_long"]))
    if kind == "equal":
        return [draw(st.integers(1, max_len))] * B
    lens = draw(st.lists(st.integers(0 if kind == "zeros_inside" else 1, max_len), min_size=B, max_size=B))
    if kind == "one_long":
        lens[draw(st.integers(0, B - 1))] = 4 * max_len
    return lens


def reference_partitions(values, k: int, equal_size: bool) -> list[list[int]]:
    """Karmarkar-Karp written the plain way, for checking: states of k sets (sum, items) sorted
    descending by (sum, size, items); repeatedly merge the two states of largest spread (ties: the
    larger top set), set i of the first with set k-1-i of the second."""

    def key(s):
        return (s[0], len(s[1]), s[1])

    def sort_sets(sets):
        return sorted(sets, key=key, reverse=True)

    pairs = sorted((v, i) for i, v in enumerate(values))
    if equal_size:
        states = [sort_sets([(v, [i]) for v, i in pairs[o : o + k]]) for o in range(0, len(pairs), k)]
    else:
        states = [sort_sets([(v, [i])] + [(0, [])] * (k - 1)) for v, i in pairs]
    while len(states) > 1:
        states.sort(key=lambda s: (s[0][0] - s[-1][0], key(s[0])), reverse=True)
        a, b = states.pop(0), states.pop(0)
        states.append(sort_sets([(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)]))
    return [items for _, items in states[0]]


def reference_micro_partitions(lengths, budget, *, step=1, least=1, group=1, balance=True):
    """verl's micro-batch cut, step by step with the plain partitioner (no DP group)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens = lengths.reshape(-1, group).sum(1)
    work = (24576 * lengths + lengths * lengths).reshape(-1, group).sum(1)
    count = max(min(len(tokens), -(-int(tokens.sum()) // budget)), least, 1)
    count = -(-count // step) * step
    while True:
        parts = [sorted(p) for p in reference_partitions(work.tolist(), count, False)]
        if all(int(tokens[p].sum()) <= budget for p in parts):
            break
        count += step
    rows = [[g * group + i for g in p for i in range(group)] for p in parts]
    if balance:
        row_work = 24576 * lengths + lengths * lengths
        rows.sort(key=lambda p: (int(row_work[p].sum()), p[0]), reverse=True)
        rows = rows[::2][::-1] + rows[1::2]
    return rows


# A batch where Karmarkar-Karp's cut by tokens fits in 18 parts but not in 19 (it is not monotone).
NOT_MONOTONE = [22, 27, 33, 49, 9, 30, 37, 23, 49, 30, 20, 6, 49, 44, 40, 40, 20, 44, 37, 36, 41, 28, 35, 47, 16,
                16, 36, 49, 4, 22, 14, 7, 34, 21, 49, 21, 15, 14, 33, 32, 42, 32, 31, 7, 2, 32, 13, 45, 49, 32, 13,
                39, 48, 35]  # fmt: skip
