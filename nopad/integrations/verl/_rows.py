"""verl's row utilities on nopad's row algebra, with verl's signatures and results.

verl 0.9.1's ``tensordict_utils`` and ``seqlen_balancing`` move nested batches one row at a time
(``unbind`` and a rebuild from a Python list per field, per call); these give the same TensorDicts,
tensors and index lists from one gather per field, and the same partitions from array
Karmarkar-Karp. Where verl asserts, these raise ValueError naming what was expected. Behaviour that
verl has and nopad does not take over (a TensorDict without nested fields, a model output that is
not a nested tensor) is left to verl's own function.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from nopad.batches._balance import balanced_partitions, micro_batch_partitions
from nopad.batches._balance import karmarkar_karp as _karmarkar_karp
from nopad.batches._reorder import RowPlan, batch_lengths, row_index, take, take_nested
from nopad.batches._rows import RowRestore
from nopad.core._batch import get_field
from nopad.core._errors import input_error
from nopad.core._layout import device_to_host, is_nested, nested_offsets, ragged_dim
from nopad.core._torch_internals import is_jagged, put_checked
from nopad.integrations.verl._originals import verl_original

TENSORDICT_UTILS = "verl.utils.tensordict_utils"
SEQLEN_BALANCING = "verl.utils.seqlen_balancing"
ENGINE_UTILS = "verl.workers.engine.utils"


def _without_device(td: TensorDict) -> TensorDict:
    """verl builds these TensorDicts without a device: so do we, to hand back the same object."""
    if td.device is not None:
        td.clear_device_()
    return td


# ---- the split: nested fields to nopad, everything else to verl's own function ---------------------
# verl's row utilities loop over rows only for jagged nested fields (an ``unbind`` and a rebuild from a
# list per field). Everything else (dense tensors, NonTensorData, NonTensorStack, sub-TensorDicts, the
# checks on the arguments) goes through tensordict's own operations, whose results depend on the
# tensordict version (0.10 keeps the first part's NonTensorData in a cat, a row-index keeps a
# NonTensorData's device). So each route hands verl's function the batch without its nested fields
# (its results and its refusals are then verl's by construction), moves the nested fields with one
# gather each, and puts them where verl's function would have put them.
def _nested_keys(td: Any) -> list[str] | None:
    """The top-level jagged nested fields of a TensorDict with a batch dim, in its key order; None when
    there are none (or one is not jagged, or ``td`` is not such a TensorDict): verl's own function then."""
    if not isinstance(td, TensorDict) or td.batch_dims != 1:
        return None
    keys = [str(key) for key, value in td.items() if isinstance(value, Tensor) and is_nested(value)]
    if not keys or not all(is_jagged(td.get(key)) for key in keys):
        return None
    return keys


def _verl_set_order(td: TensorDict, nested: list[str]) -> list[str]:
    """The order verl adds nested fields back after the others: its set's iteration order (a set of
    the same keys built in the same order iterates the same way in one process)."""
    wanted = set(nested)
    return list({str(key) for key in td.keys() if key in wanted})


def _merge(order: list[str], rest: TensorDict, nested: TensorDict) -> TensorDict:
    """A TensorDict shaped like ``rest`` (verl's result for the other fields) holding its entries and
    the nested ones, keys in ``order``."""
    out = TensorDict({}, batch_size=rest.batch_size, device=rest.device)
    for key in order:
        put_checked(out, key, nested.get(key) if key in nested.keys() else rest.get(key))
    return out


def _refuse_no_rows(rows: int, nested: list[str]) -> None:
    """verl builds every nested result from a list of rows, which must not be empty."""
    if rows == 0:
        raise input_error(nested[0], None, "at least one row (verl cannot build a nested tensor of no rows)", "0 rows")


def _verl_index(indices: Any) -> Tensor:
    """The row index verl reads: a list through ``torch.tensor``, a tensor as it is."""
    return torch.tensor(indices) if isinstance(indices, list) else indices


def _nested_rows(td: TensorDict, nested: list[str], rows: Any) -> TensorDict:
    """The nested fields of ``td`` at ``rows`` (host ints, negative from the end as Python lists read
    them), one gather each. Integer rows only: verl reads a bool tensor's items as rows 0 and 1."""
    if isinstance(rows, Tensor) and (rows.dtype == torch.bool or rows.dtype.is_floating_point):
        raise input_error("indices", None, "integer row indices", f"a {rows.dtype} tensor")
    picked = row_index(rows, len(td))
    _refuse_no_rows(len(picked), nested)
    return take([td.select(*nested)], RowPlan.of(picked, [len(picked)], len(td)), reindex=False)[0]


def index_select_tensor_dict(batch: TensorDict | None, indices: Tensor | list[int]) -> Any:
    """verl's ``index_select_tensor_dict``: the rows ``indices`` of ``batch`` (None stays None), the
    nested fields in one gather each, the rest by verl's function."""
    verls = verl_original(TENSORDICT_UTILS, "index_select_tensor_dict")
    nested = _nested_keys(batch)
    if nested is None or batch is None:
        return verls(batch, indices)
    index = _verl_index(indices)
    rest = verls(batch.exclude(*nested), index)
    return _merge([str(k) for k in batch.keys()], rest, _nested_rows(batch, nested, index))


def chunk_tensordict(td: TensorDict, chunks: int) -> Any:
    """verl's ``chunk_tensordict``: ``chunks`` equal consecutive parts; nested fields (mrope's (B, C, j)
    included) as views of one buffer each."""
    verls = verl_original(TENSORDICT_UTILS, "chunk_tensordict")
    nested = _nested_keys(td)
    if nested is None:
        return verls(td, chunks)
    parts = verls(td.exclude(*nested), chunks)
    size = len(td) // chunks
    _refuse_no_rows(size, nested)
    pieces = take([td.select(*nested)], RowPlan.of(None, [size] * chunks, len(td)), reindex=False)
    order = _verl_set_order(td, nested)
    for part, piece in zip(parts, pieces):
        for key in order:
            put_checked(part, key, piece.get(key))
    return parts


def concat_nested_tensors(tensors: list[Tensor]) -> Tensor:
    """verl's ``concat_nested_tensors``: the rows of jagged nested tensors one after another."""
    if not isinstance(tensors, (list, tuple)) or not tensors or not all(is_nested(t) for t in tensors):
        return verl_original(TENSORDICT_UTILS, "concat_nested_tensors")(tensors)
    for i, tensor in enumerate(tensors):
        if not is_jagged(tensor) or not tensor.is_contiguous() or tensor.dim() < 2:
            raise input_error(f"tensors[{i}]", None, "a contiguous jagged nested tensor (B, j, ...)", f"{tensor.shape}")
    parts = _verl_dtype(list(tensors), "tensors")
    _refuse_no_rows(_rows_of(parts), ["tensors"])
    return _cat(parts, "tensors")


def _verl_dtype(tensors: list[Tensor], field: str) -> list[Tensor]:
    """The tensors' rows in verl's dtype: verl rebuilds rows of more than one dim with ``torch.cat``
    (mixed dtypes promote) and rows of one with ``as_nested_tensor`` (mixed dtypes refused)."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        if tensors[0].dim() == 2:
            found = ", ".join(str(d) for d in sorted(dtypes, key=str))
            raise input_error(field, None, "one dtype (verl cannot mix them in rows of one dim)", found)
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
        tensors = [t if t.dtype == dtype else t.to(dtype) for t in tensors]
    return tensors


def _rows_of(tensors: list[Tensor]) -> int:
    return sum(len(nested_offsets(t)) - 1 for t in tensors)


def _cat(tensors: list[Tensor], field: str) -> Tensor:
    """The rows of jagged tensors one after another: one cat of their tokens."""
    rows = _rows_of(tensors)
    return take_nested(tensors, RowPlan.of(None, [rows], rows), field)[0]


def concat_tensordict(data: list[TensorDict]) -> Any:
    """verl's ``concat_tensordict``: one cat per nested field; everything else by verl's function
    (tensordict's cat: 0.10 keeps the first part's NonTensorData and stacks NonTensorStacks)."""
    verls = verl_original(TENSORDICT_UTILS, "concat_tensordict")
    nested = _nested_keys(data[0]) if isinstance(data, (list, tuple)) and data else None
    if nested is None:
        return verls(data)
    for i, td in enumerate(data):
        keys = _nested_keys(td)
        if keys is None or set(keys) != set(nested):
            got = sorted(keys or [])
            raise input_error(f"data[{i}]", None, f"the nested fields of data[0] {sorted(nested)}", f"{got}")
    rest = verls([td.exclude(*nested) for td in data])
    _refuse_no_rows(len(rest), nested)
    fields = {key: _verl_dtype([td.get(key) for td in data], f"data[*][{key!r}]") for key in nested}
    for key, parts in fields.items():
        ragged = {ragged_dim(p) for p in parts}
        if len(ragged) > 1:
            raise input_error(f"data[*][{key!r}]", None, "one ragged dim in every part", f"{sorted(ragged)}")
    joined = {key: _cat(parts, f"data[*][{key!r}]") for key, parts in fields.items()}
    for key in _verl_set_order(data[0], nested):
        put_checked(rest, key, joined[key])
    return rest


def _count(value: Any, low: int, high: int | None = None) -> bool:
    """An int (not a bool) in [low, high]: a count nopad's route serves. verl's own function gets any
    other, and refuses it on a nested batch as verl alone does (its exception, its message)."""
    integer = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    return integer and low <= value and (high is None or value <= high)


def pad_to_divisor(data: TensorDict, size_divisor: int) -> Any:
    """verl's ``pad_to_divisor``: rows repeated from the start to a multiple of ``size_divisor``.
    verl's own cannot slice a TensorDict with nested fields (tensordict 0.10); this one repeats them
    with one gather each. A divisor < 1 is verl's own (a negative pad size is no padding)."""
    verls = verl_original(TENSORDICT_UTILS, "pad_to_divisor")
    nested = _nested_keys(data)
    if nested is None or not _count(size_divisor, 1):
        return verls(data, size_divisor)
    rest, pad = verls(data.exclude(*nested), size_divisor)
    if pad == 0:
        return data, 0
    B = len(data)
    rows = np.concatenate([np.arange(B), np.arange(pad) % B]).astype(np.int64)
    return _merge([str(k) for k in data.keys()], rest, _nested_rows(data, nested, rows)), pad


def unpad(data: TensorDict, pad_size: int) -> Any:
    """verl's ``unpad``: ``data[:-pad_size]`` (``data`` itself for 0; a batch of no rows when every
    row goes), nested fields in one gather each. A pad size outside [0, rows] is verl's own (a
    negative one would keep rows from the start)."""
    verls = verl_original(TENSORDICT_UTILS, "unpad")
    nested = _nested_keys(data)
    if nested is None or not _count(pad_size, 0, len(data)):
        return verls(data, pad_size)
    without = data.exclude(*nested)
    rest = verls(without, pad_size)
    if rest is without:
        return data
    kept = np.arange(len(data) - pad_size, dtype=np.int64)  # verl's slice; none left is a batch of none
    rows = take([data.select(*nested)], RowPlan.of(kept, [len(kept)], len(data)), reindex=False)[0]
    return _merge([str(k) for k in data.keys()], rest, rows)


def _nopad_partitions(seqlen_list: Any, k_partitions: Any, equal_size: Any) -> np.ndarray | None:
    """The values as a host array where nopad's array Karmarkar-Karp takes them: a 1-D list, array or
    tensor of integers >= 0, an int k from 1 to their number (dividing it with a bool ``equal_size``
    True); None otherwise. verl's own takes any numbers, more parts than items (some left empty), a
    2-D tensor, truthy flags, and refuses the rest with its AssertionError: those go to verl's."""
    try:
        array = np.asarray(device_to_host(seqlen_list) if isinstance(seqlen_list, Tensor) else seqlen_list)
    except (TypeError, ValueError):  # ragged lists, dtypes numpy has not: verl's to read
        return None
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        return None
    if not (_count(k_partitions, 1, array.size) and isinstance(equal_size, bool)) or (array < 0).any():
        return None
    return None if equal_size and array.size % k_partitions else array


def karmarkar_karp(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """verl's ``karmarkar_karp``: the same partitions, item for item, from arrays."""
    array = _nopad_partitions(seqlen_list, k_partitions, equal_size)
    if array is None:
        return verl_original(SEQLEN_BALANCING, "karmarkar_karp")(seqlen_list, k_partitions, equal_size)
    return _karmarkar_karp(array, k_partitions, equal_size)


def get_seqlen_balanced_partitions(seqlen_list: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """verl's ``get_seqlen_balanced_partitions``: the same partitions, each sorted."""
    array = _nopad_partitions(seqlen_list, k_partitions, equal_size)
    if array is None:
        return verl_original(SEQLEN_BALANCING, "get_seqlen_balanced_partitions")(seqlen_list, k_partitions, equal_size)
    partitions = balanced_partitions(array, k_partitions, equal_size)
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
    collectives, so the count is verl's), the micro-batches' tensors as one gather per field and
    their other entries (metadata, sub-TensorDicts) as verl's ``index_select_tensor_dict`` makes them."""
    lengths = batch_lengths(batch)
    sync = torch.distributed.is_initialized() and same_micro_num_in_dp and dp_group is not None
    rows = micro_batch_partitions(
        lengths,
        max_token_len,
        dp_group=dp_group if sync else None,
        num_batches_divided_by=num_batches_divided_by,
        min_num_micro_batch=min_num_micro_batch,
        balance=use_dynamic_bsz_balance,
        force_group_size=force_group_size,
        protocol="verl",
    )
    order = np.array([r for p in rows for r in p], dtype=np.int64)
    tensors = [str(key) for key, value in batch.items() if isinstance(value, Tensor)]
    plan = RowPlan.of(order, [len(p) for p in rows], len(lengths))
    micro = [_without_device(m) for m in take([batch.select(*tensors)], plan, reindex=False)]
    others = batch.exclude(*tensors)
    if list(others.keys()):
        keys = [str(key) for key in batch.keys()]
        if all(type(others.get(key)).__name__ == "NonTensorData" for key in others.keys()):
            shared: dict[tuple[str, int], Any] = {}
            in_place = keys[: len(tensors)] == tensors  # the metadata comes last: added to each part as it is
            micro = [_with_metadata(keys, m, others, shared, in_place) for m in micro]
        else:  # per-row metadata (a NonTensorStack) or a sub-TensorDict: verl's own selection of them
            verls = verl_original(TENSORDICT_UTILS, "index_select_tensor_dict")
            micro = [_merge(keys, verls(others, p), m) for m, p in zip(micro, rows)]
    return micro, rows


def _with_metadata(keys: list[str], part: TensorDict, metadata: TensorDict, shared: dict, in_place: bool) -> TensorDict:
    """``part`` with the batch's one-value metadata (NonTensorData), keys in verl's order: what verl's
    row selection of that metadata gives every micro-batch (the same value at the part's batch size).
    One NonTensorData per key and part size, shared by the parts of that size (building one costs
    more than the gathers of a part; tensordict replaces, never mutates, an entry that is set).
    ``in_place``: the metadata keys come after all of ``part``'s, which then takes them itself."""
    size = part.batch_size
    out = part if in_place else TensorDict({}, batch_size=size, device=part.device)
    for key in keys:
        if key in metadata.keys():
            value = shared.get((key, size[0]))
            if value is None:
                value = shared[key, size[0]] = metadata.get(key)[: size[0]]
            put_checked(out, key, value)
        elif not in_place:
            put_checked(out, key, part.get(key))
    return out


def postprocess_batch_func(output_lst: list[dict], indices: list[list[int]] | None, data: TensorDict) -> dict:
    """verl's ``postprocess_batch_func``: losses and metrics as verl gathers them; nested model outputs
    joined and put back in the batch's row order in one gather each (verl unbinds every one)."""
    outputs: dict[str, list[Any]] = {}
    for o in output_lst:
        for key, value in o.get("model_output", {}).items() if "model_output" in o else ():
            outputs.setdefault(key, []).append(value)
    if not all(is_jagged(v) and ragged_dim(v) == 1 for parts in outputs.values() for v in parts):
        return verl_original(ENGINE_UTILS, "postprocess_batch_func")(output_lst, indices, data)
    without = [{k: v for k, v in o.items() if k != "model_output"} for o in output_lst]
    result = verl_original(ENGINE_UTILS, "postprocess_batch_func")(without, indices, data)

    use_dynamic_bsz = get_field(data, "use_dynamic_bsz", True)  # verl's default
    if use_dynamic_bsz and outputs and indices is None:
        raise input_error("indices", None, "the micro-batches' row lists (use_dynamic_bsz is on)", "None")
    joined = {}
    for key, parts in outputs.items():
        _refuse_no_rows(_rows_of(parts), [f"model_output[{key!r}]"])
        joined[key] = _restore(indices or [])(parts) if use_dynamic_bsz else _cat(parts, f"model_output[{key!r}]")
    result["model_output"] = joined
    return result
