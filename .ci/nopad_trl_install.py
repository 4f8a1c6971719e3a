"""pytest plugin for TRL's own GRPO / RLOO tests with nopad's ``install()`` active.

``pytest -p nopad_trl_install`` (with this folder on PYTHONPATH) installs before any test module is
collected. It counts the packed forwards run (nopad's replacement of
``_get_per_token_logps_and_entropies``), checks at the end that the replacement was still in place on
both trainers and says both in the summary; a run where it was not, or where no test ran a packed
forward, fails.
"""

from __future__ import annotations

import pytest

from nopad.integrations import trl as nopad_trl
from nopad.integrations.trl import _install as _trl

METHOD = "_get_per_token_logps_and_entropies"
_HANDLE = None
_CALLS = [0]


def _lost() -> list[str]:
    """The trainers whose method no longer is nopad's."""
    if _HANDLE is None or not _HANDLE.active:
        return ["the handle"]
    return [cls.__name__ for cls in _HANDLE.originals if cls.__dict__[METHOD] is _HANDLE.originals[cls]]


def pytest_configure(config: pytest.Config) -> None:
    global _HANDLE
    _HANDLE = nopad_trl.install()
    counted = _trl.packed_logprobs

    def counting(*args, **kwargs):
        _CALLS[0] += 1
        return counted(*args, **kwargs)

    _trl.packed_logprobs = counting


def pytest_report_header(config: pytest.Config) -> str:
    return f"nopad: install() active before collection ({_HANDLE!r})"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    lost = _lost()
    if not _CALLS[0]:
        lost.append("no packed forward ran")
    if lost:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        session.config._nopad_lost = lost  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    lost = getattr(config, "_nopad_lost", None)
    if lost:
        terminalreporter.write_line(f"nopad: install() NOT in force: {lost}", red=True)
    else:
        terminalreporter.write_line(f"nopad: install() active throughout: {_CALLS[0]} packed log-prob forwards")
