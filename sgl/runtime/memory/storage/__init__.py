"""Storage tier (L3) backends for the hierarchical KV cache: one protocol (`base.py`),
one file per backend, picked by name with `make_backend` (lazy imports: the redis client
is imported only when `redis` is chosen). Wrap the backend in `PageStore` (`store.py`),
which frames pages with a checksum and deletes the ones that fail it.

Plugging in another store (Mooncake, LMCache, 3FS, ...) takes one file here with a class
that has a `name` and the seven methods of `StorageBackend` -- batched `exists` (count of
consecutive hits from the first key), `get`, `set`, `delete`, `clear` (this namespace
only), `stats`, `close` -- that treats pages as opaque bytes under the given string keys
and never raises on a transient failure (down / full: miss, False, one log line); plus
one entry in `_BACKENDS` below naming its module, class and the extra-config keys it
accepts. Checksums, key naming and the namespace (model, dtype, page size, TP layout) come
from `codec.py` and `PageStore`, so a new backend does not re-implement them.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import StorageBackend
from .codec import decode_page, encode_page, namespace_for, page_key
from .store import PageStore

__all__ = ["StorageBackend", "PageStore", "make_backend", "encode_page", "decode_page", "page_key",
           "namespace_for", "BACKEND_NAMES"]

_BACKEND_FLAG = "--hicache-storage-backend"
_CONFIG_FLAG = "--hicache-storage-backend-extra-config"

# name -> (module, class, {extra-config key: (accepted types, constructor argument)})
_NUM = (int, float)
_BACKENDS: dict[str, tuple[str, str, dict[str, tuple[tuple[type, ...], str]]]] = {
    "file": (".file", "FileBackend", {
        "path": ((str,), "path"),
        "max_bytes": ((int,), "max_bytes"),
        "fsync": ((bool,), "fsync"),
        "retry_interval_s": (_NUM, "retry_interval_s"),
    }),
    "redis": (".redis", "RedisBackend", {
        "url": ((str,), "url"),
        "max_bytes": ((int,), "max_bytes"),
        "ttl_s": (_NUM, "ttl_s"),
        "socket_timeout_s": (_NUM, "socket_timeout_s"),
        "connect_timeout_s": (_NUM, "connect_timeout_s"),
        "retry_interval_s": (_NUM, "retry_interval_s"),
    }),
}
BACKEND_NAMES = tuple(_BACKENDS)
_REQUIRED = {"redis": ("url",)}
_URL_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")


def make_backend(name: str, extra_config: dict[str, Any] | None, namespace: str) -> StorageBackend:
    """The backend `name` ("file" or "redis") for `namespace` (`codec.namespace_for`), from
    the parsed JSON of --hicache-storage-backend-extra-config.

    file:  {"path": DIR (default <cache folder>/hicache), "max_bytes": int (10 GiB),
            "fsync": bool (false), "retry_interval_s": number (5)}
    redis: {"url": "redis://HOST:PORT[/DB]" (required), "max_bytes": int (asks the server
            for maxmemory + allkeys-lru), "ttl_s": number, "socket_timeout_s": number (0.5),
            "connect_timeout_s": number (0.3), "retry_interval_s": number (1)}

    Raises ValueError naming the flag and the key for an unknown backend, an unknown or
    badly typed key, or a missing required one. A store that is down is not an error here:
    the backend starts with its tier off and connects later.
    """
    if name not in _BACKENDS:
        raise ValueError(f"{_BACKEND_FLAG}: unknown backend {name!r} (choose one of {', '.join(BACKEND_NAMES)})")
    config = {} if extra_config is None else extra_config
    if not isinstance(config, dict):
        raise ValueError(f"{_CONFIG_FLAG} must be a JSON object, got {type(config).__name__}")
    module, cls, known = _BACKENDS[name]
    kwargs: dict[str, Any] = {}
    for key, value in config.items():
        if key not in known:
            raise ValueError(f"{_CONFIG_FLAG}: unknown key {key!r} for {_BACKEND_FLAG} {name} "
                             f"(known: {', '.join(known)})")
        types, arg = known[key]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            want = " or ".join(t.__name__ for t in types)
            raise ValueError(f"{_CONFIG_FLAG}: {key!r} must be {want}, got {value!r}")
        if isinstance(value, _NUM) and not isinstance(value, bool) and value <= 0:
            raise ValueError(f"{_CONFIG_FLAG}: {key!r} must be positive, got {value!r}")
        kwargs[arg] = value
    for key in _REQUIRED.get(name, ()):
        if key not in kwargs:
            raise ValueError(f"{_CONFIG_FLAG}: {_BACKEND_FLAG} {name} needs {key!r}, e.g. "
                             '{"url": "redis://127.0.0.1:6379"}')
    if name == "redis":
        scheme = kwargs["url"].split("://", 1)[0] if "://" in kwargs["url"] else ""
        if scheme not in _URL_SCHEMES:
            raise ValueError(f"{_CONFIG_FLAG}: 'url' must look like redis://HOST:PORT, got {kwargs['url']!r}")
        if scheme.startswith("valkey"):  # redis-py speaks to Valkey under the redis scheme
            kwargs["url"] = "redis" + kwargs["url"][len("valkey"):]
    if name == "file" and "path" not in kwargs:
        kwargs["path"] = None
    backend_cls = getattr(importlib.import_module(module, __name__), cls)
    return backend_cls(namespace=namespace, **kwargs)
