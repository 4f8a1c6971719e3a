"""`nopad pack INPUT.jsonl -o OUT.parquet --pack-length N`: tokenize, pack and write a packed file."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

from nopad.packing.algorithms import ALGORITHMS
from nopad.packing.files import write_packed
from nopad.packing.offline import OVERFLOW_POLICIES, pack_conversations
from nopad.packing.rows import thd_alignment
from nopad.packing.tokenizer import Tokenizer, encode_record, load_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="JSONL: {input_ids[, loss_mask]} or {text} or {messages} per line")
    parser.add_argument("-o", "--output", required=True, help="the Parquet file to write")
    parser.add_argument("--pack-length", type=int, required=True, help="tokens per row at most")
    parser.add_argument("--tokenizer", default=None, help="a LOCAL Hugging Face tokenizer directory (default: bytes)")
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
        default="concatenative",
        help="how conversations are grouped into rows (concatenative keeps the input order)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _records(path: str, tokenizer: Tokenizer) -> Iterator[tuple[list[int], list[int]]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {line_no}: expected a JSON object, got invalid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path} line {line_no}: expected a JSON object, got {type(record).__name__}")
            yield encode_record(record, tokenizer, line=line_no)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    try:
        tokenizer = load_tokenizer(args.tokenizer)
        alignment = thd_alignment(args.tp_size, args.cp_size)
        records = tqdm(_records(args.input, tokenizer), desc="packing", unit=" conv", disable=args.no_progress)
        rows, report = pack_conversations(
            records,
            args.pack_length,
            alignment=alignment,
            pad_token_id=tokenizer.pad_token_id,
            overflow=args.overflow,
            algorithm=args.algorithm,
        )
        summary = report.summary()
        write_packed(
            args.output,
            rows,
            pack_length=args.pack_length,
            tokenizer=tokenizer.identity,
            pad_token_id=tokenizer.pad_token_id,
            alignment=alignment,
            tp_size=args.tp_size,
            cp_size=args.cp_size,
            report={
                **summary,
                "split_indices": report.split[:1000],
                "rejected_indices": report.rejected_too_long[:1000],
                "empty_indices": report.rejected_empty[:1000],
            },
        )
    except (ValueError, OSError) as e:
        print(f"nopad pack: error: {e}", file=sys.stderr)
        return 2
    name = tokenizer.identity.name
    print(f"wrote {args.output}: {report.rows} rows of <= {args.pack_length} tokens, tokenizer {name}")
    for key, value in summary.items():
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
