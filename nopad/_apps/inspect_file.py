"""`nopad inspect OUT.parquet`: metadata, validation result, rows, utilisation, a length histogram."""

from __future__ import annotations

import argparse
import json

import numpy as np

from nopad.packing._files import check_packed, read_metadata
from nopad.packing._tokenizer import load_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a packed Parquet file written by `nopad pack`")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="also require this tokenizer: a local HF directory, or 'bytes' for the built-in one (default: "
        "none required, the file is checked against the tokenizer it records)",
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


def _expected_tokenizer(name: str | None):
    if name is None:
        return None
    return load_tokenizer(None if name == "bytes" else name).identity


def run(args: argparse.Namespace) -> int:
    """Exit 0 for a valid file, 1 when validation finds problems (each is printed), 2 when the file
    or the --tokenizer cannot be read at all (the command line prints their ValueError or OSError)."""
    expected = _expected_tokenizer(args.tokenizer)
    meta = read_metadata(args.path)
    print(f"file: {args.path}")
    print("metadata:")
    print("  " + json.dumps(meta, indent=2, sort_keys=True).replace("\n", "\n  "))
    check = check_packed(args.path, tokenizer=expected)
    if check.packed is None:
        print(f"validation: FAILED ({len(check.problems)} problem{'s' * (len(check.problems) != 1)})")
        for problem in check.problems:
            print(f"  - {problem}")
        return 1
    packed = check.packed
    conv = packed.conversation_lengths
    print("validation: OK (metadata keys; every row: boundaries, alignment, positions, labels, masks, ids; checksums)")
    if not packed.metadata_checksummed:
        version = packed.metadata["format_version"]
        print(f"note: a format {version} file: its metadata is checked key by key but no checksum covers it; repack")
    print(f"rows: {len(packed)}")
    print(f"conversations (segments): {conv.size}")
    print(f"utilisation: {packed.utilisation:.4f} (stored tokens / rows x pack_length {meta['pack_length']})")
    real = meta["report"].get("utilisation")
    if isinstance(real, (int, float)):
        print(f"utilisation without alignment padding: {real:.4f}")
    print("row length histogram:")
    print("\n".join(histogram(packed.row_lengths, args.bins)))
    print("conversation length histogram (padded):")
    print("\n".join(histogram(conv, args.bins)))
    return 0
