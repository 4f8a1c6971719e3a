"""Packed Parquet files: token-id rows plus metadata that lets a reader refuse a bad file up front.

Columns are the row fields of rows.py as ``list<int32>``. The schema metadata key ``nopad.packed``
holds JSON: format_version, pack_length, alignment, tp_size, cp_size, pad_token_id, the tokenizer
identity (name, vocab_hash, vocab_size), num_rows, max_token_id, rows_checksum (sha256 of every
column), the pack report and metadata_checksum (sha256 of all the other keys, so an edited
alignment, pad id or pack length is caught as surely as an edited row).

:func:`read_packed` checks all of it when the file is opened: every key's type and range, the
metadata checksum, the tokenizer, the schema, every row, the row count and the rows checksum. A
tampered, truncated or foreign file fails there, on the CPU, before any model is loaded, with every
problem found listed (:func:`check_packed` returns them as a list; ``nopad inspect`` prints them).

Format versions: 2 (written now) adds max_token_id and metadata_checksum. Files of version 1 are
still read, every key type- and range-checked, but their metadata is covered by no checksum
(``PackedFile.metadata_checksummed`` is False, and ``nopad inspect`` says so): repack to cover it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nopad.core._errors import check_int, in_file, input_error
from nopad.packing._collate import check_row_arrays, negative_id_error
from nopad.packing._rows import ROW_FIELDS, Columns, Row, validate_columns
from nopad.packing._tokenizer import MAX_TOKEN_ID, TokenizerIdentity

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
METADATA_KEY = b"nopad.packed"
_V1_KEYS = (
    "format_version",
    "pack_length",
    "alignment",
    "tp_size",
    "cp_size",
    "pad_token_id",
    "tokenizer",
    "num_rows",
    "rows_checksum",
    "report",
)
METADATA_KEYS = {1: _V1_KEYS, 2: (*_V1_KEYS, "max_token_id", "metadata_checksum")}
TOKENIZER_KEYS = ("name", "vocab_hash", "vocab_size")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def write_packed(
    path: str | os.PathLike[str],
    rows: Sequence[Row],
    *,
    pack_length: int,
    tokenizer: TokenizerIdentity,
    pad_token_id: int,
    alignment: int = 1,
    tp_size: int = 1,
    cp_size: int = 1,
    report: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Validate ``rows`` and the settings, and write them to ``path``; returns the metadata written.

    The settings pass the very checks :func:`read_packed` applies, so a written file always opens.
    They are ints by :func:`nopad.core._errors.check_int` (numpy ints are stored as the ints they are).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = checked_path(path)
    pack_length, alignment = check_int(pack_length, "pack_length", low=1), check_int(alignment, "alignment", low=1)
    tp_size, cp_size = check_int(tp_size, "tp_size", low=1), check_int(cp_size, "cp_size", low=1)
    pad_token_id = check_int(pad_token_id, "pad_token_id", low=0)
    check_row_arrays(rows)
    cols = Columns.from_rows(rows)
    meta = {
        "format_version": FORMAT_VERSION,
        "pack_length": pack_length,
        "alignment": alignment,
        "tp_size": tp_size,
        "cp_size": cp_size,
        "pad_token_id": pad_token_id,
        "tokenizer": _identity_dict(tokenizer),
        "num_rows": cols.num_rows,
        "max_token_id": _max_token_id(cols),
        "rows_checksum": cols.checksum(),
        "report": {} if report is None else report,
    }
    # the settings first (a zero alignment must not reach the row checks), then the rows, then the
    # facts taken from the rows (an id past int32 when the vocabulary is unknown)
    settings = {**meta, "num_rows": 0, "max_token_id": None, "metadata_checksum": "0" * 64}
    if problems := metadata_problems(settings):
        raise in_file(os.fspath(path), _joined(problems))
    vocab, pad = tokenizer.vocab_size, pad_token_id
    validate_columns(cols, pack_length=pack_length, alignment=alignment, vocab_size=vocab, pad_token_id=pad)
    if (negative := negative_id_error(cols)) is not None:
        raise negative
    if problems := metadata_problems({**meta, "metadata_checksum": "0" * 64}):
        raise in_file(os.fspath(path), _joined(problems))
    meta["metadata_checksum"] = metadata_checksum(meta)
    arrays = [
        pa.ListArray.from_arrays(pa.array(cols.offsets[f].astype(np.int32)), pa.array(cols.values[f].astype(np.int32)))
        for f in ROW_FIELDS
    ]
    table = pa.Table.from_arrays(arrays, names=list(ROW_FIELDS))
    table = table.replace_schema_metadata({METADATA_KEY: _canonical(meta).encode()})
    # zstd, with dictionaries only for the small-valued columns: on 32 M tokens pyarrow writes this in
    # about 2.0 s instead of 3.6 s and reads it in 0.8 to 1.2 s instead of 1.7 s, for 14% more bytes
    # than its default (a dictionary over a vocabulary-sized id column is what made the default slow)
    # pyarrow names a list column's values by their leaf path ("element" since pyarrow 13, "item" before)
    leaves = [f"{field}.list.{leaf}" for field in DICTIONARY_FIELDS for leaf in ("element", "item")]
    pq.write_table(table, path, compression="zstd", use_dictionary=leaves)
    return meta


DICTIONARY_FIELDS = ("token_mask", "position_ids", "packed_cu_seqlens")  # values far below the vocabulary


def _identity_dict(tokenizer: object) -> object:
    if not isinstance(tokenizer, TokenizerIdentity):
        return tokenizer  # metadata_problems names it
    return {"name": tokenizer.name, "vocab_hash": tokenizer.vocab_hash, "vocab_size": tokenizer.vocab_size}


def _max_token_id(cols: Columns) -> int | None:
    """The largest id in input_ids and target_ids (padding included); None for a file without rows."""
    ids, targets = cols.values["input_ids"], cols.values["target_ids"]
    return max(int(ids.max()), int(targets.max())) if ids.size and targets.size else None


def _canonical(meta: Mapping[str, Any]) -> str:
    """The one JSON text of ``meta`` (sorted keys, no spaces): what both checksums and the file hold."""
    try:
        return json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise input_error("metadata", None, "JSON values only (the report included; no NaN)", f"{e}") from None


def metadata_checksum(meta: Mapping[str, Any]) -> str:
    """sha256 of every metadata key but ``metadata_checksum`` itself, in canonical JSON."""
    rest = {k: v for k, v in meta.items() if k != "metadata_checksum"}
    return hashlib.sha256(_canonical(rest).encode()).hexdigest()


# ---- metadata checks: each returns the problems it finds, so a reader can list them all ----------
def _is_int(value: object, low: int, high: int = MAX_TOKEN_ID) -> bool:
    """Whether a stored value passes the one int rule (:func:`nopad.core._errors.check_int`) in [low, high]."""
    try:
        check_int(value, "metadata", low=low, high=high)  # bool is refused: True is not a length
    except ValueError:
        return False
    return True


def _int_text(low: int, high: int = MAX_TOKEN_ID) -> str:
    return f"an integer in [{low}, {high}]"


def _problem(key: str, expected: str, actual: object) -> str:
    """'metadata KEY: expected ..., got VALUE' with the stored value as Python shows it (cut at 80)."""
    return str(input_error(f"metadata {key}", None, expected, f"{actual!r:.80}"))


def _valid_int(meta: Mapping[str, Any], key: str, low: int) -> int | None:
    """meta[key] when it is a valid int >= low, else None (its own check reports it)."""
    value = meta.get(key)
    return value if _is_int(value, low) else None


def _check_ints(meta: Mapping[str, Any]) -> list[str]:
    bounds = {"pack_length": 1, "alignment": 1, "tp_size": 1, "cp_size": 1, "num_rows": 0}
    return [
        _problem(k, _int_text(low), meta[k]) for k, low in bounds.items() if k in meta and not _is_int(meta[k], low)
    ]


def _check_layout(meta: Mapping[str, Any]) -> list[str]:
    """alignment divides pack_length and is a multiple of tp_size * cp_size (the least any CP layout needs)."""
    pack_length, alignment = _valid_int(meta, "pack_length", 1), _valid_int(meta, "alignment", 1)
    tp, cp = _valid_int(meta, "tp_size", 1), _valid_int(meta, "cp_size", 1)
    problems = []
    if pack_length is not None and alignment is not None and pack_length % alignment:
        problems.append(_problem("alignment", f"a divisor of pack_length {pack_length}", alignment))
    if alignment is not None and tp is not None and cp is not None and alignment % (tp * cp):
        problems.append(_problem("alignment", f"a multiple of tp_size * cp_size = {tp * cp}", alignment))
    return problems


def _check_tokenizer(meta: Mapping[str, Any]) -> list[str]:
    tok = meta.get("tokenizer")
    if "tokenizer" not in meta:
        return []
    if not isinstance(tok, dict) or sorted(tok) != sorted(TOKENIZER_KEYS):
        return [_problem("tokenizer", f"an object with exactly the keys {list(TOKENIZER_KEYS)}", tok)]
    problems = []
    if not isinstance(tok["name"], str) or not tok["name"].strip():
        problems.append(_problem("tokenizer name", "a non-empty string", tok["name"]))
    unknown_vocab = tok["vocab_hash"] == "" and meta.get("format_version", 0) >= 2
    if not (unknown_vocab or (isinstance(tok["vocab_hash"], str) and _SHA256.fullmatch(tok["vocab_hash"]))):
        problems.append(_problem("tokenizer vocab_hash", "64 lowercase hex digits (a sha256)", tok["vocab_hash"]))
    if not (_is_int(tok["vocab_size"], 1, MAX_TOKEN_ID + 1) or (unknown_vocab and tok["vocab_size"] is None)):
        problems.append(_problem("tokenizer vocab_size", _int_text(1, MAX_TOKEN_ID + 1), tok["vocab_size"]))
    return problems


def _vocab_size(meta: Mapping[str, Any]) -> int | None:
    """The file's vocabulary size when its tokenizer entry states a valid one."""
    tok = meta.get("tokenizer")
    size = tok.get("vocab_size") if isinstance(tok, dict) else None
    return size if _is_int(size, 1, MAX_TOKEN_ID + 1) else None


def _check_ids(meta: Mapping[str, Any]) -> list[str]:
    """pad_token_id and max_token_id are ids: in [0, vocab_size) when the size is known."""
    vocab = _vocab_size(meta)
    top = MAX_TOKEN_ID if vocab is None else vocab - 1
    problems = []
    if "pad_token_id" in meta and not _is_int(meta["pad_token_id"], 0, top):
        problems.append(_problem("pad_token_id", f"a token id in [0, {top}]", meta["pad_token_id"]))
    if "max_token_id" in meta:
        value, empty = meta["max_token_id"], meta.get("num_rows") == 0
        if not (_is_int(value, 0, top) or (value is None and empty)):
            problems.append(_problem("max_token_id", f"a token id in [0, {top}] (null only without rows)", value))
    return problems


def _check_hashes(meta: Mapping[str, Any]) -> list[str]:
    keys = [k for k in ("rows_checksum", "metadata_checksum") if k in meta]
    bad = [k for k in keys if not (isinstance(meta[k], str) and _SHA256.fullmatch(meta[k]))]
    problems = [_problem(k, "64 lowercase hex digits (a sha256)", meta[k]) for k in bad]
    if "report" in meta and not isinstance(meta["report"], dict):
        problems.append(_problem("report", "an object", meta["report"]))
    return problems


_METADATA_CHECKS: tuple[Callable[[Mapping[str, Any]], list[str]], ...] = (
    _check_ints,
    _check_layout,
    _check_tokenizer,
    _check_ids,
    _check_hashes,
)


def metadata_problems(meta: object) -> list[str]:
    """Every problem with a packed file's metadata: keys, each key's type and range, cross-key rules.

    The metadata checksum's VALUE is compared by :func:`check_packed`; this checks its form only.
    """
    if not isinstance(meta, dict):
        return [str(input_error("metadata", None, "a JSON object", type(meta).__name__))]
    version = meta.get("format_version")
    if not (type(version) is int and version in READABLE_VERSIONS):
        newer = " (a newer nopad wrote this file: upgrade nopad)" if _is_int(version, FORMAT_VERSION + 1) else ""
        return [_problem("format_version", f"one of {list(READABLE_VERSIONS)}{newer}", version)]
    keys = METADATA_KEYS[version]
    problems = []
    if missing := [k for k in keys if k not in meta]:
        problems.append(str(input_error("metadata keys", None, f"every key of format {version}", f"missing {missing}")))
    if unknown := sorted(k for k in meta if k not in keys):
        expected = f"only the keys of format {version}"
        problems.append(str(input_error("metadata keys", None, expected, f"unknown {unknown}")))
    for check in _METADATA_CHECKS:
        problems += check(meta)
    return problems


# ---- reading -----------------------------------------------------------------------------------
@dataclass
class PackedFile:
    """An opened, fully validated packed file. ``rows[i]`` is a dict of int64 arrays.

    ``metadata_checksummed`` is False for a format-1 file: its metadata passed every type and range
    check but no checksum covers it.
    """

    path: str
    metadata: dict[str, Any]
    columns: Columns
    metadata_checksummed: bool = True

    def __len__(self) -> int:
        return self.columns.num_rows

    def __getitem__(self, i: int) -> Row:
        if type(i) is not int and not isinstance(i, np.integer):
            raise TypeError(f"row index: expected an integer, got {type(i).__name__}")
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i}: the file has {len(self)} rows")
        return self.columns.row(int(i) % len(self))

    @property
    def tokenizer(self) -> TokenizerIdentity:
        return TokenizerIdentity(**self.metadata["tokenizer"])

    @property
    def row_lengths(self) -> np.ndarray:
        return self.columns.row_lengths

    @property
    def conversation_lengths(self) -> np.ndarray:
        """Padded length of every conversation segment in the file, in row order."""
        cu, off = self.columns.values["packed_cu_seqlens"], self.columns.offsets["packed_cu_seqlens"]
        inside = np.ones(max(len(cu) - 1, 0), dtype=bool)
        inside[off[1:-1] - 1] = False
        return np.diff(cu)[inside]

    @property
    def utilisation(self) -> float:
        """Stored tokens (alignment padding included) over rows * pack_length."""
        slots = len(self) * self.metadata["pack_length"]
        return float(self.row_lengths.sum()) / slots if slots else 0.0

    def batch(self, indices: Sequence[int]):
        """Rows ``indices`` collated into a TensorDict (see :func:`nopad.packing._collate.collate_packed`)."""
        from nopad.packing._collate import collate_packed

        rows = [self[i] for i in indices]
        return collate_packed(rows, pad_token_id=self.metadata["pad_token_id"], alignment=self.metadata["alignment"])


@dataclass
class PackedCheck:
    """What :func:`check_packed` found: the raw metadata (None when unreadable), the opened file
    (None when any problem was found) and every problem, each a sentence naming key or row."""

    path: str
    metadata: dict[str, Any] | None
    packed: PackedFile | None
    problems: list[str] = field(default_factory=list)


# What pyarrow raises for a file that is not (or no longer) valid Parquet; a missing file or a
# permission problem stays an OSError of its own kind.
_UNREADABLE = (ArithmeticError, IndexError, KeyError, LookupError, MemoryError, OSError, TypeError, ValueError)
_NOT_THERE = (FileNotFoundError, IsADirectoryError, PermissionError)


def _unreadable(error: BaseException) -> ValueError:
    return input_error("file", None, "a readable Parquet file", f"{type(error).__name__}: {error}".strip()[:200])


def _refuse_constant(name: str) -> Any:
    raise input_error("metadata", None, "JSON numbers (NaN and Infinity are not JSON)", name)


def _load_metadata(path: str) -> dict[str, Any]:
    """The raw metadata dict (not yet checked); ValueError (without the path) when there is none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except _NOT_THERE:
        raise
    except (pa.ArrowException, *_UNREADABLE) as e:
        raise _unreadable(e) from None
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        key = METADATA_KEY.decode()
        raise input_error("metadata", None, f"nopad packed-file metadata ({key}); write it with nopad pack", "none")
    try:
        meta = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise input_error("metadata", None, "UTF-8 JSON", f"{type(e).__name__}: {e}") from None
    if not isinstance(meta, dict):
        raise input_error("metadata", None, "a JSON object", type(meta).__name__)
    return meta


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The nopad metadata of a Parquet file as stored, without reading its rows or checking its keys."""
    path = os.fspath(path)
    try:
        return _load_metadata(path)
    except ValueError as e:
        raise in_file(path, e) from None


def _read_columns(path: str) -> tuple[Columns | None, list[str]]:
    """The file's columns as int64 (values, offsets), or None and why: unreadable or another schema."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except _NOT_THERE:
        raise
    except (pa.ArrowException, *_UNREADABLE) as e:
        return None, [str(_unreadable(e))]
    if table.column_names != list(ROW_FIELDS):
        return None, [str(input_error("columns", None, f"{list(ROW_FIELDS)}", f"{table.column_names}"))]
    types = {f: table.schema.field(f).type for f in ROW_FIELDS}
    int32_lists = {f: pa.types.is_list(t) and t.value_type == pa.int32() for f, t in types.items()}
    wrong = [
        str(input_error(f"column {f}", None, "list<int32>", str(t))) for f, t in types.items() if not int32_lists[f]
    ]
    if wrong:
        return None, wrong
    values, offsets = {}, {}
    for f in ROW_FIELDS:
        arr = table.column(f).combine_chunks()
        nulls = arr.null_count + arr.values.null_count
        if nulls:
            return None, [str(input_error(f"column {f}", None, "no nulls (rows or values)", f"{nulls}"))]
        base = int(arr.offsets[0].as_py()) if len(arr) else 0
        off = np.asarray(arr.offsets, dtype=np.int64) - base
        offsets[f] = off
        flat = np.asarray(arr.values, dtype=np.int64)
        values[f] = flat[base : base + int(off[-1])] if len(arr) else np.zeros(0, np.int64)
    return Columns(values, offsets), []


def _row_problems(cols: Columns, meta: Mapping[str, Any], vocab_size: int | None) -> list[str]:
    """The first bad row (validate_columns stops there), with the metadata's valid settings only."""
    pack_length = _valid_int(meta, "pack_length", 1) or MAX_TOKEN_ID
    alignment = _valid_int(meta, "alignment", 1) or 1
    top = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
    pad = meta.get("pad_token_id") if _is_int(meta.get("pad_token_id"), 0, top) else None  # else named by its check
    try:
        validate_columns(cols, pack_length=pack_length, alignment=alignment, vocab_size=vocab_size, pad_token_id=pad)
    except ValueError as e:
        return [str(e)]
    negative = negative_id_error(cols)
    return [] if negative is None else [str(negative)]


def _recorded_facts_problems(cols: Columns, meta: Mapping[str, Any]) -> list[str]:
    """num_rows, max_token_id and rows_checksum as recorded against the rows as read."""
    problems = []
    if _is_int(meta.get("num_rows"), 0) and cols.num_rows != meta["num_rows"]:
        problems.append(str(input_error("num_rows", None, f"{meta['num_rows']} as recorded", f"{cols.num_rows}")))
    if "max_token_id" in meta and meta["max_token_id"] != _max_token_id(cols):
        expected = f"{meta['max_token_id']} as recorded"
        problems.append(str(input_error("max_token_id", None, expected, f"{_max_token_id(cols)} in the rows")))
    if cols.checksum() != meta.get("rows_checksum"):
        expected = "the checksum recorded when the file was written"
        problems.append(str(input_error("rows_checksum", None, expected, "rows that differ")))
    return problems


def _stored_identity(meta: Mapping[str, Any]) -> TokenizerIdentity | None:
    tok = meta.get("tokenizer")
    if not isinstance(tok, dict) or _check_tokenizer(meta):
        return None
    return TokenizerIdentity(**tok)


def checked_path(path: Any, field: str = "path") -> str:
    """A file path (a str or an os.PathLike such as pathlib.Path), as a str; else ValueError naming ``field``."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise input_error(
            field, None, "a file path (a str or an os.PathLike such as pathlib.Path)", type(path).__name__
        )
    return os.fspath(path)  # type: ignore[return-value]


def check_packed(path: str | os.PathLike[str], *, tokenizer: TokenizerIdentity | None = None) -> PackedCheck:
    """Every problem with the packed file at ``path``, in order: metadata (each key's type and range,
    then its checksum), the tokenizer (against ``tokenizer``, the run's, when given), the schema,
    the rows (the first bad one), the row count, the largest id and the rows checksum.

    A file that cannot be read at all (not Parquet, no nopad metadata) has that one problem; a
    missing file raises FileNotFoundError.
    """
    path = checked_path(path)
    if tokenizer is not None and not isinstance(tokenizer, TokenizerIdentity):
        expected = "a TokenizerIdentity (e.g. load_tokenizer(...).identity) or None"
        raise input_error("tokenizer", None, expected, type(tokenizer).__name__)
    try:
        meta = _load_metadata(path)
    except ValueError as e:
        return PackedCheck(path, None, None, [str(e)])
    problems = metadata_problems(meta)
    version = meta.get("format_version")
    if not (type(version) is int and version in READABLE_VERSIONS):
        return PackedCheck(path, meta, None, problems)  # an unknown format: its rows mean nothing yet
    if version >= 2:
        stored_sum = meta.get("metadata_checksum")
        if isinstance(stored_sum, str) and _SHA256.fullmatch(stored_sum) and stored_sum != metadata_checksum(meta):
            expected = "the checksum of the metadata as written"
            problems.append(str(input_error("metadata_checksum", None, expected, "metadata edited since")))
    stored = _stored_identity(meta)
    if stored is not None and tokenizer is not None and (why := stored.mismatch(tokenizer)):
        problems.append(f"refusing a file from another tokenizer: {why}")
    cols, schema_problems = _read_columns(path)
    problems += schema_problems
    if cols is None:
        return PackedCheck(path, meta, None, problems)
    vocab = stored.vocab_size if stored is not None else None
    if vocab is None and tokenizer is not None:
        vocab = tokenizer.vocab_size  # a pre-tokenized file: its ids must fit the run's vocabulary
    problems += _row_problems(cols, meta, vocab)
    problems += _recorded_facts_problems(cols, meta)
    packed = None if problems else PackedFile(path, meta, cols, metadata_checksummed=version >= 2)
    return PackedCheck(path, meta, packed, problems)


def _joined(problems: Sequence[str]) -> str:
    """The first problem, then any others, one a line."""
    first, rest = problems[0], problems[1:]
    return first + (f"\n  and {len(rest)} more:" + "".join(f"\n  - {p}" for p in rest) if rest else "")


def read_packed(path: str | os.PathLike[str], *, tokenizer: TokenizerIdentity | None = None) -> PackedFile:
    """Open ``path`` and validate everything (see :func:`check_packed`); ValueError prefixed with the
    path, naming the first problem and listing any others.

    ``tokenizer`` is the run's tokenizer identity: a file packed with any other is refused.
    """
    check = check_packed(path, tokenizer=tokenizer)
    if check.packed is None:
        raise in_file(check.path, _joined(check.problems))
    return check.packed
