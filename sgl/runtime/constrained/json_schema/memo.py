"""Memo tables for the converter's pure helpers (character sets, key tries, patterns).

Schemas repeat the same few sets, name lists and patterns thousands of times, within
one schema and across the schemas one server process converts, so those helpers are
memoized for the life of the process. A table is bounded by the characters it holds,
not by its entry count: one entry's size follows the schema (a long pattern, a long
property name's subtrie), and a server converts schemas from anyone. `clear_memos`
empties every table, for measuring a conversion the way a fresh process runs it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_TABLES: list[Any] = []
_MISSING = object()
# A dict slot, a key tuple, and the headers of the key's and value's strings, roughly.
ENTRY_BYTES = 100


class Table(dict):
    """A memo dict holding about `budget` bytes: the characters of keys and values (as
    its callers measure them) plus `ENTRY_BYTES` per entry for the objects around
    them; emptied when a new entry would pass the budget. A
    plain dict, so a recursive helper that looks itself up keeps one stack frame per
    level (a call through a cache wrapper costs two, halving the depth it reaches)."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget = budget
        self.used = 0
        _TABLES.append(self)

    def put(self, key: Any, value: Any, size: int) -> Any:
        """Store and return `value`; entries larger than the whole budget are not kept."""
        size += ENTRY_BYTES
        if self.used + size > self.budget:
            self.cache_clear()
        if size <= self.budget:
            self[key] = value
            self.used += size
        return value

    def cache_clear(self) -> None:
        self.clear()
        self.used = 0


def memo(budget: int, size: Callable[[Any, Any], int]) -> Callable[[F], F]:
    """Memoize a pure function of one hashable argument in a `Table`; `size(arg,
    result)` is what an entry holds, in characters."""
    def wrap(fn: F) -> F:
        table = Table(budget)

        @functools.wraps(fn)
        def cached(arg: Any) -> Any:
            out = table.get(arg, _MISSING)
            if out is _MISSING:
                out = fn(arg)
                table.put(arg, out, size(arg, out))
            return out
        cached.cache_clear = table.cache_clear  # type: ignore[attr-defined]
        return cached  # type: ignore[return-value]
    return wrap


def memo_small(maxsize: int) -> Callable[[F], F]:
    """`functools.lru_cache(maxsize)` for a hot helper whose arguments and result are a
    few characters each (one code point's spelling), so a count bounds its memory."""
    def wrap(fn: F) -> F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _TABLES.append(cached)
        return cached  # type: ignore[return-value]
    return wrap


def clear_memos() -> None:
    """Empty every memo table."""
    for table in _TABLES:
        table.cache_clear()
