"""`nopad inspect OUT.parquet`: metadata, validation result, rows, utilisation, a length histogram."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from nopad.packing.files import read_metadata, read_packed
from nopad.packing.tokenizer import load_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a packed Parquet file written by `nopad pack`")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="also require this tokenizer: a local HF directory, or 'bytes' for the built-in one",
    )
    parser.add_argument("--bins", type=int, default=10, help="histogram bins")


def histogram(lengths: np.ndarray, bins: int = 10, width: int = 40) -> list[str]:
    """Text histogram lines: '[lo, hi) count ####'."""
    if lengths.size == 0:
        return ["(no conversations)"]
    counts, edges = np.histogram(lengths, bins=max(1, min(bins, int(lengths.max() - lengths.min()) + 1)))
    top = max(int(counts.max()), 1)
    closing = [")"] * (len(counts) - 1) + ["]"]  # numpy's last bin includes its right edge
    return [
        f"  [{lo:>9.1f}, {hi:>9.1f}{end} {int(c):>8} {'#' * round(width * int(c) / top)}"
        for lo, hi, c, end in zip(edges[:-1], edges[1:], counts, closing)
    ]


def run(args: argparse.Namespace) -> int:
    try:
        meta = read_metadata(args.path)
    except (ValueError, OSError) as e:
        print(f"nopad inspect: error: {e}", file=sys.stderr)
        return 2
    print(f"file: {args.path}")
    print("metadata:")
    print("  " + json.dumps(meta, indent=2, sort_keys=True).replace("\n", "\n  "))
    try:
        expected = None
        if args.tokenizer is not None:
            expected = load_tokenizer(None if args.tokenizer == "bytes" else args.tokenizer).identity
        packed = read_packed(args.path, tokenizer=expected)
    except (ValueError, OSError) as e:
        print(f"validation: FAILED: {e}")
        return 1
    conv = packed.conversation_lengths
    print("validation: OK (every row: boundaries, alignment, positions, labels, masks, ids; checksum)")
    print(f"rows: {len(packed)}")
    print(f"conversations (segments): {conv.size}")
    print(f"utilisation: {packed.utilisation:.4f} (stored tokens / rows x pack_length {meta['pack_length']})")
    real = meta.get("report", {}).get("utilisation")
    if real is not None:
        print(f"utilisation without alignment padding: {real:.4f}")
    print("row length histogram:")
    print("\n".join(histogram(packed.row_lengths, args.bins)))
    print("conversation length histogram (padded):")
    print("\n".join(histogram(conv, args.bins)))
    return 0
