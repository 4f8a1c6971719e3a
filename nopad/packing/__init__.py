"""Sequence packing: bin packing, online packing at step time, offline packed files, collate, THD.

Rows pack several conversations each (boundaries per row, ``packed_cu_seqlens`` padded with -1);
online packing decides rows at step time from a nested batch, offline packing writes validated
Parquet files of rows ahead of time and replays them exactly. Both meet at :func:`packed_to_thd`.
"""

from nopad.packing._algorithms import ALGORITHMS, pack_lengths, packing_metrics
from nopad.packing._collate import collate_packed, packed_to_nested
from nopad.packing._files import check_packed, read_packed, write_packed
from nopad.packing._offline import pack_conversations
from nopad.packing._online import pack_online
from nopad.packing._thd import packed_to_thd
from nopad.packing._tokenizer import ByteTokenizer, PreTokenized, TokenizerIdentity, encode_record, load_tokenizer
from nopad.parallel import cp_alignment

__all__ = [
    "ALGORITHMS",
    "ByteTokenizer",
    "PreTokenized",
    "TokenizerIdentity",
    "check_packed",
    "collate_packed",
    "cp_alignment",
    "encode_record",
    "load_tokenizer",
    "pack_conversations",
    "pack_lengths",
    "pack_online",
    "packed_to_nested",
    "packed_to_thd",
    "packing_metrics",
    "read_packed",
    "write_packed",
]
