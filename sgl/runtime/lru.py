"""A bounded, thread-safe map that forgets its least recently used entry.

The one LRU of the code base: compiled grammars (constrained/registry.py), the mask and
walk memos of the grammar backends, and the server's token-text memo use it. A lookup
refreshes the entry; a `put` past `max_entries` drops the stalest one. `get_or_create`
runs its factory outside the lock, so two threads may both build a missing value (the
second `put` wins); callers cache pure results, for which that is harmless.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    def __init__(self, max_entries: int) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._d: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: K) -> V | None:
        """The value (now the most recent entry), or None."""
        with self._lock:
            v = self._d.get(key)
            if v is None:
                self.misses += 1
            else:
                self._d.move_to_end(key)
                self.hits += 1
            return v

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._d[key] = value
            self._d.move_to_end(key)
            while len(self._d) > self.max_entries:
                self._d.popitem(last=False)

    def get_or_create(self, key: K, factory: Callable[[], V]) -> V:
        v = self.get(key)
        if v is None:
            v = factory()
            self.put(key, v)
        return v

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return key in self._d
