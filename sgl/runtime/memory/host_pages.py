"""Bookkeeping of the host KV tier (no tensors): which host page holds which KV page.

The host tier is content-addressed. A KV page is `page_size` tokens at a page-aligned
position of some token stream, named by its chained page hash (`sgl.kv_events.hashing`),
which covers the page *and everything before it*; so a prompt's host hits are the
longest run of its page hashes present here, from wherever the device hit ends. The same
names key the storage tier (L3), so a page moves host <-> storage unchanged.

Pages are dropped least-recently-used first. A page that an unexecuted copy still
reads or writes is pinned (`pin`) until the plan carrying that copy has run (`unpin_all`),
so it is never handed out twice in between.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class HostPages:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the host KV tier needs at least one page")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._index: OrderedDict[int, int] = OrderedDict()  # page hash -> host page, LRU first
        self._pinned: set[int] = set()
        self.num_dropped = 0  # pages evicted to make room

    @property
    def num_used(self) -> int:
        return len(self._index)

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self._index

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Host pages of the longest run of `hashes` held here, from the first (marked used)."""
        out: list[int] = []
        for h in hashes:
            page = self._index.get(h)
            if page is None:
                break
            self._index.move_to_end(h)
            out.append(page)
        return out

    def put(self, page_hash: int) -> int | None:
        """A host page for `page_hash` (the caller fills it), evicting the LRU unpinned
        page if none is free; None when it is already held or every page is pinned."""
        if page_hash in self._index:
            return None
        if not self._free:
            for h, page in self._index.items():
                if page not in self._pinned:
                    del self._index[h]
                    self._free.append(page)
                    self.num_dropped += 1
                    break
            else:
                return None
        page = self._free.pop()
        self._index[page_hash] = page
        return page

    def discard(self, pages: Iterable[int]) -> None:
        """These host pages hold nothing valid (their copy never ran): free them."""
        gone = set(pages)
        if gone:
            for h in [h for h, page in self._index.items() if page in gone]:
                self._free.append(self._index.pop(h))

    def pin(self, pages: Iterable[int]) -> None:
        self._pinned.update(pages)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def clear(self) -> None:
        self._index.clear()
        self._pinned.clear()
        self._free = list(range(self.num_pages - 1, -1, -1))

    def check_invariants(self) -> None:
        """Every host page is either free or held by exactly one page hash."""
        held = list(self._index.values())
        assert len(set(held)) == len(held), "a host page is held under two hashes"
        assert len(set(self._free)) == len(self._free), "a host page is on the free list twice"
        both = set(held) & set(self._free)
        assert not both, f"host pages both free and held: {sorted(both)[:10]}"
        assert len(held) + len(self._free) == self.num_pages, "a host page is neither free nor held"
