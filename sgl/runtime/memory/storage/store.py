"""`PageStore`: the one place where the storage tier's checksum rule lives. It wraps any
`StorageBackend`, frames pages on the way in (`codec.encode_page`) and checks them on the
way out: a page that fails its checksum, or is truncated, is answered as a miss *and
deleted*, so it is recomputed and written again instead of failing forever. Backends stay
dumb byte stores (a Mooncake or LMCache backend gets the rule for free); the host tier
talks to a PageStore, never to a backend directly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from .base import StorageBackend
from .codec import decode_page, encode_page

log = logging.getLogger(__name__)


class PageStore:
    def __init__(self, backend: StorageBackend) -> None:
        self.backend = backend
        self.name = backend.name
        self._lock = threading.Lock()
        self._corrupt = 0

    def exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, the backend holds (checksums not read)."""
        return self.backend.exists(keys) if keys else 0

    def get(self, keys: Sequence[str]) -> list[memoryview | None]:
        """Verified payloads; None where missing, unreadable or corrupt (corrupt ones deleted)."""
        if not keys:
            return []
        blobs = self.backend.get(keys)
        out = [decode_page(b) for b in blobs]
        bad = [k for k, b, p in zip(keys, blobs, out, strict=True) if b is not None and p is None]
        if bad:
            with self._lock:
                self._corrupt += len(bad)
            log.warning("storage %s: %d page(s) failed their checksum; deleted (first: %s)",
                        self.name, len(bad), bad[0])
            self.backend.delete(bad)
        return out

    def get_prefix(self, keys: Sequence[str]) -> list[memoryview]:
        """Verified payloads of the longest run of `keys` from the first that all load."""
        out: list[memoryview] = []
        for page in self.get(keys):
            if page is None:
                break
            out.append(page)
        return out

    def set(self, keys: Sequence[str], payloads: Sequence[bytes | bytearray | memoryview]) -> list[bool]:
        """Frame and store; True where written (False: store down, disk full, too big)."""
        return self.set_framed(keys, [self.frame(p) for p in payloads])

    @staticmethod
    def frame(payload: bytes | bytearray | memoryview) -> bytes:
        """A payload framed with its checksum (a copy: the caller may reuse `payload` now)."""
        return encode_page(payload)

    def set_framed(self, keys: Sequence[str], frames: Sequence[bytes]) -> list[bool]:
        """Store pages framed by `frame` (framing where the payload lives saves a copy)."""
        if len(keys) != len(frames):
            raise ValueError(f"{len(keys)} keys but {len(frames)} payloads")
        if not keys:
            return []
        return self.backend.set(keys, frames)

    def delete(self, keys: Sequence[str]) -> None:
        if keys:
            self.backend.delete(keys)

    def clear(self) -> None:
        self.backend.clear()

    def stats(self) -> dict[str, float]:
        with self._lock:
            corrupt = self._corrupt
        return {**self.backend.stats(), "corrupt_pages": float(corrupt)}

    def close(self) -> None:
        self.backend.close()
