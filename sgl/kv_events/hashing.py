"""The page hash chain: the identity of a fixed-size token page *and everything before it*.

A prompt is cut into pages of `page_size` tokens from its first token; only full pages
get a hash. Page i's hash depends on page i-1's hash and page i's tokens, so equal hashes
mean equal prefixes, and a router can match a request page by page without the tokens::

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]     (page_size 16; the tail is not a page)
    hashes:   h0=H(ROOT, p0)  h1=H(h0, p1)            no hash for the partial tail

H(parent, tokens) = first 8 bytes (big-endian, unsigned) of BLAKE2b-64 over
``parent.to_bytes(8, "big") + b"".join(t.to_bytes(4, "little") for t in tokens)``, with
ROOT = 0. It is deterministic across processes and machines (no Python `hash`, no seed),
so every worker and every router agree on it; `namespace` (model identity, optional)
changes ROOT so two models never share hashes.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

ROOT_HASH = 0


def root_hash(namespace: str = "") -> int:
    """The parent of page 0: 0, or a hash of `namespace` to keep models apart."""
    if not namespace:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "big")


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    data = array("I", tokens)  # 4-byte unsigned on every platform Python supports here
    if sys.byteorder != "little":
        data.byteswap()
    digest = hashlib.blake2b(parent.to_bytes(8, "big") + data.tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def page_hashes(tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH, start_page: int = 0) -> list[int]:
    """Hashes of the full pages of `tokens` from page `start_page` (whose parent is `parent`)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    out: list[int] = []
    for lo in range(start_page * page_size, len(tokens) - page_size + 1, page_size):
        parent = page_hash(parent, tokens[lo : lo + page_size])
        out.append(parent)
    return out
