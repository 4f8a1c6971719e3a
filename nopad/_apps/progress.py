"""Progress of long work on stderr: the benchmarks, ``nopad pack``, the demo.

A bar on a terminal that names what is being measured now (tqdm's when it is installed, a plain
one otherwise); nothing when stderr is not a terminal (a CI log, a file: no carriage returns in
it) or under ``--quiet``. Results go to stdout, so ``nopad bench > results.txt`` still shows the
bar, and ``--json`` output is never mixed with it. Beside it, :func:`sync`: the wait for the device
that every timing of that work shares.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import torch


def add_quiet_argument(parser: Any, *aliases: str) -> None:
    """``-q`` / ``--quiet`` (and ``aliases``): no progress on stderr (results and errors are printed
    all the same)."""
    parser.add_argument(
        "-q",
        "--quiet",
        *aliases,
        dest="quiet",
        action="store_true",
        help="no progress on stderr (off a terminal there is none anyway)",
    )


def sync(device: str | torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA; nothing to wait for elsewhere): a timing then counts it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class Progress:
    """``total`` steps of ``what``; each :meth:`step` names the step running and counts it when done.

    Shown only when ``stream`` (stderr) is a terminal and not ``quiet``; otherwise every method does
    nothing. ``total`` may be raised later (:meth:`add`) when a step turns out to hold more.
    """

    def __init__(self, what: str, total: int, *, quiet: bool = False, stream: TextIO | None = None):
        self.stream = sys.stderr if stream is None else stream
        self.on = not quiet and is_terminal(self.stream)
        self.what, self.total, self.done = what, total, 0
        self.start = self._noted = time.perf_counter()
        self._bar: Any = None
        if not self.on:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc=what, file=self.stream, leave=False, dynamic_ncols=True, mininterval=0)
        self._show("")

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Show ``label`` while the block runs; count one step when it ends."""
        self._show(label)
        try:
            yield
        finally:
            self.done += 1
            if self._bar is not None and self.on:
                self._bar.update(1)

    def note(self, label: str) -> None:
        """Show ``label`` for the step running (a count inside it); redrawn at most ten times a second."""
        if self.on and time.perf_counter() - self._noted >= 0.1:
            self._noted = time.perf_counter()
            self._show(label)

    def add(self, steps: int) -> None:
        """``steps`` more steps than announced."""
        self.total += steps
        if self._bar is not None and self.on:
            self._bar.total = self.total
            self._bar.refresh()

    def close(self) -> None:
        if not self.on:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        self.on = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _show(self, label: str) -> None:
        if not self.on:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=True)
            return
        elapsed = time.perf_counter() - self.start
        line = f"{self.what} [{self.done}/{self.total}] {label} ({elapsed:.0f} s)"
        try:
            width = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            width = 80
        self.stream.write("\r\x1b[K" + line[: max(10, width - 1)])
        self.stream.flush()


QUIET = Progress("", 0, quiet=True)  # the progress of work nobody watches: every method does nothing
