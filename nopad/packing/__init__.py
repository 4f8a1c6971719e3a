"""Sequence packing: bin packing, online packing at step time, offline packed files, collate, THD."""

from nopad.packing.algorithms import (
    ALGORITHMS,
    PackingMetrics,
    best_fit_decreasing,
    concatenative,
    first_fit_decreasing,
    first_fit_shuffle,
    modified_first_fit_decreasing,
    pack_lengths,
    packing_metrics,
)
from nopad.packing.collate import collate_packed, packed_to_nested
from nopad.packing.files import PackedCheck, PackedFile, check_packed, read_metadata, read_packed, write_packed
from nopad.packing.offline import PackReport, pack_conversations
from nopad.packing.online import pack_online
from nopad.packing.rows import ROW_FIELDS, Columns, validate_columns
from nopad.packing.thd import ThdBatch, packed_to_thd
from nopad.packing.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    PreTokenized,
    TokenizerIdentity,
    encode_record,
    load_tokenizer,
)
from nopad.parallel.cp import cp_alignment

__all__ = [
    "ALGORITHMS",
    "ROW_FIELDS",
    "ByteTokenizer",
    "Columns",
    "HFTokenizer",
    "PackReport",
    "PackedCheck",
    "PackedFile",
    "PackingMetrics",
    "PreTokenized",
    "ThdBatch",
    "TokenizerIdentity",
    "best_fit_decreasing",
    "check_packed",
    "collate_packed",
    "concatenative",
    "cp_alignment",
    "encode_record",
    "first_fit_decreasing",
    "first_fit_shuffle",
    "load_tokenizer",
    "modified_first_fit_decreasing",
    "pack_conversations",
    "pack_lengths",
    "pack_online",
    "packed_to_nested",
    "packed_to_thd",
    "packing_metrics",
    "read_metadata",
    "read_packed",
    "validate_columns",
    "write_packed",
]
