"""The public API is a list: each public module's ``__all__``, every name in it documented in
docs/api.md, nothing else public, and nothing documented that is not listed."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def public_modules() -> dict[str, Path]:
    """Modules none of whose dotted parts starts with ``_``."""
    found = {}
    for path in sorted((ROOT / "nopad").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts):
            found[".".join(parts)] = path
    return found


def defined_names(path: Path) -> list[str]:
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


def test_every_public_module_lists_its_api_and_defines_nothing_else_public():
    for name, path in public_modules().items():
        module = importlib.import_module(name)
        listed = getattr(module, "__all__", [])
        assert len(set(listed)) == len(listed), f"{name}: a name listed twice"
        for attr in listed:
            assert hasattr(module, attr), f"{name}.__all__ names {attr}, which it does not have"
        unlisted = [n for n in defined_names(path) if n not in listed]
        assert not unlisted, (
            f"{name} defines public names outside its __all__ (move them to a private module): {unlisted}"
        )


def test_docs_api_md_documents_exactly_the_listed_names():
    documented = re.findall(r"^::: (\S+)$", (ROOT / "docs" / "api.md").read_text(), re.M)
    listed = {}
    for name in public_modules():
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", []):
            listed.setdefault(id(getattr(module, attr)), []).append(f"{name}.{attr}")
    seen = set()
    for path in documented:
        module_name, _, attr = path.rpartition(".")
        module = importlib.import_module(module_name)
        assert attr in getattr(module, "__all__", []), f"docs/api.md documents {path}, which is not listed"
        seen.add(id(getattr(module, attr)))
    missing = [paths[0] for key, paths in listed.items() if key not in seen]
    assert not missing, f"listed but not in docs/api.md: {missing}"


def test_the_public_surface_stays_small():
    """Issue 22: 277 public names before; the names a trainer author needs, under a third (issue 30 adds
    the Megatron adapter's head, thd_logprobs: 91; issue 37 the TRL integration's install, uninstall
    and its handle, TrlPatch: 94)."""
    objects = set()
    for name in public_modules():
        module = importlib.import_module(name)
        listed = getattr(module, "__all__", [])
        objects |= {(id(getattr(module, a)) if callable(getattr(module, a)) else (name, a)) for a in listed}
    assert len(objects) <= 94, len(objects)
