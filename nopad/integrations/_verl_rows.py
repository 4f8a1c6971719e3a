"""verl's row utilities on nopad's row algebra, with verl's signatures and results.

verl 0.9.1's ``tensordict_utils`` and ``seqlen_balancing`` move nested batches one row at a time
(``unbind`` and a rebuild from a Python list per field, per call); these give the same TensorDicts,
tensors and index lists from one gather per field, and the same partitions from array
Karmarkar-Karp. Where verl asserts, these raise ValueError naming what was expected. Behaviour that
verl has and nopad does not take over (a TensorDict without nested fields, a model output that is
not a nested tensor) is left to verl's own function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from nopad._batch import get_field
from nopad._errors import check_int, input_error
from nopad._layout import is_nested, ragged_dim
from nopad._partition import fits, karmarkar_karp_arrays, order_partitions
from nopad._rows import (
    NESTED,
    RowPlan,
    batch_lengths,
    cat_plan,
    chunk_plan,
    kind_of,
    pad_plan,
    select_plan,
    take,
    unpad_plan,
)
from nopad._torch_internals import put_checked
from nopad.balance import Workload, balanced_partitions
from nopad.balance import karmarkar_karp as _karmarkar_karp
from nopad.rows import RowRestore

TENSORDICT_UTILS = "verl.utils.tensordict_utils"
SEQLEN_BALANCING = "verl.utils.seqlen_balancing"
ENGINE_UTILS = "verl.workers.engine.utils"

Original = Callable[[str, str], Callable[..., Any]]


def _without_device(td: TensorDict) -> TensorDict:
    """verl builds these TensorDicts without a device: so do we, to hand back the same object."""
    if td.device is not None:
        td.clear_device_()
    return td


def index_select_tensor_dict(batch: TensorDict | None, indices: Tensor | list[int]) -> TensorDict | None:
    """verl's ``index_select_tensor_dict``: the rows ``indices`` of ``batch`` (None stays None)."""
    if batch is None:
        return None
    if (indices.dim() if isinstance(indices, Tensor) else np.ndim(indices)) != 1:
        raise input_error("indices", None, "a 1-D tensor or list of row indices", f"shape {np.shape(indices)}")
    return _without_device(take([batch], select_plan(batch, indices), reindex=False)[0])


def chunk_tensordict(td: TensorDict, chunks: int) -> tuple[TensorDict, ...]:
    """verl's ``chunk_tensordict``: ``chunks`` equal consecutive parts (views), (B, C, j) fields included."""
    return tuple(take([td], chunk_plan(td, chunks), reindex=False))


def concat_nested_tensors(tensors: list[Tensor]) -> Tensor:
    """verl's ``concat_nested_tensors``: the rows of jagged nested tensors one after another."""
    for i, tensor in enumerate(tensors):
        if not is_nested(tensor):
            raise input_error(f"tensors[{i}]", None, "a jagged nested tensor", type(tensor).__name__)
    parts = [_one_field(t) for t in tensors]
    return take(parts, cat_plan(parts))[0].get("x")


def _one_field(x: Tensor) -> TensorDict:
    td = TensorDict({}, batch_size=[x.size(0)])
    put_checked(td, "x", x)
    return td


def concat_tensordict(data: list[TensorDict], original: Original) -> TensorDict:
    """verl's ``concat_tensordict``: one cat per field; batches without nested fields go to verl's."""
    if not data or not any(kind_of(v) == NESTED for v in data[0].values()):
        return original(TENSORDICT_UTILS, "concat_tensordict")(data)
    return take(data, cat_plan(data), reindex=False)[0]


def pad_to_divisor(data: TensorDict, size_divisor: int) -> tuple[TensorDict, int]:
    """verl's ``pad_to_divisor``: rows repeated from the start to a multiple of ``size_divisor``."""
    if isinstance(data, TensorDict) and data.batch_dims >= 1 and len(data) == 0:
        return data, 0
    plan, pad = pad_plan(data, size_divisor)
    return (data, 0) if plan is None else (take([data], plan, reindex=False)[0], pad)


def unpad(data: TensorDict, pad_size: int) -> TensorDict:
    """verl's ``unpad``: ``data`` without its last ``pad_size`` rows."""
    plan = unpad_plan(data, pad_size)
    return data if plan is None else take([data], plan, reindex=False)[0]


def karmarkar_karp(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """verl's ``karmarkar_karp``: the same partitions, item for item, from arrays."""
    return _karmarkar_karp(seqlen_list, k_partitions, equal_size)


def get_seqlen_balanced_partitions(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """verl's ``get_seqlen_balanced_partitions``: the same partitions, each sorted."""
    partitions = balanced_partitions(seqlen_list, k_partitions, equal_size)
    empty = [i for i, p in enumerate(partitions) if not p]
    if empty:
        expected = "partitions with at least one item each"
        raise input_error("k_partitions", None, expected, f"partition {empty[0]} empty")
    return partitions


def restore_dynamic_batch(data: Tensor, batch_idx_list: list[list[int]]) -> Tensor:
    """verl's ``restore_dynamic_batch``: rows joined in micro-batch order back in the batch's order."""
    return _restore(batch_idx_list)(data)


def _restore(batch_idx_list: list[list[int]]) -> RowRestore:
    order = [int(i) for p in batch_idx_list for i in p]
    if sorted(order) != list(range(len(order))):
        raise input_error("batch_idx_list", None, f"a permutation of the {len(order)} rows", f"{batch_idx_list}")
    return RowRestore([[int(i) for i in p] for p in batch_idx_list])


def rearrange_micro_batches(
    batch: TensorDict,
    max_token_len: int,
    dp_group: Any = None,
    num_batches_divided_by: int | None = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    use_dynamic_bsz_balance: bool = True,
    force_group_size: int = 1,
) -> tuple[list[TensorDict], list[list[int]]]:
    """verl's ``rearrange_micro_batches``: the same partitions (and, over a DP group, verl's own
    collectives, so the count is verl's), the micro-batches as one gather per field."""
    lengths = batch_lengths(batch)
    budget = check_int(max_token_len, "max_token_len", low=1)
    group = check_int(force_group_size, "force_group_size", low=1)
    if int(lengths.max(initial=0)) > budget:
        raise input_error("max_token_len", None, f">= {int(lengths.max())}, the longest row (in tokens)", f"{budget}")
    if len(lengths) % group:
        raise input_error("batch", None, f"a multiple of force_group_size={group} rows", f"{len(lengths)} rows")
    tokens = lengths.reshape(-1, group).sum(1)
    work = Workload()(lengths).reshape(-1, group).sum(1)
    sync = torch.distributed.is_initialized() and same_micro_num_in_dp and dp_group is not None
    partitions = _verl_count_partitions(
        work, tokens, budget, num_batches_divided_by, min_num_micro_batch, dp_group if sync else None
    )
    row_work = Workload()(lengths) if use_dynamic_bsz_balance else None
    rows = order_partitions(partitions, group, row_work)
    order = np.array([r for p in rows for r in p], dtype=np.int64)
    micro = take([batch], RowPlan.of(order, [len(p) for p in rows], len(lengths)), reindex=False)
    return [_without_device(m) for m in micro], rows


def _verl_count_partitions(
    work: np.ndarray,
    tokens: np.ndarray,
    budget: int,
    divided_by: int | None,
    least: int | None,
    dp_group: Any,
) -> list[list[int]]:
    """verl's count of micro-batches, step for step: the lower bound, made equal over the group, raised
    until every rank's Karmarkar-Karp partition fits (a MIN all_reduce per try, as verl)."""
    groups = len(tokens)
    count = min(groups, -(-int(tokens.sum()) // budget))
    if least is not None:
        count = max(least, count)
    longest, fewest = int(tokens.max()), groups
    if dp_group is not None:
        count = _all_reduce([count], "max", dp_group)[0]
    step = divided_by or 1
    if divided_by is not None:
        count = -(-count // divided_by) * divided_by
    if dp_group is not None:
        longest, fewest = _all_reduce([longest, -groups], "max", dp_group)
        fewest = -fewest
    if longest > budget:
        raise input_error("max_token_len", None, f">= {longest}, the longest group of rows (in tokens)", f"{budget}")
    while True:
        if count > fewest:
            raise input_error(
                "max_token_len",
                None,
                f"a budget met by at most {fewest} micro-batches",
                f"{budget}, which needs {count}",
            )
        partitions = karmarkar_karp_arrays(work, count, False)
        within = fits(partitions, tokens, budget)
        if dp_group is not None:
            within = bool(_all_reduce([int(within)], "min", dp_group)[0])
        if within:
            return [sorted(p) for p in partitions]
        count += step


def _all_reduce(values: list[int], op: str, group: Any) -> list[int]:
    backend = torch.distributed.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    reduce_op = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.MIN
    torch.distributed.all_reduce(tensor, op=reduce_op, group=group)
    return tensor.tolist()


def postprocess_batch_func(
    output_lst: list[dict], indices: list[list[int]] | None, data: TensorDict, original: Original
) -> dict:
    """verl's ``postprocess_batch_func``: losses and metrics as verl gathers them; nested model outputs
    joined and put back in the batch's row order in one gather each (verl unbinds every one)."""
    outputs: dict[str, list[Any]] = {}
    for o in output_lst:
        for key, value in o.get("model_output", {}).items() if "model_output" in o else ():
            outputs.setdefault(key, []).append(value)
    if not all(is_nested(v) and ragged_dim(v) == 1 for parts in outputs.values() for v in parts):
        return original(ENGINE_UTILS, "postprocess_batch_func")(output_lst, indices, data)
    without = [{k: v for k, v in o.items() if k != "model_output"} for o in output_lst]
    result = original(ENGINE_UTILS, "postprocess_batch_func")(without, indices, data)

    use_dynamic_bsz = get_field(data, "use_dynamic_bsz", True)  # verl's default
    joined = {}
    for key, parts in outputs.items():
        fields = [_one_field(p) for p in parts]
        if use_dynamic_bsz:
            joined[key] = _restore(indices or [])(fields).get("x")
        else:
            joined[key] = take(fields, cat_plan(fields))[0].get("x")
    result["model_output"] = joined
    return result
