"""`RedisBackend`: the storage tier in a Redis or Valkey server, shared by every worker that
points at it (worker B reuses the prefixes worker A computed, when both run the same model
with the same dtype, page size and TP layout: same namespace, same keys).

Each call is one round trip: `exists` pipelines EXISTS per key and counts the run of hits
from the first; `get` is MGET; `set` pipelines SET (with EX when `ttl_s` is given). Pages
are content-addressed (a key names a prefix), so rewriting a key rewrites the same bytes.

Size limit: Redis evicts, not us. Run the server with ``maxmemory <bytes>`` and
``maxmemory-policy allkeys-lru`` (the recommended set-up; eviction then follows use, across
all workers), and/or give `ttl_s` so pages expire that long after their last write. If
`max_bytes` is given, the backend asks the server for exactly that on every new socket, so
a server that came up late or restarted gets it too (CONFIG SET maxmemory / allkeys-lru;
server-wide, logged once if the server refuses, e.g. a managed Redis).

Faults never reach the scheduler: socket timeouts are short (connect 0.3 s, I/O 0.5 s by
default) and redis-py's own retries are off. On a connection error or timeout the backend
marks itself down, logs once that the storage tier is off, and answers every call with a
miss / False at once, without touching the network, until a back-off (1 s doubling to
30 s) has passed; the next call then tries again and, if Redis is back, the tier is on
again (logged). Redis unreachable at start is the same state from the first call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .codec import check_namespace

log = logging.getLogger(__name__)

_CHUNK = 128  # keys per round trip: bounds one reply's size
# Bytes per socket read: a reply of 16 pages is ~6 MB and each read is a turn of redis-py's
# Python loop under the GIL; its default of 64 KB takes ~90 turns per reply (94 pages: 17.7
# -> 16.2 ms on Zen 4, within that host's run-to-run noise).
_READ_SIZE = 1 << 20
_MAX_BACKOFF_S = 30.0


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as e:
        raise ImportError("--hicache-storage-backend redis needs the `redis` package (pip install redis)") from e
    return redis


def redact(url: str) -> str:
    """`url` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisBackend:
    name = "redis"

    def __init__(self, url: str, namespace: str, max_bytes: int | None = None, ttl_s: float | None = None,
                 socket_timeout_s: float = 0.5, connect_timeout_s: float = 0.3,
                 retry_interval_s: float = 1.0) -> None:
        redis = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.namespace = check_namespace(namespace)
        self.url = url
        self.max_bytes = max_bytes
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._redis_error = redis.exceptions.RedisError
        self._config_refused = False  # True once the server refused CONFIG SET (not asked again)
        self._client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0,
            socket_read_size=_READ_SIZE, redis_connect_func=self._on_socket)
        self._lock = threading.Lock()
        self._retry_base = self._retry_s = float(retry_interval_s)
        self._down_until: float | None = None  # None: connected (or never tried)
        self._starting = True  # the first outage log says "unreachable at start"
        self._n = dict.fromkeys(("hits", "misses", "bytes_read", "bytes_written", "writes", "errors",
                                 "connect_attempts", "reconnects"), 0)
        self._call(self._connect)
        self._starting = False

    # -- connection state ----------------------------------------------------------------
    def _connect(self) -> bool:
        with self._lock:
            self._n["connect_attempts"] += 1
        self._client.ping()
        return True

    def _on_socket(self, conn: Any) -> None:
        """redis-py's hook for every new socket: its own handshake, then `max_bytes`. Every
        socket, because redis-py reconnects silently when a server restarted between two
        calls, and a restarted Redis has forgotten CONFIG SET. A refusal (a managed Redis)
        is logged once and not asked again."""
        conn.on_connect()
        if self.max_bytes is None or self._config_refused:
            return
        try:
            for name, value in (("maxmemory", str(self.max_bytes)), ("maxmemory-policy", "allkeys-lru")):
                conn.send_command("CONFIG", "SET", name, value)
                conn.read_response()
        except self._redis_error as e:
            if isinstance(e, self._errors):
                raise
            self._config_refused = True
            log.warning("storage redis: the server refused CONFIG SET maxmemory (%s); set maxmemory and "
                        "maxmemory-policy allkeys-lru on the server itself", e)

    def _call(self, fn: Any, *args: Any) -> Any:
        """fn(*args), or None when the server is down (now, or within the back-off)."""
        with self._lock:
            if self._down_until is not None and time.monotonic() < self._down_until:
                return None
            was_down = self._down_until is not None
        if was_down:
            with self._lock:
                self._n["connect_attempts"] += 1
        try:
            result = fn(*args)
        except self._errors as e:
            self._went_down(e)
            return None
        except self._redis_error as e:  # a refused command (e.g. OOM under noeviction): not an outage
            with self._lock:
                self._n["errors"] += 1
            log.debug("storage redis: %s", e)
            return None
        if was_down:
            with self._lock:
                if self._down_until is not None:
                    self._down_until = None
                    self._retry_s = self._retry_base
                    self._n["reconnects"] += 1
                    log.warning("storage redis: %s answers again; the storage tier is on", redact(self.url))
        return result

    def _went_down(self, err: BaseException) -> None:
        with self._lock:
            self._n["errors"] += 1
            if self._down_until is None:
                what = "cannot reach" if self._starting else "lost"
                log.warning("storage redis: %s %s (%s); the storage tier is off, requests recompute "
                            "(retrying every %.0f s or more)", what, redact(self.url), err, self._retry_s)
            else:
                self._retry_s = min(self._retry_s * 2, _MAX_BACKOFF_S)
            self._down_until = time.monotonic() + self._retry_s
        try:
            # idle sockets only: not the one the other thread is using
            self._client.connection_pool.disconnect(inuse_connections=False)
        except Exception:  # noqa: BLE001 - tearing down broken sockets must not raise
            pass

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._down_until is None

    # -- protocol ------------------------------------------------------------------------
    def _keys(self, keys: Sequence[str]) -> Sequence[str]:
        prefix = self.namespace + "/"
        for key in keys:
            if not key.startswith(prefix):
                raise ValueError(f"key {key!r} is not a page key of namespace {self.namespace!r} (use page_key)")
        return keys

    def exists(self, keys: Sequence[str]) -> int:
        keys = self._keys(keys)
        n = 0
        for lo in range(0, len(keys), _CHUNK):
            chunk = keys[lo : lo + _CHUNK]

            def run(chunk: Sequence[str] = chunk) -> list[int]:
                pipe = self._client.pipeline(transaction=False)
                for key in chunk:
                    pipe.exists(key)
                return pipe.execute()

            found = self._call(run)
            if found is None:
                return n
            for hit in found:
                if not hit:
                    return n
                n += 1
        return n

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = self._keys(keys)
        out: list[bytes | None] = []
        for lo in range(0, len(keys), _CHUNK):
            chunk = keys[lo : lo + _CHUNK]
            values = self._call(self._client.mget, chunk)
            out.extend(values if values is not None else [None] * len(chunk))
        got = [v for v in out if v is not None]
        with self._lock:
            self._n["hits"] += len(got)
            self._n["misses"] += len(out) - len(got)
            self._n["bytes_read"] += sum(len(v) for v in got)
        return out

    def set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        keys = self._keys(keys)
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        out: list[bool] = []
        for lo in range(0, len(keys), _CHUNK):
            pairs = list(zip(keys[lo : lo + _CHUNK], values[lo : lo + _CHUNK], strict=True))

            def run(pairs: list[tuple[str, bytes]] = pairs) -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                for key, value in pairs:
                    pipe.set(key, value, px=self.ttl_ms)
                return pipe.execute(raise_on_error=False)

            replies = self._call(run)
            if replies is None:
                out.extend([False] * len(pairs))
                continue
            ok = [r is True for r in replies]
            out.extend(ok)
            with self._lock:
                self._n["writes"] += sum(ok)
                self._n["errors"] += len(ok) - sum(ok)
                self._n["bytes_written"] += sum(len(v) for (_, v), w in zip(pairs, ok, strict=True) if w)
        return out

    def delete(self, keys: Sequence[str]) -> None:
        keys = self._keys(keys)
        for lo in range(0, len(keys), _CHUNK):
            self._call(self._client.delete, *keys[lo : lo + _CHUNK])

    def clear(self) -> None:
        """Delete this namespace's keys only (SCAN MATCH '<namespace>/*', then UNLINK)."""

        def run() -> None:
            batch: list[bytes] = []
            for key in self._client.scan_iter(match=f"{self.namespace}/*", count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)

        self._call(run)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**{k: float(v) for k, v in self._n.items()}, "connected": float(self._down_until is None)}

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a broken client must not raise
            pass
