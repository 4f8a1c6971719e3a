"""Packed Parquet files: token-id rows plus metadata that lets a reader refuse a bad file up front.

Columns are the row fields of rows.py as ``list<int32>``. The schema metadata key ``nopad.packed``
holds JSON: format_version, pack_length, alignment, tp_size, cp_size, pad_token_id, the tokenizer
identity (name, vocab_hash, vocab_size), num_rows, rows_checksum (sha256 of every column) and the
pack report. :func:`read_packed` checks all of it, and every row, when the file is opened: a
tampered or foreign file fails there, on the CPU, before any model is loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nopad.packing.rows import ROW_FIELDS, Columns, Row, validate_columns
from nopad.packing.tokenizer import TokenizerIdentity

FORMAT_VERSION = 1
METADATA_KEY = b"nopad.packed"


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
    """Validate ``rows`` and write them to ``path``; returns the metadata written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = Columns.from_rows(rows)
    validate_columns(cols, pack_length=pack_length, alignment=alignment, vocab_size=tokenizer.vocab_size)
    meta = {
        "format_version": FORMAT_VERSION,
        "pack_length": pack_length,
        "alignment": alignment,
        "tp_size": tp_size,
        "cp_size": cp_size,
        "pad_token_id": pad_token_id,
        "tokenizer": {"name": tokenizer.name, "vocab_hash": tokenizer.vocab_hash, "vocab_size": tokenizer.vocab_size},
        "num_rows": cols.num_rows,
        "rows_checksum": cols.checksum(),
        "report": report or {},
    }
    arrays = [
        pa.ListArray.from_arrays(pa.array(cols.offsets[f].astype(np.int32)), pa.array(cols.values[f].astype(np.int32)))
        for f in ROW_FIELDS
    ]
    table = pa.Table.from_arrays(arrays, names=list(ROW_FIELDS))
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()})
    pq.write_table(table, path)
    return meta


@dataclass
class PackedFile:
    """An opened, fully validated packed file. ``rows[i]`` is a dict of int64 arrays."""

    path: str
    metadata: dict[str, Any]
    columns: Columns

    def __len__(self) -> int:
        return self.columns.num_rows

    def __getitem__(self, i: int) -> Row:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i}: the file has {len(self)} rows")
        return self.columns.row(i % len(self))

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
        """Rows ``indices`` collated into a TensorDict (see :func:`nopad.packing.collate.collate_packed`)."""
        from nopad.packing.collate import collate_packed

        rows = [self[i] for i in indices]
        return collate_packed(rows, pad_token_id=self.metadata["pad_token_id"], alignment=self.metadata["alignment"])


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The nopad metadata of a Parquet file, without reading its rows."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        key = METADATA_KEY.decode()
        raise ValueError(f"{os.fspath(path)}: expected nopad packed-file metadata ({key}), found none")
    return json.loads(raw)


def read_packed(path: str | os.PathLike[str], *, tokenizer: TokenizerIdentity | None = None) -> PackedFile:
    """Open ``path`` and validate everything; ValueError naming the mismatch or the bad row.

    ``tokenizer`` is the run's tokenizer identity: a file packed with any other is refused.
    Order of checks: metadata, tokenizer, schema, every row (boundaries, alignment, positions,
    labels, masks, id range), row count, checksum.
    """
    import pyarrow.parquet as pq

    path = os.fspath(path)
    meta = read_metadata(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version: expected {FORMAT_VERSION}, got {meta.get('format_version')!r}")
    stored = TokenizerIdentity(**meta["tokenizer"])
    if tokenizer is not None and (why := stored.mismatch(tokenizer)):
        raise ValueError(f"{path}: refusing a file from another tokenizer: {why}")
    table = pq.read_table(path)
    if table.column_names != list(ROW_FIELDS):
        raise ValueError(f"{path}: columns: expected {list(ROW_FIELDS)}, got {table.column_names}")
    values, offsets = {}, {}
    for f in ROW_FIELDS:
        arr = table.column(f).combine_chunks()
        if arr.null_count:
            raise ValueError(f"{path}: {f}: expected no null rows, got {arr.null_count}")
        base = int(arr.offsets[0].as_py()) if len(arr) else 0
        off = np.asarray(arr.offsets, dtype=np.int64) - base
        offsets[f] = off
        flat = np.asarray(arr.values, dtype=np.int64)
        values[f] = flat[base : base + int(off[-1])] if len(arr) else np.zeros(0, np.int64)
    cols = Columns(values, offsets)
    try:
        validate_columns(
            cols, pack_length=meta["pack_length"], alignment=meta["alignment"], vocab_size=stored.vocab_size
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if cols.num_rows != meta["num_rows"]:
        raise ValueError(f"{path}: num_rows: expected {meta['num_rows']} as recorded, got {cols.num_rows}")
    if cols.checksum() != meta["rows_checksum"]:
        raise ValueError(f"{path}: rows_checksum: the rows differ from the checksum recorded when it was written")
    return PackedFile(path, meta, cols)
