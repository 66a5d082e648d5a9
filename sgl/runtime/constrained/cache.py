"""Compile caches: an in-memory LRU of compiled grammars and an on-disk index store.

Compiling a grammar against a 49k vocabulary costs from tens of milliseconds to seconds,
and servers see the same schema again and again, so compiled tables are kept keyed by
(kind, spec, tokenizer hash). The memory cache holds compiled objects (each hands out
fresh matchers); the disk cache holds outlines-core Index objects (they pickle to a
compact binary form) under `<cache dir>/grammars/` so a restarted server skips the
Index build. Disk entries are written atomically; unreadable ones are ignored.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from ..config import cache_dir

_FORMAT = "v1"


def cache_key(kind: str, spec: str, tok_hash: str) -> str:
    return hashlib.sha256(f"{_FORMAT}\0{kind}\0{spec}\0{tok_hash}".encode()).hexdigest()


def default_cache_dir() -> Path:
    return cache_dir() / "grammars"


class LRUCache:
    """Thread-safe LRU; `get_or_create` runs the factory outside the lock."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._d: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> Any | None:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return v

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._d[key] = value
            self._d.move_to_end(key)
            while len(self._d) > self.max_entries:
                self._d.popitem(last=False)

    def get_or_create(self, key: str, factory: Callable[[], Any]) -> Any:
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


class DiskCache:
    """Pickled objects in files named by key; None from `get` means absent or unreadable."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.pkl"

    def get(self, key: str) -> Any | None:
        p = self._path(key)
        try:
            with open(p, "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception:  # truncated or from an incompatible library version
            return None

    def put(self, key: str, value: Any) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self._path(key))
        except OSError:
            pass  # a read-only or full disk only costs a recompile later
