"""The global KV index: which worker holds which page, from the workers' own KV events.

Shape: `holders[page_hash] -> {worker url}` plus, per worker, the set of its hashes (to
drop them all on `AllBlocksCleared` or when the worker leaves). A dict is enough — no
tree is needed — because page hashes are *chained* (`sgl.kv_events.hashing`): a page's
hash already names its whole prefix, so "worker W holds page i of this prompt" is one
lookup of the prompt's i-th chain hash, and the radix tree a worker would have is exactly
its hash set with the parent links left implicit. Matching a request walks its own chain
and keeps the workers that hold every page so far; a worker's cached prefix ends at the
first page it lacks (a later page it happens to hold is useless without the earlier ones):

    request pages:    h0    h1    h2    h3
    worker A holds:   h0    h1    h2          -> 3 pages
    worker B holds:   h0          h2          -> 1 page

Hash translation. A worker may hash pages its own way (vLLM does); when a `BlockStored`
carries its pages' tokens we recompute *our* chain from them (parent: our hash of the
worker's parent), so requests hashed by the router always meet the index. A per-worker map
remembers foreign -> ours for later `BlockRemoved`s; `sgl` workers use our chain, so the
map stays empty for them. A 64-bit collision would only mis-score one request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sgl.kv_events.hashing import ROOT_HASH, page_hashes
from sgl.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KvIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._by_worker: dict[str, set[int]] = {}
        self._foreign: dict[str, dict[int, int]] = {}  # worker's hash -> ours, where they differ

    # ----------------------------------------------------------------- events
    def apply(self, url: str, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self.stored(url, event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
        elif isinstance(event, BlockRemoved):
            self.removed(url, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.clear(url)

    def stored(
        self,
        url: str,
        block_hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int] = (),
        block_size: int = 0,
    ) -> None:
        foreign = self._foreign.setdefault(url, {})
        ours: Sequence[int] = block_hashes
        if block_size > 0 and len(token_ids) == block_size * len(block_hashes):
            our_parent = ROOT_HASH if parent is None else foreign.get(parent, parent)
            ours = page_hashes(token_ids, block_size, parent=our_parent)
            for theirs, mine in zip(block_hashes, ours):
                if theirs != mine:
                    foreign[theirs] = mine
        held = self._by_worker.setdefault(url, set())
        for h in ours:
            held.add(h)
            self._holders.setdefault(h, set()).add(url)

    def removed(self, url: str, block_hashes: Iterable[int]) -> None:
        foreign = self._foreign.get(url, {})
        held = self._by_worker.get(url)
        for theirs in block_hashes:
            h = foreign.pop(theirs, theirs)
            if held is not None:
                held.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(url)
                if not holders:
                    del self._holders[h]

    def clear(self, url: str) -> None:
        """Forget everything `url` holds (AllBlocksCleared, a lost stream, the worker leaving)."""
        for h in self._by_worker.pop(url, set()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(url)
                if not holders:
                    del self._holders[h]
        self._foreign.pop(url, None)

    remove_worker = clear

    # ------------------------------------------------------------------ query
    def match(self, hashes: Sequence[int], urls: Iterable[str]) -> dict[str, int]:
        """Pages of the chain `hashes` each of `urls` holds, counted from the first page."""
        result = dict.fromkeys(urls, 0)
        alive = set(result)
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for url in alive:
                result[url] = i + 1
        return result

    def num_blocks(self, url: str | None = None) -> int:
        if url is not None:
            return len(self._by_worker.get(url, ()))
        return sum(len(s) for s in self._by_worker.values())

    def check_invariants(self) -> None:
        recount: dict[int, set[str]] = {}
        for url, hashes in self._by_worker.items():
            for h in hashes:
                recount.setdefault(h, set()).add(url)
        assert recount == self._holders, "holders and per-worker sets disagree"
