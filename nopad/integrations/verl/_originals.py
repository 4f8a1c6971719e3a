"""verl's own functions behind nopad's replacements: what a replacement calls for the options it
leaves to verl. One lookup for every replacement, so each can be bound in verl's modules as it is."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# (defining module, name) -> verl's function, as the active install() learned it; None when none is active
_learned: dict[tuple[str, str], Callable[..., Any]] | None = None


def learn_into(originals: dict[tuple[str, str], Callable[..., Any]] | None) -> None:
    """Where :func:`verl_original` finds verl's functions while an install() is active (None: it is not)."""
    global _learned
    _learned = originals


def verl_original(module_name: str, name: str) -> Callable[..., Any]:
    """verl's own function, installed or not. The module is imported first: under ``install()`` importing
    it is what records its originals."""
    module = importlib.import_module(module_name)
    if _learned is not None and (module_name, name) in _learned:
        return _learned[module_name, name]
    function = vars(module)[name]
    if getattr(function, "__module__", "").startswith("nopad."):
        raise RuntimeError(f"{module_name}.{name}: verl's original is unknown (nopad's replacement is bound)")
    return function
