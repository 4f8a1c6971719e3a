"""`nopad pack INPUT.jsonl -o OUT.parquet --pack-length N`: tokenize, pack and write a packed file.

The tokenizer, and so the identity the file records:
  --tokenizer DIR | bytes            a local Hugging Face tokenizer, or the built-in byte one
  --vocab-size N / --tokenizer-name  pre-tokenized data (input_ids records only): no tokenizer files,
                                     ids must be below N; the file records the name and size given
  (none)                             text/messages records use the byte tokenizer (input_ids next to
                                     them must be byte ids); a file of input_ids records only is
                                     recorded as "pre-tokenized", with its largest id
Every record is read and checked before anything is packed: a bad one stops the run with the file,
the line and what to fix, and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import numpy as np

from nopad._apps.progress import Progress, add_quiet_argument
from nopad.core._errors import in_file, input_error
from nopad.packing._algorithms import ALGORITHMS
from nopad.packing._files import write_packed
from nopad.packing._offline import OVERFLOW_POLICIES, PackReport, pack_conversations
from nopad.packing._tokenizer import (
    MAX_TOKEN_ID,
    PRE_TOKENIZED,
    ByteTokenizer,
    HFTokenizer,
    PreTokenized,
    Tokenizer,
    check_count,
    encode_record,
    record_kind,
)
from nopad.parallel._cp import cp_alignment

Conversation = tuple[np.ndarray, np.ndarray]  # (ids int64, loss mask int8)
# The fewest rows of the algorithms measured on the same conversations (docs/results.md: 20,000
# chat-sized conversations into 8192-token rows, 1,605 rows against concatenative's 1,781).
DEFAULT_ALGORITHM = "best_fit_decreasing"
_UTF8_BOM = b"\xef\xbb\xbf"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="JSONL: {input_ids[, loss_mask]} or {text} or {messages} per line")
    parser.add_argument("-o", "--output", required=True, help="the Parquet file to write")
    parser.add_argument("--pack-length", type=int, required=True, help="tokens per row at most")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a LOCAL Hugging Face tokenizer directory, or 'bytes' (default: text and messages records use the "
        "byte tokenizer; a file of input_ids records only is recorded as pre-tokenized, with its largest id)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="pre-tokenized data: ids must be below this, no tokenizer files needed (default: unknown, the file "
        "records its largest id)",
    )
    parser.add_argument(
        "--tokenizer-name",
        default=None,
        help=f"pre-tokenized data: the tokenizer's name, recorded in the file (default: {PRE_TOKENIZED!r})",
    )
    parser.add_argument(
        "--pad-token-id", type=int, default=None, help="the id of alignment padding (default: the tokenizer's, or 0)"
    )
    parser.add_argument("--cp-size", type=int, default=1, help="context-parallel size: pad to 2*cp*tp")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (sequence parallelism)")
    parser.add_argument(
        "--overflow",
        choices=OVERFLOW_POLICIES,
        default="split",
        help="a conversation longer than the pack: split it into pieces, or reject it (counted)",
    )
    parser.add_argument(
        "--algorithm",
        choices=sorted(ALGORITHMS),
        default=DEFAULT_ALGORITHM,
        help="how conversations are grouped into rows (default: %(default)s, the fewest rows; its rows come "
        "longest first, so shuffle them when you train; concatenative keeps the input order, with 10-25%% more rows)",
    )
    add_quiet_argument(parser, "--no-progress")


# ---- JSONL: one object per line, nothing skipped or coerced -------------------------------------
def _refuse_constant(name: str) -> Any:
    raise input_error("number", None, "a JSON number (NaN and Infinity are not JSON)", name)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict; a repeated key (json would keep the last one silently) is refused."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise input_error("key", None, "each key once per object", f"{key!r} twice")
        seen[key] = value
    return seen


def parse_line(raw: bytes, line: int) -> dict[str, Any]:
    """One JSONL line -> its object; ValueError "record line N: ..." for anything else."""
    where = f"record line {line}"
    if line == 1 and raw.startswith(_UTF8_BOM):
        raw = raw[len(_UTF8_BOM) :]  # an editor's byte-order mark carries no data
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise input_error(where, None, "UTF-8 text", f"the byte 0x{raw[e.start]:02x} at column {e.start + 1}") from None
    if not text.strip():
        raise input_error(where, None, "a JSON object (JSONL has one per line: delete the blank line)", "a blank line")
    try:
        record = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise input_error(where, None, "a JSON object", f"invalid JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:  # a repeated key or NaN, from the hooks above
        raise in_file(where, e) from None
    if not isinstance(record, dict):
        raise input_error(where, None, "a JSON object", type(record).__name__)
    return record


def read_jsonl(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every line of ``path``; refuses blank lines, bad UTF-8 and bad JSON."""
    with open(path, "rb") as f:  # bytes: a bad UTF-8 byte is reported with its line, not for the whole file
        for line, raw in enumerate(f, 1):
            yield line, parse_line(raw, line)


# ---- tokenizer and records -------------------------------------------------------------------------
def chosen_tokenizer(args: argparse.Namespace) -> Tokenizer | None:
    """The tokenizer the flags name; None when none does (decided by the records: see the module doc)."""
    pre_tokenized = args.vocab_size is not None or args.tokenizer_name is not None
    if args.tokenizer is not None and pre_tokenized:
        given = "--vocab-size" if args.vocab_size is not None else "--tokenizer-name"
        expected = "--tokenizer, or --vocab-size/--tokenizer-name for pre-tokenized data, not both"
        raise input_error(given, None, expected, "both")
    if args.tokenizer is not None:
        return ByteTokenizer() if args.tokenizer == "bytes" else HFTokenizer(args.tokenizer)
    if pre_tokenized:
        name = PRE_TOKENIZED if args.tokenizer_name is None else args.tokenizer_name  # '' is refused, not replaced
        return PreTokenized(args.vocab_size, name)
    return None


def _with_pad(tokenizer: Tokenizer, pad_token_id: int | None) -> Tokenizer:
    """``tokenizer`` with --pad-token-id (when given) as its pad id, checked against its vocabulary."""
    if pad_token_id is not None:
        size = tokenizer.identity.vocab_size
        check_count("--pad-token-id", pad_token_id, 0, MAX_TOKEN_ID if size is None else size - 1)
        tokenizer.pad_token_id = pad_token_id
    return tokenizer


def _as_arrays(ids: list[int], mask: list[int]) -> Conversation:
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int8)


def encode_records(records: Iterable[tuple[int, dict[str, Any]]], tokenizer: Tokenizer) -> Iterator[Conversation]:
    for line, record in records:
        yield _as_arrays(*encode_record(record, tokenizer, line=line))


class AutoRecords:
    """No tokenizer flag: text/messages records use the byte tokenizer; input_ids records are taken
    as they are (below 2**31) and must be byte ids only when the file also holds text.

    After iterating, ``tokenizer`` is the byte tokenizer if any record held text, else a
    :class:`PreTokenized` of unknown vocabulary (the file records its largest id).
    """

    def __init__(self, records: Iterable[tuple[int, dict[str, Any]]]):
        self.records = records
        self.bytes, self.raw = ByteTokenizer(), PreTokenized()
        self.byte_vocab = self.bytes.eos_token_id + 1  # ids 0..255, <pad>, <eos>
        self.first_text: int | None = None  # line of the first text/messages record
        self.first_wide: tuple[int, int] | None = None  # (line, id) of the first id bytes do not have

    def __iter__(self) -> Iterator[Conversation]:
        for line, record in self.records:
            is_ids = record_kind(record, f"record line {line}") == "input_ids"
            ids, mask = encode_record(record, self.raw if is_ids else self.bytes, line=line)
            if is_ids and self.first_wide is None and ids and max(ids) >= self.byte_vocab:
                self.first_wide = (line, max(ids))
            if not is_ids and self.first_text is None:
                self.first_text = line
            self._check_mix()
            yield _as_arrays(ids, mask)

    def _check_mix(self) -> None:
        if self.first_text is None or self.first_wide is None:
            return
        line, wide = self.first_wide
        expected = (
            f"input_ids in [0, {self.byte_vocab}) for nopad-byte-v1, the tokenizer of the text"
            f" on line {self.first_text} (give --tokenizer DIR for the tokenizer of both, or pack them separately)"
        )
        raise input_error(f"record line {line}", None, expected, f"{wide}")

    @property
    def tokenizer(self) -> Tokenizer:
        return self.bytes if self.first_text is not None else self.raw


def _counted(conversations: Iterable[Conversation], progress: Progress, path: str) -> Iterator[Conversation]:
    for n, conversation in enumerate(conversations, 1):
        progress.note(f"reading {path}: {n:,} conversations")
        yield conversation


def read_conversations(
    args: argparse.Namespace, progress: Progress | None = None
) -> tuple[list[Conversation], Tokenizer]:
    """Every record of the input, checked and encoded, and the tokenizer that applies to them."""
    chosen = chosen_tokenizer(args)
    if chosen is not None:
        _with_pad(chosen, args.pad_token_id)  # before reading: a bad pad id fails at once
    records = read_jsonl(args.input)
    auto = AutoRecords(records)
    encoded = auto if chosen is None else encode_records(records, chosen)
    try:
        conversations = list(encoded if progress is None else _counted(encoded, progress, args.input))
    except ValueError as e:
        raise in_file(args.input, e) from None
    if not conversations:
        raise in_file(args.input, input_error("records", None, "at least one JSON record", "an empty file"))
    return conversations, chosen if chosen is not None else _with_pad(auto.tokenizer, args.pad_token_id)


def _check_paths(args: argparse.Namespace) -> None:
    if os.path.exists(args.output) and os.path.exists(args.input) and os.path.samefile(args.output, args.input):
        raise input_error("--output", None, "a path other than the input (it would be overwritten)", args.output)


def _no_rows(report: PackReport) -> ValueError:
    why = f"{len(report.rejected_too_long)} too long, {len(report.rejected_empty)} empty"
    fix = "; raise --pack-length or use --overflow split" if report.rejected_too_long else ""
    return input_error("rows", None, f"at least one row to write{fix}", f"every conversation rejected ({why})")


def pack(args: argparse.Namespace) -> tuple[PackReport, dict[str, Any]]:
    """Read, pack and write; returns the report and the metadata written."""
    _check_paths(args)
    check_count("--pack-length", args.pack_length, 1, MAX_TOKEN_ID)  # the file's limit, before any reading
    alignment = cp_alignment(args.tp_size, args.cp_size)
    with Progress("nopad pack", 3, quiet=getattr(args, "quiet", False)) as progress:
        with progress.step(f"reading {args.input}"):
            conversations, tokenizer = read_conversations(args, progress)
        with progress.step(f"packing {len(conversations):,} conversations ({args.algorithm})"):
            rows, report = pack_conversations(
                cast("list[tuple[Sequence[int], Sequence[int]]]", conversations),  # arrays slice like sequences
                args.pack_length,
                alignment=alignment,
                pad_token_id=tokenizer.pad_token_id,
                overflow=args.overflow,
                algorithm=args.algorithm,
            )
        if not rows:
            raise _no_rows(report)
        with progress.step(f"writing {len(rows):,} rows to {args.output}"):
            return report, _write(args, rows, report, tokenizer, alignment)


def _write(args: argparse.Namespace, rows: list, report: PackReport, tokenizer: Tokenizer, alignment: int):
    return write_packed(
        args.output,
        rows,
        pack_length=args.pack_length,
        tokenizer=tokenizer.identity,
        pad_token_id=tokenizer.pad_token_id,
        alignment=alignment,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
        report={
            **report.summary(),
            "split_indices": report.split[:1000],
            "rejected_indices": report.rejected_too_long[:1000],
            "empty_indices": report.rejected_empty[:1000],
        },
    )


def _describe(meta: dict[str, Any]) -> str:
    """'tokenizer NAME', and what is known of a vocabulary nopad never saw (pre-tokenized data)."""
    tok = meta["tokenizer"]
    if tok["vocab_hash"]:
        return f"tokenizer {tok['name']}"
    size = "size unknown" if tok["vocab_size"] is None else f"size {tok['vocab_size']}"
    return f"tokenizer {tok['name']} (vocabulary {size}, largest id {meta['max_token_id']})"


def run(args: argparse.Namespace) -> int:
    report, meta = pack(args)  # a ValueError or OSError: the command line prints it, exit status 2
    print(f"wrote {args.output}: {report.rows} rows of <= {args.pack_length} tokens, {_describe(meta)}")
    for key, value in report.summary().items():
        print(f"  {key:>18}: {value}")
    for what, indices in (
        ("split", report.split),
        ("rejected as too long", report.rejected_too_long),
        ("rejected as empty", report.rejected_empty),
    ):
        if indices:
            more = " ..." if len(indices) > 20 else ""
            print(f"  {what} (conversation numbers, 0-based input order): {indices[:20]}{more}")
    return 0
