"""`nopad bench --batches`: rows of nested batches (mini-batch selection, token-budget micro-batches,
the join and restore of their outputs, the balanced partition alone) against verl 0.9.1's own
utilities where verl is importable, against a per-row loop written here otherwise.

The batch is what verl's workers hold after ``left_right_2_no_padding``: three nested fields
(input_ids, position_ids, loss_mask) of B rows, lengths uniform in [64, 4096), cut into micro-batches
of 16,384 tokens. Every contender's result is checked against nopad's before it is timed.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from nopad._apps.progress import QUIET, Progress, sync
from nopad.batches._balance import Workload, balanced_partitions
from nopad.batches._rows import micro_batches, select_rows
from nopad.core._layout import IndexPlan, ceil_div, nested_offsets, remember_host_lengths
from nopad.diagnostics import OpCounter

BUDGET = 16_384


def nested_rows_batch(B: int, device: str = "cpu", seed: int = 0) -> TensorDict:
    """B rows of lengths uniform in [64, 4096): nested input_ids, position_ids and loss_mask that share
    their offsets, as a conversion leaves them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 4096, (B,), generator=g)
    plan = IndexPlan.from_lengths(lengths).to(device)
    total = plan.total
    td = TensorDict({}, batch_size=[B], device=device)
    td["input_ids"] = plan.to_nested(torch.randint(0, 150_000, (total,), generator=g).to(device))
    td["position_ids"] = plan.to_nested(plan.position_ids)
    td["loss_mask"] = plan.to_nested(torch.randint(0, 2, (total,), generator=g).to(device))
    remember_host_lengths(plan.offsets, lengths.numpy())
    return td


# ---- the per-row loop, for machines without verl ---------------------------------------------------
def loop_select(td: TensorDict, rows: list[int]) -> TensorDict:
    """Rows of every nested field one at a time: unbind, pick, rebuild from the list."""
    out = TensorDict({}, batch_size=[len(rows)])
    for key, value in td.items():
        if isinstance(value, Tensor) and value.is_nested:
            pieces = value.unbind()
            out[key] = torch.nested.as_nested_tensor([pieces[r] for r in rows], layout=torch.jagged)
        else:
            out[key] = value[torch.tensor(rows)]
    return out


def loop_partitions(values: list[int], k: int) -> list[list[int]]:
    """Karmarkar-Karp with a Python list per set and per state (sets sorted by sum, size, items)."""

    def key(s: tuple[int, list[int]]) -> tuple[int, int, list[int]]:
        return (s[0], len(s[1]), s[1])

    states: list[tuple[tuple[int, int, int, int], int, list[tuple[int, list[int]]]]] = []
    for n, (v, i) in enumerate(sorted((v, i) for i, v in enumerate(values))):
        sets = sorted([(v, [i])] + [(0, [])] * (k - 1), key=key, reverse=True)
        heapq.heappush(states, ((-(sets[0][0] - sets[-1][0]), -sets[0][0], -1, -i), n, sets))
    while len(states) > 1:
        _, n, a = heapq.heappop(states)
        _, _, b = heapq.heappop(states)
        sets = sorted([(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)], key=key, reverse=True)
        top = sets[0]
        heapq.heappush(states, ((-(top[0] - sets[-1][0]), -top[0], -len(top[1]), -top[1][0]), n, sets))
    return [sorted(items) for _, items in states[0][2]]


def loop_micro_batches(td: TensorDict, budget: int) -> tuple[list[TensorDict], list[list[int]]]:
    lengths = td["input_ids"].offsets().diff().tolist()
    work = Workload()(np.array(lengths)).tolist()
    count = max(1, ceil_div(sum(lengths), budget))
    while True:
        parts = loop_partitions(work, count)
        if all(sum(lengths[i] for i in p) <= budget for p in parts):
            break
        count += 1
    # verl's balanced order: heaviest in the middle, lightest at both ends
    parts.sort(key=lambda p: (sum(work[i] for i in p), p[0]), reverse=True)
    parts = parts[::2][::-1] + parts[1::2]
    return [loop_select(td, p) for p in parts], parts


def loop_join_restore(outputs: list[Tensor], parts: list[list[int]]) -> Tensor:
    rows = [t for out in outputs for t in out.unbind()]
    order = [i for p in parts for i in p]
    back: list[Tensor] = [rows[0]] * len(order)
    for position, row in enumerate(order):
        back[row] = rows[position]
    return torch.nested.as_nested_tensor(back, layout=torch.jagged)


# ---- the contenders ----------------------------------------------------------------------------------
def contenders() -> dict[str, Any]:
    """verl's own utilities if verl is importable, else the loops above."""
    try:
        import verl.utils.seqlen_balancing as sb
        import verl.utils.tensordict_utils as tu
        from verl.workers.engine.utils import postprocess_batch_func
    except Exception:  # noqa: BLE001 - any failure to import verl: compare with the loop
        return {
            "name": "loop",
            "select": loop_select,
            "micro_batches": loop_micro_batches,
            "join_restore": loop_join_restore,
            "partitions": lambda work, k: loop_partitions(list(work), k),
        }
    from tensordict import NonTensorData

    def join_restore(outputs: list[Tensor], parts: list[list[int]]) -> Tensor:
        data = TensorDict({"use_dynamic_bsz": NonTensorData(True)}, batch_size=[])
        output_lst = [{"model_output": {"log_probs": out}} for out in outputs]
        return postprocess_batch_func(output_lst, parts, data)["model_output"]["log_probs"]

    return {
        "name": "verl",
        "select": tu.index_select_tensor_dict,
        "micro_batches": lambda td, budget: sb.rearrange_micro_batches(td, budget),
        "join_restore": join_restore,
        "partitions": lambda work, k: sb.get_seqlen_balanced_partitions(list(work), k, equal_size=False),
    }


def _best(fn: Callable[[], Any], repeats: int, device: str = "cpu") -> tuple[float, Any]:
    """Best wall time (ms) of ``repeats`` calls, and the last result; the device is waited for."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best * 1e3, result


def _counted(fn: Callable[[], Any]) -> OpCounter:
    with OpCounter() as counter:
        fn()
    return counter


def _same_nested(a: Tensor, b: Tensor) -> bool:
    return torch.equal(a.values(), b.values()) and torch.equal(nested_offsets(a), nested_offsets(b).to(torch.int64))


STEPS_PER_BATCH = 4  # select, split, join + restore, partition: the progress steps of one batch size


def bench_rows(
    batch_sizes=(256, 1024, 4096),
    repeats: int = 5,
    reference_repeats: int = 1,
    device: str = "cpu",
    progress: Progress = QUIET,
) -> list[dict]:
    """One row per operation and batch size: nopad's and the contender's time (best of ``repeats``,
    the contender's of ``reference_repeats``), their ratio, nopad's ops and host syncs, and whether the
    results are identical (partitions list for list, tokens and offsets). ``progress`` counts
    :data:`STEPS_PER_BATCH` steps per batch size."""
    other = contenders()
    rows: list[dict] = []
    for B in batch_sizes:  # the contender twice where it takes seconds, not minutes
        reference = reference_repeats if B > 1024 else max(reference_repeats, 2)
        rows += _bench_batch(B, other, repeats, reference, device, progress)
    return rows


def _bench_batch(
    B: int, other: dict, repeats: int, reference_repeats: int, device: str, progress: Progress = QUIET
) -> list[dict]:
    td = nested_rows_batch(B, device)
    work = Workload()(td["input_ids"].offsets().diff().numpy(force=True))
    mini = np.random.default_rng(B).permutation(B)[: max(1, B // 4)].tolist()

    def timed(ours: Callable[[], Any], theirs: Callable[[], Any]) -> tuple[float, Any, float, Any]:
        return (*_best(ours, repeats, device), *_best(theirs, reference_repeats, device))

    select = lambda: select_rows(td, mini)
    with progress.step(f"B={B} mini-batch select, {other['name']} too"):
        ours_ms, ours, theirs_ms, theirs = timed(select, lambda: other["select"](td, mini))
    same = all(_same_nested(ours[k], theirs[k]) for k in ("input_ids", "position_ids", "loss_mask"))
    rows = [_row("mini-batch select (B/4 rows)", B, ours_ms, theirs_ms, other, same, select)]

    cut = lambda: micro_batches(td, BUDGET)
    with progress.step(f"B={B} micro-batch split, {other['name']} too"):
        ours_ms, (micro, restore), theirs_ms, (their_micro, their_parts) = timed(
            cut, lambda: other["micro_batches"](td, BUDGET)
        )
    same = restore.partitions == their_parts
    same = same and all(_same_nested(m["input_ids"], t["input_ids"]) for m, t in zip(micro, their_micro))
    split = _row(f"micro-batch split ({len(micro)} of {BUDGET:,} tokens)", B, ours_ms, theirs_ms, other, same, cut)
    rows.append(split)

    outputs = [IndexPlan.from_nested(m["input_ids"]).to_nested(m["input_ids"].values().float()) for m in micro]

    back = lambda: restore(outputs)
    with progress.step(f"B={B} join + restore, {other['name']} too"):
        ours_ms, joined, theirs_ms, their_joined = timed(
            back, lambda: other["join_restore"](outputs, restore.partitions)
        )
    same_back = _same_nested(joined, their_joined)
    rows.append(_row("join + restore of outputs", B, ours_ms, theirs_ms, other, same_back, back))
    both_ours, both_theirs = split["nopad_ms"] + ours_ms, split[f"{other['name']}_ms"] + theirs_ms
    rows.append(_row("split + restore", B, both_ours, both_theirs, other, same and same_back, None))
    if other["name"] == "verl":
        progress.add(1)  # one more step than STEPS_PER_BATCH: verl is there
        with progress.step(f"B={B} verl's engine path under install()"):
            rows.append(engine_path_row(td, B, repeats, device, other))

    k = len(micro)
    partition = lambda: balanced_partitions(work, k, False)
    with progress.step(f"B={B} partition alone, {other['name']} too"):
        ours_ms, parts, theirs_ms, their_parts = timed(partition, lambda: other["partitions"](work.tolist(), k))
    row = _row(f"partition alone ({B} into {k})", B, ours_ms, theirs_ms, other, parts == their_parts, partition)
    loads = np.array([work[p].sum() for p in parts], dtype=np.float64)
    their_loads = np.array([work[p].sum() for p in their_parts], dtype=np.float64)
    row["max/mean workload"] = f"{loads.max() / loads.mean():.4f} vs {their_loads.max() / their_loads.mean():.4f}"
    rows.append(row)
    return rows


def _row(name: str, B: int, ours_ms: float, theirs_ms: float, other: dict, same: bool, counted) -> dict:
    counter = _counted(counted) if counted is not None else None
    return {
        "operation": name,
        "B": B,
        "ops": counter.ops if counter else None,
        "syncs": counter.syncs if counter else None,
        "nopad_ms": ours_ms,
        f"{other['name']}_ms": theirs_ms,
        f"{other['name']}/nopad": theirs_ms / ours_ms,
        "identical": bool(same),
        "max/mean workload": None,  # filled for the partitions: nopad's vs the contender's
        "bare_ms": None,  # filled for the engine path: the bare gathers of the same tokens
        "nopad/bare": None,
    }


def engine_path_row(td: TensorDict, B: int, repeats: int, device: str, other: dict) -> dict:
    """verl's engine path under ``install()`` (``prepare_micro_batches`` + ``postprocess_batch_func``,
    as its FSDP engine calls them with ``use_dynamic_bsz``) against the bare gathers of the same
    tokens: one ``index_select`` per field into the micro-batches' order and one of the output back
    (the memory floor of any split and restore). The two are timed alternately in one loop, each
    result dropped before the next call, so both meet the allocator in the same state (kept results
    made the bare gathers page-fault fresh memory in some calls: 10 or 20 ms for the same work)."""
    import verl.workers.engine.utils as engine

    from nopad.integrations.verl._install import install

    data = td.copy()
    data.set_non_tensor("max_token_len_per_gpu", BUDGET)
    data.set_non_tensor("use_dynamic_bsz", True)
    patch = install(check_version=False)
    try:
        micro, parts = engine.prepare_micro_batches(data)
        outputs = [{"model_output": {"log_probs": m["input_ids"].float()}} for m in micro]
        joined = engine.postprocess_batch_func(outputs, parts, data)
        order = np.array([r for p in parts for r in p], dtype=np.int64)
        plan = IndexPlan.from_nested(td["input_ids"])
        tokens = plan.token_index(plan.offsets[:-1])  # identity on the batch's own layout: the rows' tokens
        starts = plan.offsets[torch.from_numpy(order)]
        lengths = plan.lengths[torch.from_numpy(order)]
        moved = IndexPlan.from_lengths(lengths).token_index(starts)  # each micro-batch's tokens, in order
        back = torch.empty_like(moved).index_copy_(0, moved, tokens)
        fields = [td[key].values() for key in ("input_ids", "position_ids", "loss_mask")]
        out = td["input_ids"].values().float()

        def split_restore() -> None:
            _, rows = engine.prepare_micro_batches(data)
            engine.postprocess_batch_func(outputs, rows, data)

        def bare() -> None:
            [f.index_select(0, moved) for f in fields], out.index_select(0, back)

        engine_ms = bare_ms = float("inf")
        for _ in range(repeats):
            engine_ms = min(engine_ms, _best(split_restore, 1, device)[0])
            bare_ms = min(bare_ms, _best(bare, 1, device)[0])
    finally:
        patch.uninstall()
    same = torch.equal(joined["model_output"]["log_probs"].values(), out)
    row = _row(
        f"split + restore, verl's engine path ({len(parts)} parts)", B, engine_ms, float("nan"), other, same, None
    )
    row.update({"verl_ms": None, "verl/nopad": None, "bare_ms": bare_ms, "nopad/bare": engine_ms / bare_ms})
    return row
