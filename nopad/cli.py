"""`nopad demo | bench | pack | inspect`.

Each subcommand's module adds its own arguments (``add_arguments(parser)``) and runs with
``run(args) -> int``; modules are imported only when their subcommand is used.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "demo": ("nopad.demo", "run a tiny causal LM on a synthetic RL batch, padded vs packed"),
    "bench": ("nopad.bench", "benchmark the conversions against a per-row loop and a bare gather"),
    "pack": ("nopad.packing.cli_pack", "pack a JSONL of conversations into a Parquet file of rows"),
    "inspect": ("nopad.packing.cli_inspect", "validate and summarise a packed Parquet file"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="nopad", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    name = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for cmd, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(cmd, help=help_text)
        if cmd == name:  # import only the module that will run
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
