"""The command line tells what it will do and shows that it is doing it: every option's ``--help``
names its default, and long work prints its progress on stderr while it runs (on a terminal: the
test gives the command a pseudo-terminal), none under ``--quiet`` and none when stderr is not a
terminal (a CI log)."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from nopad._apps.cli import SUBCOMMANDS, build_parser, default_text, main

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("_StoreTrueAction", "_StoreFalseAction", "_HelpAction")


def _entries(help_text: str) -> dict[str, str]:
    """Each option's entry of a --help text, keyed by its first option string, whitespace joined."""
    entries: dict[str, str] = {}
    key = None
    for line in help_text.splitlines():
        match = re.match(r"^  (-[-\w]+)", line)
        if match:
            key = match.group(1)
            entries[key] = line.strip()
        elif key is not None and line.startswith("    "):
            entries[key] += " " + line.strip()
        else:
            key = None
    return entries


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_option_of_every_subcommand_shows_its_default_in_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    entries = _entries(capsys.readouterr().out)
    _, subparsers = build_parser(command)
    checked = 0
    for action in subparsers[command]._actions:
        if not action.option_strings or type(action).__name__ in FLAGS or action.required:
            continue
        entry = entries[action.option_strings[0]]
        assert "default" in entry, f"nopad {command} {action.option_strings[0]}: no default in --help: {entry!r}"
        if action.default is not None and f"default: {default_text(action.default)}" not in entry.replace("%%", "%"):
            # a default stated in the help's own words must still name the value
            assert str(action.default) in entry, f"nopad {command} {action.option_strings[0]}: {entry!r}"
        checked += 1
    assert checked >= 2


def test_pack_defaults_to_the_algorithm_that_makes_the_fewest_rows_and_says_why(capsys):
    from nopad._apps.bench_packing import synthetic_conversations
    from nopad.packing import ALGORITHMS, pack_conversations

    _, subparsers = build_parser("pack")
    default = subparsers["pack"].get_default("algorithm")
    convs = synthetic_conversations(600, 2048, seed=2)
    rows = {name: len(pack_conversations(convs, 2048, algorithm=name)[0]) for name in ALGORITHMS}
    assert rows[default] == min(rows.values()) and rows["concatenative"] > rows[default]
    with pytest.raises(SystemExit):
        main(["pack", "--help"])
    entry = _entries(capsys.readouterr().out)["--algorithm"]
    assert f"default: {default}, the fewest rows" in entry and "longest first" in entry


def _run_on_a_terminal(argv: list[str], timeout: float = 240) -> tuple[list[tuple[float, bool, bytes]], bytes, int]:
    """Run ``nopad argv`` with stderr on a pseudo-terminal and stdout on a pipe. Returns what stderr
    showed, as (time, still running, bytes) chunks, then stdout and the exit status."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal 160 wide
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "COLUMNS": "120"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nopad", *argv], stdout=subprocess.PIPE, stderr=follower, cwd=ROOT, env=env
    )
    os.close(follower)
    chunks: list[tuple[float, bool, bytes]] = []
    out = b""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    open_fds = {leader, proc.stdout.fileno()}
    while open_fds and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_fds), [], [], 0.5)
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the terminal closed with the process
                data = b""
            if not data:
                open_fds.discard(fd)
            elif fd == leader:
                chunks.append((time.monotonic(), proc.poll() is None, data))
            else:
                out += data
    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    os.close(leader)
    return chunks, out, proc.returncode


BENCH = ["bench", "--batches", "--batch-rows", "12", "40", "--batch-sizes", "4", "8", "--repeats", "1"]


@pytest.mark.slow
def test_a_long_bench_at_a_small_size_shows_each_row_measured_on_the_terminal_before_it_ends():
    chunks, out, code = _run_on_a_terminal(BENCH)
    assert code == 0, out[-2000:]
    shown = b"".join(data for _, _, data in chunks).decode(errors="replace")
    assert any(running and b"nopad bench" in data for _, running, data in chunks), "no progress while it ran"
    for row in ("B=4 padded -> nested", "B=8 nested -> padded", "B=12 micro-batch split", "B=40 partition alone"):
        assert row in shown, f"{row!r} not shown: {shown[-1500:]!r}"
    assert "nopad bench" in shown and "== conversions ==" in out.decode()  # results on stdout, not mixed in


@pytest.mark.slow
def test_quiet_or_a_stderr_that_is_not_a_terminal_shows_no_progress():
    chunks, out, code = _run_on_a_terminal(["demo", "--batch-size", "3", "--quiet"])
    assert code == 0 and b"speed" in out
    assert not b"".join(data for _, _, data in chunks).strip()
    done = subprocess.run(
        [sys.executable, "-m", "nopad", *BENCH[:1], "--batch-sizes", "4", "--repeats", "1"],
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        timeout=240,
    )
    assert done.returncode == 0 and b"== conversions ==" in done.stdout
    assert b"nopad bench" not in done.stderr and b"\r" not in done.stderr  # a CI log gets no bar


def test_nopad_pack_shows_its_stages_on_a_terminal(tmp_path):
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(f'{{"text": "conversation number {i} "}}\n' for i in range(300)))
    chunks, out, code = _run_on_a_terminal(["pack", str(src), "-o", str(tmp_path / "o.parquet"), "--pack-length", "64"])
    assert code == 0, out
    shown = b"".join(data for _, _, data in chunks).decode(errors="replace")
    for stage in ("reading", "packing 300 conversations (best_fit_decreasing)", "writing"):
        assert stage in shown, f"{stage!r} not shown: {shown[-1500:]!r}"
    assert out.startswith(b"wrote ")
