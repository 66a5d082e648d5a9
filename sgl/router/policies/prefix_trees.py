"""Approximate per-worker prefix trees: what the router *sent* each worker, not what it holds.

SGLang's router guesses a worker's cache from the prompts it routed there; this is that
guess, one `sgl.radix.RadixTree` per worker. Keys are token ids when the router knows them,
else the text's code points stored as negative ints (`-(ord(c) + 1)`), so a text key can
never collide with a token-id key in the same tree. Values are unique dummy slots (the tree
wants one per token; nothing reads them), which keeps `check_invariants()` meaningful.

Matching does not go through `RadixTree.match_prefix`, which splits edges and refreshes LRU
stamps: asking "how much of this would worker B have?" must not make B's entries younger
when the request then goes to A. Only `insert` (the worker really received it) touches LRU.
Sizes are in keys (tokens or characters), like sglang-router's `--max-tree-size`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sgl.radix import RadixTree

from sgl.router.policies.base import RouteRequest


def routing_key(req: RouteRequest) -> list[int]:
    if req.token_ids is not None:
        return list(req.token_ids)
    return [-(ord(c) + 1) for c in req.text]


class PrefixTrees:
    def __init__(self, max_size: int | None = None) -> None:
        # A tree past twice `max_size` keys is trimmed to it at once: the periodic eviction
        # alone let a busy router's trees grow with the request rate between its ticks.
        self.max_size = max_size
        self._trees: dict[str, RadixTree] = {}
        self._next_slot = 0
        self.evicted = 0  # keys evicted, ever

    def add(self, url: str) -> None:
        self._trees.setdefault(url, RadixTree())

    def remove(self, url: str) -> None:
        self._trees.pop(url, None)

    def clear(self, url: str) -> None:
        if url in self._trees:
            self._trees[url] = RadixTree()

    def tree(self, url: str) -> RadixTree:
        t = self._trees.get(url)
        if t is None:
            t = self._trees[url] = RadixTree()
        return t

    def match(self, url: str, key: Sequence[int]) -> int:
        t = self._trees.get(url)
        return 0 if t is None else t.prefix_len(key)

    def size(self, url: str) -> int:
        t = self._trees.get(url)
        return 0 if t is None else t.total_size()

    def total_size(self) -> int:
        return sum(t.total_size() for t in self._trees.values())

    def insert(self, url: str, key: Sequence[int]) -> None:
        if not key:
            return
        start = self._next_slot
        self._next_slot += len(key)  # the tree keeps only the new tail's slots
        t = self.tree(url)
        t.insert(key, range(start, start + len(key)))
        if self.max_size is not None and t.total_size() > 2 * self.max_size:
            self.evict_to(self.max_size, [url])

    def evict_to(self, max_size: int, urls: Iterable[str] | None = None) -> int:
        """LRU-evict every tree down to `max_size` keys; return keys evicted."""
        freed = 0
        for url in list(urls if urls is not None else self._trees):
            t = self._trees.get(url)
            if t is not None and t.total_size() > max_size:
                freed += t.evict(t.total_size() - max_size, _ignore)
        self.evicted += freed
        return freed


def _ignore(_slots: list[int]) -> None:
    pass
