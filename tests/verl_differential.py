"""Randomized TensorDicts of every field and metadata kind verl 0.9.1 puts in its batches, built twice
from one description (so verl alone and verl under ``install()`` each get fresh, identical inputs),
and a comparison of two results as a verl user would see them, bit for bit.

Used by tests/test_integration_verl_differential.py; needs verl (and tensordict) importable.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

# private: batches laid out as nopad's own conversions record them (host lengths in the memo)
from nopad.core._layout import remember_host_lengths

# ---- what a field can be --------------------------------------------------------------------------
# nested fields: how their jagged tensor was made, as verl's and nopad's code make them
#   "offsets": torch.nested.nested_tensor_from_jagged(values, offsets), no min / max recorded
#   "nopad":   values + offsets with min / max recorded and the host lengths known to nopad (a conversion's)
#   "list":    torch.nested.as_nested_tensor(rows) (verl's engines, restore_dynamic_batch, list_of_dict...);
#              for (B, C, j) verl's tensordict_utils.nested_tensor_from_tensor_list (its _ragged_idx set by hand)
NESTED_STYLES = ("offsets", "nopad", "list")

# metadata verl stores: one value for the batch (NonTensorData) ...
DATA_VALUES: tuple[Any, ...] = (
    0.7,
    1.0,
    2,
    True,
    "fsdp",
    None,
    {"mfu": 0.31, "memory/allocated": [1.5, 2.0]},
    {"mfu": 0.12, "memory/allocated": [1.0]},
    [3, 1, 2],
    "tensor",  # a tensor as metadata (verl's ``indices``): built fresh each time, see _data_value
)
# ... or one per row (NonTensorStack)
ROW_ITEMS: tuple[Any, ...] = ("uid-a", "uid-b", 7, None, {"acc": 1.0}, [0.5, 0.8], [])


@dataclasses.dataclass(frozen=True)
class Field:
    key: str
    kind: str  # "dense", "nested", "mrope", "data", "stack", "sub"
    dtype: str = "float32"
    trailing: tuple[int, ...] = ()
    group: int = 0  # nested: fields of one group share their offsets tensor (style permitting)
    style: str = "offsets"
    value: Any = None  # data: the value; stack: the item pool offset


@dataclasses.dataclass(frozen=True)
class Part:
    """One TensorDict: its rows' lengths per nested group and its fields."""

    lengths: tuple[tuple[int, ...], ...]  # per group
    fields: tuple[Field, ...]
    seed: int = 0
    device: str | None = None
    batch_dims: int = 1  # 0: a TensorDict without a batch dim (metadata only)

    @property
    def rows(self) -> int:
        return len(self.lengths[0])


DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def _random(shape: tuple[int, ...], dtype: str, g: torch.Generator) -> torch.Tensor:
    t = DTYPES[dtype]
    if t.is_floating_point:
        return torch.randn(shape, generator=g).to(t)
    if t == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 200, shape, generator=g).to(t)


def _data_value(value: Any, g: torch.Generator) -> Any:
    if isinstance(value, str) and value == "tensor":
        return torch.randint(0, 50, (5,), generator=g)
    if isinstance(value, (dict, list)):
        return _copy(value)
    return value


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _nested(rows: list[torch.Tensor], offsets: torch.Tensor | None, field: Field, lengths: np.ndarray) -> torch.Tensor:
    ragged = 2 if field.kind == "mrope" else 1
    if field.style == "list":
        if field.kind == "mrope":
            import verl.utils.tensordict_utils as tu

            return tu.nested_tensor_from_tensor_list(rows, ragged_idx=2)
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    values = torch.cat(rows, dim=ragged - 1)
    assert offsets is not None
    if field.style == "nopad":
        seqlens = {"min_seqlen": int(lengths.min()), "max_seqlen": int(lengths.max())} if len(lengths) else {}
        return torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=ragged, **seqlens)
    return torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=ragged)


def build(part: Part) -> TensorDict:
    """The TensorDict ``part`` describes: deterministic, fresh tensors (and offsets) on every call."""
    g = torch.Generator().manual_seed(part.seed)
    B = part.rows
    if part.batch_dims == 0:
        td = TensorDict({}, batch_size=[], device=part.device)
        for f in part.fields:
            if f.kind == "data":
                td[f.key] = NonTensorData(_data_value(f.value, g))
        return td
    td = TensorDict({}, batch_size=[B], device=part.device)
    offsets: dict[tuple[int, str], torch.Tensor] = {}
    for f in part.fields:
        if f.kind == "dense":
            td[f.key] = _random((B, *f.trailing), f.dtype, g)
        elif f.kind in ("nested", "mrope"):
            lengths = np.asarray(part.lengths[f.group], dtype=np.int64)
            if f.kind == "mrope":
                rows = [_random((4, int(n)), f.dtype, g) for n in lengths]
            else:
                rows = [_random((int(n), *f.trailing), f.dtype, g) for n in lengths]
            off = None
            if f.style != "list":
                if (f.group, f.style) not in offsets:
                    o = torch.zeros(B + 1, dtype=torch.int64)
                    o[1:] = torch.as_tensor(lengths).cumsum(0)
                    if f.style == "nopad":
                        remember_host_lengths(o, lengths.copy())
                    offsets[f.group, f.style] = o
                off = offsets[f.group, f.style]
            td[f.key] = _nested(rows, off, f, lengths)
        elif f.kind == "data":
            td[f.key] = NonTensorData(_data_value(f.value, g))
        elif f.kind == "stack":
            items = [_copy(ROW_ITEMS[(f.value + i) % len(ROW_ITEMS)]) for i in range(B)]
            td[f.key] = NonTensorStack.from_list([NonTensorData(x) for x in items])
        elif f.kind == "sub":
            td[f.key] = TensorDict({"scores": _random((B, 2), f.dtype, g)}, batch_size=[B])
    return td


# ---- strategies -----------------------------------------------------------------------------------
@st.composite
def lengths_of(draw, rows: int, empty: bool = True) -> tuple[int, ...]:
    kind = draw(st.sampled_from(["random", "equal", "with_empty"] if empty else ["random", "equal"]))
    if kind == "equal":
        return (draw(st.integers(1, 6)),) * rows
    low = 0 if kind == "with_empty" else 1
    return tuple(draw(st.lists(st.integers(low, 6), min_size=rows, max_size=rows)))


@st.composite
def field_list(draw, *, nested: bool | None = None, sub: bool = True, mrope: bool = True) -> tuple[Field, ...]:
    """A set of fields as verl's batches hold them; ``nested`` True / False forces or forbids nested ones."""
    fields: list[Field] = []
    want_nested = draw(st.booleans()) if nested is None else nested
    if want_nested:
        style = draw(st.sampled_from(NESTED_STYLES))
        fields.append(Field("input_ids", "nested", "int64", style=style))
        if draw(st.booleans()):
            fields.append(Field("log_probs", "nested", "float32", style=draw(st.sampled_from([style, "list"]))))
        if draw(st.booleans()):
            fields.append(Field("routed_experts", "nested", "uint8", (3, 2), style=style))
        if draw(st.booleans()):
            fields.append(Field("teacher_logprobs", "nested", "bfloat16", (4,), style=style))
        if mrope and draw(st.booleans()):
            fields.append(Field("position_ids", "mrope", "int64", style=draw(st.sampled_from(NESTED_STYLES))))
        if draw(st.booleans()):
            fields.append(Field("responses", "nested", "float64", group=1, style=draw(st.sampled_from(NESTED_STYLES))))
    for i in range(draw(st.integers(0 if want_nested else 1, 3))):
        dtype = draw(st.sampled_from(["float32", "int64", "bool", "uint8", "bfloat16"]))
        trailing = draw(st.sampled_from([(), (3,), (2, 3)]))
        fields.append(Field(f"dense{i}", "dense", dtype, trailing))
    for i in range(draw(st.integers(0, 3))):
        fields.append(Field(f"meta{i}", "data", value=draw(st.sampled_from(DATA_VALUES))))
    for i in range(draw(st.integers(0, 2))):
        fields.append(Field(f"rows{i}", "stack", value=draw(st.integers(0, len(ROW_ITEMS) - 1))))
    if sub and draw(st.integers(0, 5)) == 0:
        fields.append(Field("extra", "sub"))
    order = draw(st.permutations(range(len(fields))))
    return tuple(fields[i] for i in order)


@st.composite
def parts(
    draw,
    *,
    rows: st.SearchStrategy[int] | None = None,
    nested: bool | None = None,
    sub: bool = True,
    mrope: bool = True,
) -> Part:
    """One TensorDict's description (``rows``: its number of rows, 1 to 6 by default)."""
    B = draw(rows if rows is not None else st.integers(1, 6))
    fields = draw(field_list(nested=nested if B else False, sub=sub, mrope=mrope))  # no nested field of 0 rows
    lengths = (draw(lengths_of(B)), draw(lengths_of(B)))
    device = draw(st.sampled_from([None, None, "cpu"]))
    return Part(lengths, fields, seed=draw(st.integers(0, 2**16)), device=device)


@st.composite
def concat_parts(draw, *, max_parts: int = 4) -> list[Part]:
    """Parts to join: the same fields, each part its own rows and seed; metadata equal or differing
    across parts; sometimes a part that does not match (a key missing, a kind or dtype changed)."""
    first = draw(parts(rows=st.integers(1, 5)))
    out = [first]
    for _ in range(draw(st.integers(0, max_parts - 1))):
        B = draw(st.integers(1, 5))
        fields = []
        for f in first.fields:
            if f.kind == "data" and draw(st.booleans()):  # this part's value differs (or not, by chance)
                f = dataclasses.replace(f, value=draw(st.sampled_from(DATA_VALUES)))
            elif f.kind == "stack":
                f = dataclasses.replace(f, value=draw(st.integers(0, len(ROW_ITEMS) - 1)))
            fields.append(f)
        lengths = (draw(lengths_of(B)), draw(lengths_of(B)))
        device = draw(st.sampled_from([first.device] * 7 + [None, "cpu"]))
        out.append(Part(lengths, tuple(fields), seed=draw(st.integers(0, 2**16)), device=device))
    mismatch = draw(st.sampled_from([None] * 6 + ["drop", "kind", "dtype", "nested_style", "all_data_equal"]))
    if len(out) > 1 and mismatch is not None:
        i = draw(st.integers(1, len(out) - 1))
        target = out[i]
        fields = list(target.fields)
        if mismatch == "all_data_equal":  # every part's metadata the first part's (the common case)
            for p in range(1, len(out)):
                out[p] = dataclasses.replace(out[p], fields=first.fields)
            return out
        if fields:
            j = draw(st.integers(0, len(fields) - 1))
            f = fields[j]
            if mismatch == "drop":
                del fields[j]
            elif mismatch == "kind":
                swap = {"data": "stack", "stack": "data", "dense": "data", "nested": "dense", "mrope": "nested"}
                kind = swap.get(f.kind, f.kind)
                value = 0 if kind == "stack" else (f.value if kind != "data" else 1.0)
                fields[j] = dataclasses.replace(f, kind=kind, value=value, trailing=())
            elif mismatch == "dtype":
                fields[j] = dataclasses.replace(f, dtype="float64" if f.dtype != "float64" else "int64")
            elif mismatch == "nested_style" and f.kind in ("nested", "mrope"):
                fields[j] = dataclasses.replace(f, style="list" if f.style != "list" else "offsets")
            out[i] = dataclasses.replace(target, fields=tuple(fields))
    return out


# ---- comparing two results ------------------------------------------------------------------------
class Kinds(Counter):
    """What the compared results held: a count per kind of value, for the report."""

    def note(self, what: str) -> None:
        self[what] += 1


def nested_shape(x: torch.Tensor) -> tuple[str, ...]:
    """A jagged tensor's reported shape, its ragged (symbolic) sizes written "j"."""
    return tuple(str(n) if isinstance(n, int) else "j" for n in x.shape)


def true_nested_shape(x: torch.Tensor) -> tuple[str, ...]:
    """The shape its values, offsets and ragged dim make: (B, *values.shape, j at the ragged dim)."""
    values = [str(n) for n in x.values().shape]
    values[x._ragged_idx - 1] = "j"
    return (str(x.offsets().numel() - 1), *values)


def assert_same(theirs: Any, ours: Any, where: str = "result", kinds: Kinds | None = None) -> None:
    """``ours`` equals ``theirs`` as a verl user sees it: types, keys in order, batch sizes, devices,
    dtypes, shapes, values bit for bit, nested offsets and ragged dims, metadata values and types."""
    kinds = kinds if kinds is not None else Kinds()
    assert type(ours) is type(theirs), f"{where}: {type(theirs).__name__} vs {type(ours).__name__}"
    if isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{where}: {len(theirs)} items vs {len(ours)}"
        for i, (a, b) in enumerate(zip(theirs, ours)):
            assert_same(a, b, f"{where}[{i}]", kinds)
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{where}: keys {list(theirs)} vs {list(ours)}"
        for key in theirs:
            assert_same(theirs[key], ours[key], f"{where}[{key!r}]", kinds)
    elif isinstance(theirs, TensorDict):
        kinds.note("TensorDict")
        assert ours.batch_size == theirs.batch_size, f"{where}: batch {theirs.batch_size} vs {ours.batch_size}"
        assert ours.device == theirs.device, f"{where}: device {theirs.device} vs {ours.device}"
        assert list(ours.keys()) == list(theirs.keys()), f"{where}: keys {list(theirs.keys())} vs {list(ours.keys())}"
        for key in theirs.keys():
            assert_same(theirs.get(key), ours.get(key), f"{where}.{key}", kinds)
    elif isinstance(theirs, (NonTensorData, NonTensorStack)):
        kinds.note(type(theirs).__name__)
        assert ours.batch_size == theirs.batch_size, f"{where}: batch {theirs.batch_size} vs {ours.batch_size}"
        assert ours.device == theirs.device, f"{where}: device {theirs.device} vs {ours.device}"
        if isinstance(theirs, NonTensorData):
            assert_same(theirs.data, ours.data, f"{where}.data", kinds)
        else:
            assert_same(theirs.tolist(), ours.tolist(), f"{where}.tolist()", kinds)
    elif isinstance(theirs, torch.Tensor):
        assert ours.is_nested == theirs.is_nested, f"{where}: nested {theirs.is_nested} vs {ours.is_nested}"
        assert ours.dtype == theirs.dtype and ours.device == theirs.device, f"{where}: dtype / device"
        assert ours.requires_grad == theirs.requires_grad, f"{where}: requires_grad"
        if theirs.is_nested:
            kinds.note("nested (B, C, j)" if theirs._ragged_idx == 2 else f"nested {theirs.dim()}-D (B, j, ...)")
            assert ours.layout == theirs.layout == torch.jagged, f"{where}: layout"
            assert ours._ragged_idx == theirs._ragged_idx, (
                f"{where}: ragged dim {theirs._ragged_idx} vs {ours._ragged_idx}"
            )
            _assert_tensor(theirs.offsets(), ours.offsets(), f"{where}.offsets()")
            _assert_tensor(theirs.values(), ours.values(), f"{where}.values()")
            assert ours.is_contiguous() == theirs.is_contiguous(), f"{where}: contiguous"
            if nested_shape(theirs) == true_nested_shape(theirs):
                assert nested_shape(ours) == nested_shape(theirs), f"{where}: shape {theirs.shape} vs {ours.shape}"
            else:  # verl's reported shape is stale: nopad's is the true one (or verl's own, passed through)
                kinds.note("verl's nested shape stale (values, offsets, ragged dim compared)")
                assert nested_shape(ours) in (true_nested_shape(ours), nested_shape(theirs)), f"{where}: {ours.shape}"
        else:
            kinds.note("dense tensor")
            _assert_tensor(theirs, ours, where)
    elif dataclasses.is_dataclass(theirs) and not isinstance(theirs, type):  # megatron's PackedSeqParams
        kinds.note(type(theirs).__name__)
        for f in dataclasses.fields(theirs):
            assert_same(getattr(theirs, f.name), getattr(ours, f.name), f"{where}.{f.name}", kinds)
    elif isinstance(theirs, float) and math.isnan(theirs):
        assert isinstance(ours, float) and math.isnan(ours), where
    else:
        kinds.note(f"python {type(theirs).__name__}")
        assert ours == theirs, f"{where}: {theirs!r} vs {ours!r}"


def _assert_tensor(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    """Same dtype, shape, device and bytes (so -0.0 is not 0.0 and NaN payloads count)."""
    assert b.dtype == a.dtype and b.shape == a.shape and b.device == a.device, (
        f"{where}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    )
    if a.numel():
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), (
            f"{where}: values differ"
        )


def raised_here(exc: BaseException) -> bool:
    """Whether ``exc`` was raised in these tests' own code (building inputs), not in the call tested."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "/tests/" in tb.tb_frame.f_code.co_filename


def outcome(call) -> tuple[str, Any]:
    """("ok", result) or ("error", the exception)."""
    try:
        return "ok", call()
    except Exception as exc:  # noqa: BLE001 - compared, not hidden
        return "error", exc
