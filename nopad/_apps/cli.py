"""`nopad demo | bench | pack | inspect | env`.

Each subcommand's module adds its own arguments (``add_arguments(parser)``) and runs with
``run(args) -> int``; modules are imported only when their subcommand is used.

Bad input never ends in a traceback: arguments are checked here after parsing (every integer
option is a count >= 1 unless listed in ``INT_MINIMUM``; ``--device`` must name a device this
machine has), and a ValueError or OSError from a subcommand is printed as one line
``nopad <command>: error: ...`` with exit status 2.

Every option's ``--help`` shows its default (:func:`show_defaults`); long work shows its progress on
stderr when that is a terminal (``nopad._apps.progress``; ``--quiet`` turns it off).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = {
    "demo": ("nopad._apps.demo", "run a tiny causal LM on a synthetic RL batch, padded vs packed"),
    "bench": ("nopad._apps.bench", "benchmark the conversions against a per-row loop and a bare gather"),
    "pack": ("nopad._apps.pack", "pack a JSONL of conversations into a Parquet file of rows"),
    "inspect": ("nopad._apps.inspect_file", "validate and summarise a packed Parquet file"),
    "env": ("nopad._apps.env", "versions, usable kernels and the model families served packed, for a bug report"),
}
# Integer options that may be 0 (every other integer option is a count, size or length: >= 1).
INT_MINIMUM = {"seed": 0, "pad_token_id": 0}
# Options naming a file to write: its folder must exist before any work (a benchmark takes minutes).
OUTPUT_OPTIONS = ("output", "plot")
BAD_INPUT = (ValueError, OSError, ImportError)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's help ends with its default, ``(default: 8 256 1024)``, unless the help states it
    already (the word "default" in it: a default that depends on the device or the data) or the
    option is required. A flag (``--json``, ``--quiet``) is off unless given and says nothing more."""
    for action in parser._actions:
        help_text = action.help or ""
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction))
        stated = "default" in help_text or action.default is argparse.SUPPRESS or action.required
        if flag or not action.option_strings or stated:
            continue
        action.help = f"{help_text} (default: {default_text(action.default)})".lstrip()


def default_text(value: object) -> str:
    """A default as a user would type it: a list as its items, None as "none"; %% escaped for argparse."""
    if value is None:
        text = "none"
    elif isinstance(value, (list, tuple)):
        text = " ".join(str(v) for v in value)
    else:
        text = str(value)
    return text.replace("%", "%%")


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def int_problems(args: argparse.Namespace) -> list[str]:
    """A sentence for every integer option (or list of them) below its minimum."""
    problems = []
    for dest, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        low = INT_MINIMUM.get(dest, 1)
        bad = [v for v in values if type(v) is int and v < low]
        if bad:
            problems.append(f"{_option(dest)}: expected an integer >= {low}, got {bad[0]}")
    return problems


def output_problems(args: argparse.Namespace) -> list[str]:
    """A sentence for every output file whose folder does not exist."""
    import os

    problems = []
    for dest in OUTPUT_OPTIONS:
        path = getattr(args, dest, None)
        folder = os.path.dirname(os.path.abspath(path)) if isinstance(path, str) else None
        if folder is not None and not os.path.isdir(folder):
            problems.append(f"{_option(dest)}: expected a file in an existing folder, got {path!r}")
        elif isinstance(path, str) and os.path.isdir(path):
            problems.append(f"{_option(dest)}: expected a file to write, got the folder {path!r}")
    return problems


def device_problem(device: str) -> str | None:
    """Why ``device`` cannot be used here (not a device name, or not on this machine), or None."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        return f"--device: expected a torch device such as cpu or cuda:0, got {device!r} ({e})"
    if dev.type == "cpu":
        return None
    backend = getattr(torch, dev.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        return f"--device: expected a device this machine has, got {device!r} ({dev.type} is not available)"
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if dev.index is not None and dev.index >= count:
        return f"--device: expected an index below {count} ({dev.type} devices here), got {device!r}"
    return None


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    problems = int_problems(args) + output_problems(args)
    if isinstance(getattr(args, "device", None), str) and (why := device_problem(args.device)):
        problems.append(why)
    if problems:
        parser.error("; ".join(problems))  # usage and the message on stderr, exit 2


def build_parser(name: str | None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``nopad`` parser and its subcommands' parsers; only subcommand ``name`` gets its arguments
    (its module is the only one imported)."""
    parser = argparse.ArgumentParser(prog="nopad", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    subparsers = {}
    for cmd, (module, help_text) in SUBCOMMANDS.items():
        subparsers[cmd] = p = sub.add_parser(cmd, help=help_text)
        if cmd == name:  # import only the module that will run
            importlib.import_module(module).add_arguments(p)
            show_defaults(p)
    return parser, subparsers


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subparsers = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    _check_args(subparsers[args.command], args)
    try:
        return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)
    except BAD_INPUT as e:
        print(f"nopad {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
