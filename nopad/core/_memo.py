"""THE identity memo: what nopad derived from an object it was handed (offsets it laid out, position
ids, a padding mask, a model), kept on that object.

Kept on the object itself, it lives exactly as long as the object and costs one attribute read; it
is never matched by value, so it cannot be confused with another object's. A tensor's entries also
record its version: a tensor edited in place (``offsets[1] += 1``) forgets what was derived from it.
A pickled or copied object arrives with an empty memo (the receiver derives again).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

_SLOT = "_nopad_memo"
_TAGS = "_nopad_tags"
_MISSING = object()


class _Memo(dict):
    """key -> (version, value). Dropped by pickle and copy: what it holds is this process's."""

    def __reduce__(self) -> tuple[type, tuple]:
        return _Memo, ()


def _version(obj: Any) -> int:
    return obj._version if isinstance(obj, torch.Tensor) else 0


def recall(obj: Any, key: Hashable, default: Any = None) -> Any:
    """What was remembered of ``obj`` under ``key`` (and is still true of it), else ``default``."""
    memo = getattr(obj, _SLOT, None)
    if not memo:
        return default
    entry = memo.get(key, _MISSING)
    if entry is _MISSING:
        return default
    if entry[0] != _version(obj):  # edited in place since: what was derived no longer holds
        memo.clear()
        return default
    return entry[1]


def tag(obj: Any, name: str) -> None:
    """Tag ``obj`` with ``name``: a fact about the object itself (what made it), kept apart from the
    memo's entries so that reading it reads nothing else (torch.compile guards on the tags alone, not
    on the memo's keys, which name other forwards' facts)."""
    setattr(obj, _TAGS, getattr(obj, _TAGS, frozenset()) | {name})


def tagged(obj: Any, name: str) -> bool:
    """Whether ``obj`` was tagged with ``name``."""
    return name in getattr(obj, _TAGS, ())


def remember(obj: Any, key: Hashable, value: Any) -> Any:
    """Keep ``value`` as what is known of ``obj`` under ``key``; returns it."""
    memo = getattr(obj, _SLOT, None)
    if memo is None:
        memo = _Memo()
        setattr(obj, _SLOT, memo)
    memo[key] = (_version(obj), value)
    return value


def memo(obj: Any, key: Hashable, make: Callable[[], Any]) -> Any:
    """``recall(obj, key)``, made by ``make()`` and remembered the first time."""
    value = recall(obj, key, _MISSING)
    return remember(obj, key, make()) if value is _MISSING else value


def memo_with(obj: Any, key: Hashable, others: tuple, make: Callable[[], Any]) -> Any:
    """``memo(obj, key, make)`` for a fact that also depends on ``others`` (objects, or None): kept
    with weak references to them and their versions, so it holds for these very objects, unedited,
    and never for another made at a freed one's address (no ``id()`` outlives the call). One fact
    per key: other ``others`` make it again and replace it."""
    entry = recall(obj, key)
    if entry is not None and all(_same(mark, other) for mark, other in zip(entry[0], others, strict=True)):
        return entry[1]
    marks = tuple(None if other is None else (weakref.ref(other), _version(other)) for other in others)
    return remember(obj, key, (marks, make()))[1]


def _same(mark: tuple | None, other: Any) -> bool:
    if mark is None or other is None:
        return mark is None and other is None
    return mark[0]() is other and mark[1] == _version(other)
