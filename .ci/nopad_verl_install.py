"""pytest plugin for CI's verl leg: verl's own tests with nopad's ``install()`` active.

``pytest -p nopad_verl_install`` (with this folder on PYTHONPATH) installs before any test module
is collected, so every verl module the tests import is rebound (those imported already by the
install, the rest by its import hook). At the end it checks that the routes were still in place and
says so in the summary; a run where they were not fails.
"""

from __future__ import annotations

import importlib

import pytest

from nopad.integrations import verl as nopad_verl

_HANDLE = None


def _still_routed() -> list[str]:
    """The routed verl names that no longer hold nopad's function."""
    from nopad.integrations.verl import _install as _verl

    lost = []
    for module_name, names in _verl.ROUTED.items():
        module = importlib.import_module(module_name)
        for name in names:
            if vars(module).get(name) is not _verl.REPLACEMENTS[module_name][name]:
                lost.append(f"{module_name}.{name}")
    return lost


def pytest_configure(config: pytest.Config) -> None:
    global _HANDLE
    _HANDLE = nopad_verl.install()


def pytest_report_header(config: pytest.Config) -> str:
    return f"nopad: install() active before collection ({_HANDLE!r})"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    lost = _still_routed()
    if lost or _HANDLE is None or not _HANDLE.active:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        session.config._nopad_lost = lost or ["the handle"]  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    lost = getattr(config, "_nopad_lost", None)
    if lost:
        terminalreporter.write_line(f"nopad: install() NOT active at the end: {lost}", red=True)
    else:
        count = len(_HANDLE.bindings) if _HANDLE is not None else 0
        terminalreporter.write_line(f"nopad: install() active throughout: {count} verl bindings routed to nopad")
