"""Old names that keep working for one release, each with a DeprecationWarning naming the new one.

- Moved modules (``nopad.ulysses``, ``nopad.leak``): an import hook maps the old module path to
  the new module, so ``import nopad.ulysses`` still works. There is no file at the old path,
  so history (and merges) follow the moved file.
- Moved attributes: :func:`moved_attributes` builds a module ``__getattr__`` that resolves the old
  name where it lives now.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

MOVED_MODULES = {
    "nopad.ulysses": "nopad.parallel.ulysses",
    "nopad.leak": "nopad.engines.leak",
}


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """One DeprecationWarning: ``old`` is deprecated, use ``new``; removed in the next release."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old path of a moved module and hands back the module at its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        warn_deprecated(f"module {spec.name}", new, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path is already loaded."""


def install_module_finder() -> None:
    """Register :class:`MovedModuleFinder` once."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())


def renamed_keyword(function: str, old: str, new: str, old_value: Any, new_value: Any) -> Any:
    """The value of keyword ``new``, accepting ``old`` for one release with a DeprecationWarning."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"{function}: got both {old}= (deprecated) and {new}=; pass {new}= only")
    warn_deprecated(f"{function}({old}=...)", f"{function}({new}=...)", stacklevel=4)
    return old_value


def renamed_attribute(owner: str, old: str, new: str) -> Any:
    """A read-only class attribute ``old`` that returns ``new`` with a DeprecationWarning."""

    def get(self: Any) -> Any:
        warn_deprecated(f"{owner}.{old}", f"{owner}.{new}")
        return getattr(self, new)

    return property(get, doc=f"Deprecated: use ``{new}``.")


def moved_attributes(module: str, moved: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__``: ``moved`` maps an old attribute name to ``"new.module:new_name"``."""

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, _, new_name = moved[name].partition(":")
        warn_deprecated(f"{module}.{name}", f"{new_module}.{new_name}")
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__
