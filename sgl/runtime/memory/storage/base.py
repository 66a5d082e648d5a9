"""The storage-backend protocol of the hierarchical KV cache (L3: file, redis, ...).

A backend stores opaque pages under string keys. A key names one KV page (page_size
tokens of one TP rank, all layers, K and V) *and everything before it*: it is the hex of
the page's chained hash (`sgl.kv_events.hashing`) under a namespace made of the model
identity, dtype, page size and TP layout (`page_key`), so two models never share a page.
Pages are framed with a checksum by the caller (`codec.py`); a backend never interprets
them: `PageStore` (`store.py`) frames on `set`, verifies on `get` and deletes a page that
fails. A key outside the backend's namespace is a programming error (ValueError). All calls are batched, because a prompt's pages are always looked up in order and a
round trip per page would cost more than recomputing.

A backend must never raise on a transient failure (store down, disk full): `exists`
answers 0, `get` answers None for what it cannot read, `set` answers False for what it
could not write, and it logs once. The caller treats every miss as "recompute".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class StorageBackend(Protocol):
    name: str

    def exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are stored (stops at the first miss)."""
        ...

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The stored page of each key, None where missing or unreadable."""
        ...

    def set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        """Store pages (atomically each: a reader never sees a torn page); True where written."""
        ...

    def delete(self, keys: Sequence[str]) -> None:
        """Drop pages (e.g. one that failed its checksum)."""
        ...

    def clear(self) -> None:
        """Drop every page of this namespace (the explicit 'clear storage' call)."""
        ...

    def stats(self) -> dict[str, float]:
        """Numbers for /get_server_info and /metrics (bytes used, errors, connected, ...)."""
        ...

    def close(self) -> None: ...
