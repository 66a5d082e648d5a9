"""`FileBackend`: the storage tier as a directory of page files, bounded in size with LRU
eviction, surviving restarts.

Layout: ``<path>/<namespace>/<first 2 hex digits>/<16 hex digits>.page`` (the fan-out keeps
directories small). A write goes to a temp file ``.<name>.<random>.tmp`` in the same
directory and is then renamed over the final name (`os.replace`, atomic on POSIX), so a
reader sees the whole page or none of it; a crash leaves at most a temp file, which is
never read (only ``*.page`` names are) and is removed at the next start. `fsync` (off by
default) also survives a power cut, at a cost per page.

LRU: an in-memory index of key -> size in access order. A read touches the file's mtime
(never atime: it is often off, `noatime`/`relatime`), so at start the index is rebuilt by
scanning the directory in mtime order and the eviction order survives a restart. When the
pages exceed `max_bytes`, the least recently used are unlinked. Several processes may share
a directory safely (renames are atomic, a vanished file is a miss), but each counts only
the bytes it saw; give each TP rank / worker its own namespace (`namespace_for` does).

Faults: an unwritable or full disk makes `set` answer False, logs one warning, and pauses
writes for a back-off (doubling up to a minute) before trying again; reads go on. Nothing
here raises on an OS error. Checksums are not read here: `PageStore` verifies each page
and calls `delete` on one that fails.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from .codec import check_namespace

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 10 * 2**30
_NAME = re.compile(r"^[0-9A-Za-z_-][0-9A-Za-z_.-]*$")
_SUFFIX = ".page"
_STALE_TMP_S = 60.0  # a temp file this old belongs to a dead writer


def default_path() -> Path:
    """``<cache folder>/hicache`` (the one cache folder: `sgl.runtime.config.cache_dir`)."""
    from sgl.runtime.config import cache_dir

    return cache_dir() / "hicache"


class FileBackend:
    name = "file"

    def __init__(self, path: str | os.PathLike[str] | None, namespace: str, max_bytes: int = DEFAULT_MAX_BYTES,
                 fsync: bool = False, retry_interval_s: float = 5.0) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.namespace = check_namespace(namespace)
        self.root = Path(path) if path is not None else default_path()
        self.dir = self.root / namespace
        self.max_bytes = int(max_bytes)
        self.fsync = fsync
        self._retry_s = self._retry_base = float(retry_interval_s)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, least recent first
        self._bytes = 0
        self._paused_until: float | None = None  # writes paused after an OS error until then
        self._n = dict.fromkeys(("hits", "misses", "bytes_read", "bytes_written", "writes", "write_errors",
                                 "read_errors", "evictions"), 0)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self._write_failed(e)

    # -- keys and the index ------------------------------------------------------------
    def _path(self, key: str) -> Path:
        ns, sep, name = key.rpartition("/")
        if ns != self.namespace or not sep or not _NAME.match(name):
            raise ValueError(f"key {key!r} is not a page key of namespace {self.namespace!r} (use page_key)")
        return self.dir / name[:2] / (name + _SUFFIX)

    def _scan(self) -> None:
        """Rebuild the LRU index from the directory, oldest mtime first; drop stale temp files."""
        found: list[tuple[int, str, int]] = []
        now = time.time()
        for sub in os.scandir(self.dir):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.endswith(_SUFFIX) and _NAME.match(entry.name[: -len(_SUFFIX)]) and \
                        not entry.name.startswith("."):  # a stray file of another name is not ours
                    found.append((st.st_mtime_ns, f"{self.namespace}/{entry.name[: -len(_SUFFIX)]}", st.st_size))
                elif entry.name.startswith(".") and now - st.st_mtime > _STALE_TMP_S:
                    _unlink(entry.path)
        found.sort()
        for _mtime, key, size in found:
            self._index[key] = size
            self._bytes += size
        victims = self._evict_over_limit()
        for key in victims:
            _unlink(self._path(key))

    def _evict_over_limit(self) -> list[str]:
        """Pop least recently used keys until within max_bytes (lock held); caller unlinks."""
        victims = []
        while self._bytes > self.max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            victims.append(key)
        self._n["evictions"] += len(victims)
        return victims

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    def _note(self, key: str, size: int) -> None:
        old = self._index.pop(key, None)
        self._bytes += size - (old or 0)
        self._index[key] = size

    # -- protocol ------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            if not self._path(key).is_file():
                break
            n += 1
        return n

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            failed = False
            try:
                data: bytes | None = path.read_bytes()
            except FileNotFoundError:
                data = None
            except OSError as e:
                log.debug("storage file: cannot read %s: %s", path, e)
                data, failed = None, True
            with self._lock:
                if data is None:
                    self._forget(key)
                    self._n["misses"] += 1
                    self._n["read_errors"] += failed
                else:
                    self._note(key, len(data))
                    self._n["hits"] += 1
                    self._n["bytes_read"] += len(data)
            if data is not None:
                _touch(path)
            out.append(data)
        return out

    def set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        out = []
        for key, value in zip(keys, values, strict=True):
            out.append(self._set_one(key, value))
        return out

    def _set_one(self, key: str, value: bytes) -> bool:
        path = self._path(key)
        if len(value) > self.max_bytes:
            return False
        with self._lock:
            if self._paused_until is not None and time.monotonic() < self._paused_until:
                return False
            known = key in self._index
        if known and path.is_file():  # same key = same prefix = same page: nothing to write
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
            return True
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(value)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            _touch(tmp)
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None:
                _unlink(tmp)
            self._write_failed(e)
            return False
        with self._lock:
            if self._paused_until is not None:
                log.warning("storage file: writes under %s resumed", self.dir)
                self._paused_until = None
                self._retry_s = self._retry_base
            self._note(key, len(value))
            self._n["writes"] += 1
            self._n["bytes_written"] += len(value)
            victims = self._evict_over_limit()
        for victim in victims:
            _unlink(self._path(victim))
        return True

    def _write_failed(self, err: OSError) -> None:
        with self._lock:
            self._n["write_errors"] += 1
            if self._paused_until is None:
                log.warning("storage file: cannot write under %s (%s); storage writes paused, serving goes on "
                            "(retrying every %.0f s or more)", self.dir, err, self._retry_s)
            else:
                self._retry_s = min(self._retry_s * 2, 60.0)
            self._paused_until = time.monotonic() + self._retry_s

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            _unlink(self._path(key))
            with self._lock:
                self._forget(key)

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._bytes = 0
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._write_failed(e)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**{k: float(v) for k, v in self._n.items()}, "pages": float(len(self._index)),
                    "bytes_used": float(self._bytes), "max_bytes": float(self.max_bytes),
                    "writes_paused": float(self._paused_until is not None)}

    def close(self) -> None:
        pass


def _touch(path: str | os.PathLike[str]) -> None:
    """mtime = now, to the nanosecond (file timestamps are otherwise as coarse as a clock tick,
    and the restart scan orders pages by mtime): the last use, so the LRU order survives."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass


def _unlink(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
