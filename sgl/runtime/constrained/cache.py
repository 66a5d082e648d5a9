"""The on-disk store of compiled grammar tables and the key both compile caches use.

Compiling a grammar against a 49k vocabulary costs from tens of milliseconds to seconds,
and servers see the same schema again and again, so compiled tables are kept keyed by
(kind, spec, tokenizer hash). The memory cache (an `sgl.runtime.lru.LRU` in registry.py)
holds compiled objects (each hands out fresh matchers); the disk cache holds byte DFAs and
outlines-core Index objects (they pickle to a compact binary form) under
`<cache dir>/grammars/` so a restarted server skips the build. Disk entries are written
atomically; unreadable ones are ignored.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

from ..config import cache_dir

_FORMAT = "v1"


def cache_key(kind: str, spec: str, tok_hash: str) -> str:
    return hashlib.sha256(f"{_FORMAT}\0{kind}\0{spec}\0{tok_hash}".encode()).hexdigest()


class DiskCache:
    """Pickled objects in files named by key; None from `get` means absent or unreadable."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_dir() / "grammars"

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
