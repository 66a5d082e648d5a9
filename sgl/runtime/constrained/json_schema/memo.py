"""Memo tables for the converter's pure helpers (character sets, key tries, patterns).

Schemas repeat the same few sets, name lists and patterns thousands of times, within
one schema and across the schemas one server process converts, so those helpers are
memoized for the life of the process; each table is bounded. `clear_memos` empties
them all, for measuring a conversion the way a fresh process runs it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_TABLES: list[Any] = []


def memo(maxsize: int) -> Callable[[F], F]:
    """`functools.lru_cache(maxsize)` on a pure function with hashable arguments,
    registered so `clear_memos` reaches it."""
    def wrap(fn: F) -> F:
        cached = lru_cache(maxsize=maxsize)(fn)
        _TABLES.append(cached)
        return cached  # type: ignore[return-value]
    return wrap


class Table(dict):
    """A bounded memo dict, emptied when full, for recursive helpers: a call through
    an lru_cache wrapper costs two stack frames, so a memoized recursion would hit the
    recursion limit at half the depth the plain one does."""

    def __init__(self, maxsize: int) -> None:
        super().__init__()
        self.maxsize = maxsize
        _TABLES.append(self)

    def put(self, key: Any, value: Any) -> Any:
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = value
        return value

    def cache_clear(self) -> None:
        self.clear()


def clear_memos() -> None:
    """Empty every memo table."""
    for table in _TABLES:
        table.cache_clear()
