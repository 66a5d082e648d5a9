"""The hierarchical KV cache's scheduler side: which KV pages live below the device
pool (host RAM, storage), when they are copied there (write policy), and which of them a
new request loads back instead of recomputing. Plain data only; the copies it decides
travel in the step plan and run on every rank (memory/host_pool.py).

Pages. A page is `page_size` tokens at a page-aligned position of a request's
`fill_ids`, named by its chained hash (sgl.kv_events.hashing). Only full pages go below
the device pool; a partial tail is recomputed. The radix tree stays a pure token -> slot
map: a full page whose tokens the tree holds is registered here under the slot of its
*last* token (`device_pages`), because the tree frees leaves first, so a page leaves the
device exactly when that slot is evicted; that is when write_back demotes it.

    fill_ids   |-- page 0 --|-- page 1 --|-- page 2 --|-- tail --|
    device hit |<------ d ------>|                                 (tree, locked)
    host hit                     |.. page 1 from d ..|-- page 2 --|  (loads: host -> fresh slots)
    storage hit                                                       (fills: bytes -> host, then loads)

Write policies: write_through stores a page to host when the tree takes it;
write_through_selective when a request has hit it `selective_threshold` times on the
device; write_back when it is evicted from the device. Under all but selective, an
evicted page not yet in host is stored then, so eviction demotes instead of dropping.
The host tier drops least-recently-used pages (storage keeps its own copy).

KV events (`--kv-events-config`) describe the device tree only: a demotion is the
device eviction it is (`BlockRemoved` in the device medium), a promotion is the insert
that follows the load (`BlockStored`). Host and storage pages are not announced: the
routers that consume these events (ours, sglang-router) index pages by hash and ignore
`medium`, and a page is often in both tiers at once (write_through), so a host drop's
`BlockRemoved` would erase a page the device still holds. The page hashes here are the
events' chain (same root), so a medium-aware consumer can be added later without
renaming anything (SGLang's names would be "CPU_TIER1" / "CPU_TIER2").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl.kv_events.hashing import page_hashes
from sgl.runtime.memory.host_pages import HostPages
from sgl.runtime.scheduler.req import Req

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass
class TierHit:
    """What a request takes from below the device pool at admission: `loads` are
    (host page, first token in the page, number of tokens), in prompt order."""

    loads: list[tuple[int, int, int]] = field(default_factory=list)
    host_tokens: int = 0
    storage_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.host_tokens + self.storage_tokens


class HiCache:
    def __init__(self, page_size: int, num_host_pages: int, write_policy: str = "write_through",
                 selective_threshold: int = 2, storage: Any = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {', '.join(WRITE_POLICIES)}; got {write_policy!r}")
        self.page_size = page_size
        self.write_policy = write_policy
        self.selective_threshold = selective_threshold
        self.host = HostPages(num_host_pages)
        self.storage = storage  # scheduler/storage_tier.py's StorageTier, or None
        # last slot of a tree-held full page -> [page hash, its slots, device hits]
        self.device_pages: dict[int, list[Any]] = {}
        # copies decided since the last plan (taken into it by `take_copies`)
        self.stores: list[tuple[int, list[int]]] = []
        self.loads: list[tuple[int, int, list[int]]] = []
        self.fills: list[tuple[int, bytes | memoryview]] = []
        self.stored_hashes: list[tuple[int, int]] = []  # (host page, hash) of this plan's stores
        # request uid -> hashes of the pages its lookups brought up from storage: a request
        # that waits for pool room after its fills finds them in host next time; they still
        # count as storage hits
        self._filled: dict[int, set[int]] = {}
        self.stats: dict[str, float] = {
            "hicache_device_hit_tokens": 0, "hicache_host_hit_tokens": 0, "hicache_storage_hit_tokens": 0,
            "hicache_pages_stored": 0, "hicache_pages_loaded": 0, "hicache_pages_demoted": 0,
        }

    # -- page names ---------------------------------------------------------------------
    def hashes(self, req: Req, num_tokens: int) -> list[int]:
        """Hashes of the full pages of fill_ids[:num_tokens]. Prompt pages are cached on the
        request; pages reaching into the output are rehashed (jump-forward may edit it)."""
        P = self.page_size
        n_pages = num_tokens // P
        prompt_pages = len(req.input_ids) // P
        cached = req.page_hashes
        if len(cached) < min(n_pages, prompt_pages):
            parent = cached[-1] if cached else 0
            cached.extend(page_hashes(req.input_ids[: min(n_pages, prompt_pages) * P], P, parent, len(cached)))
        if n_pages <= prompt_pages:
            return cached[:n_pages]
        parent = cached[-1] if cached else 0
        return cached + page_hashes(req.fill_ids[: n_pages * P], P, parent, len(cached))

    # -- device pages and write policies --------------------------------------------------
    def note_inserted(self, req: Req, tree_slots: list[int]) -> None:
        """The tree holds fill_ids[:len(tree_slots)] in `tree_slots`: register its full pages."""
        P = self.page_size
        n_pages = len(tree_slots) // P
        if n_pages == 0:
            return
        hashes: list[int] | None = None
        for k in range(n_pages):
            last = tree_slots[(k + 1) * P - 1]
            if last in self.device_pages:
                continue
            if hashes is None:
                hashes = self.hashes(req, n_pages * P)
            entry = [hashes[k], tree_slots[k * P : (k + 1) * P], 0]
            self.device_pages[last] = entry
            if self.write_policy == "write_through":
                self._store(entry)

    def note_device_hit(self, tree_slots: list[int]) -> None:
        """A request matched these tree slots: count a hit on each full page (selective)."""
        if self.write_policy != "write_through_selective":
            return
        P = self.page_size
        for k in range(len(tree_slots) // P):
            entry = self.device_pages.get(tree_slots[(k + 1) * P - 1])
            if entry is not None:
                entry[2] += 1
                if entry[2] >= self.selective_threshold:
                    self._store(entry)

    def on_device_free(self, slots: list[int]) -> None:
        """Tree slots are being evicted: demote the pages whose last slot is among them."""
        for s in slots:
            entry = self.device_pages.pop(s, None)
            if entry is None:
                continue
            if self.write_policy == "write_through_selective" and entry[2] < self.selective_threshold:
                continue
            if self._store(entry):
                self.stats["hicache_pages_demoted"] += 1

    def _store(self, entry: list[Any]) -> bool:
        page = self.host.put(entry[0])
        if page is None:  # already there (refresh it) or every page is busy
            self.host.lookup(entry[0:1])
            return False
        self.host.pin([page])
        self.stores.append((page, list(entry[1])))
        self.stored_hashes.append((page, entry[0]))
        self.stats["hicache_pages_stored"] += 1
        return True

    # -- admission ------------------------------------------------------------------------
    def on_arrival(self, req: Req) -> None:
        """Start looking up the prompt's pages beyond the host tier's in storage."""
        if self.storage is None:
            return
        hashes = self.hashes(req, max(0, len(req.input_ids) - 1))
        start = 0
        while start < len(hashes) and hashes[start] in self.host:
            start += 1
        self.storage.start_prefetch(req.uid, hashes, start)

    def on_finish(self, req: Req) -> None:
        self._filled.pop(req.uid, None)
        if self.storage is not None:
            self.storage.forget(req.uid)

    def storage_pending(self, req: Req) -> bool:
        """True while the prefetch policy says to keep `req` waiting for storage."""
        return self.storage is not None and self.storage.must_wait(req.uid)

    def match(self, req: Req, device_tokens: int, max_tokens: int) -> TierHit:
        """Host (then storage) pages continuing the device hit, within fill_ids[:max_tokens]."""
        P = self.page_size
        hit = TierHit()
        k0 = device_tokens // P
        hashes = self.hashes(req, max_tokens)
        if k0 >= len(hashes):
            self._drop_prefetch(req)
            return hit
        pages = self.host.lookup(hashes[k0:])
        # Pinned as they are taken: a fill below evicts the LRU unpinned page, which must
        # never be one this request already loads from (two loads, one page's bytes).
        self.host.pin(pages)
        filled = self._filled.get(req.uid, set())
        first = device_tokens - k0 * P
        for h, page in zip(hashes[k0:], pages):
            hit.loads.append((page, first, P - first))
            if h in filled:
                hit.storage_tokens += P - first
            else:
                hit.host_tokens += P - first
            first = 0
        k = k0 + len(pages)
        if self.storage is not None and k < len(hashes):
            for h, blob in zip(hashes[k:], self.storage.take(req.uid, k)):
                free = self.host.put(h)
                if free is None:
                    break
                self.host.pin([free])
                self.fills.append((free, blob))  # committed now: the index already names the page
                self._filled.setdefault(req.uid, set()).add(h)
                hit.loads.append((free, first, P - first))
                hit.storage_tokens += P - first
                first = 0
        else:
            self._drop_prefetch(req)
        return hit

    def _drop_prefetch(self, req: Req) -> None:
        """A match that needs nothing from storage ends the request's lookup: its reader
        stops and the pages it fetched are freed now, not when the request finishes."""
        if self.storage is not None:
            self.storage.forget(req.uid)

    def commit(self, hit: TierHit, slots: list[int]) -> None:
        """The request was admitted with `slots[:hit.num_tokens]` for the loaded tokens."""
        i = 0
        for page, first, n in hit.loads:
            self.loads.append((page, first, slots[i : i + n]))
            i += n
        self.stats["hicache_pages_loaded"] += len(hit.loads)
        self.stats["hicache_host_hit_tokens"] += hit.host_tokens
        self.stats["hicache_storage_hit_tokens"] += hit.storage_tokens

    # -- plans ----------------------------------------------------------------------------
    def take_copies(self) -> tuple[list[tuple[int, list[int]]], list[tuple[int, int, list[int]]],
                                   list[tuple[int, bytes | memoryview]], list[tuple[int, int]]]:
        """(stores, loads, fills, stored (page, hash)) for the next plan; unpins: once the
        plan runs, nothing pending reads or writes a host page any more."""
        out = (self.stores, self.loads, self.fills, self.stored_hashes)
        self.stores, self.loads, self.fills, self.stored_hashes = [], [], [], []
        self.host.unpin_all()
        return out

    def has_copies(self) -> bool:
        return bool(self.stores or self.loads or self.fills)

    def flush(self) -> None:
        """Drop the device registrations and the host tier (the tree was just flushed)."""
        self.device_pages.clear()
        self.stores, self.loads, self.fills, self.stored_hashes = [], [], [], []
        self.host.clear()

    def check_invariants(self, tree_slots: set[int]) -> None:
        self.host.check_invariants()
        for last, (_, slots, _) in self.device_pages.items():
            assert slots[-1] == last and len(slots) == self.page_size, "bad device page entry"
            assert set(slots) <= tree_slots, "a registered device page has slots the tree does not hold"

    def snapshot(self, page_nbytes: int) -> dict[str, Any]:
        s: dict[str, Any] = dict(self.stats)
        s.update({
            "hicache_page_size": self.page_size,
            "hicache_write_policy": self.write_policy,
            "hicache_host_pages_total": self.host.num_pages,
            "hicache_host_pages_used": self.host.num_used,
            "hicache_host_tokens_total": self.host.num_pages * self.page_size,
            "hicache_host_tokens_used": self.host.num_used * self.page_size,
            "hicache_host_usage": self.host.num_used / self.host.num_pages,
            "hicache_host_pages_dropped": self.host.num_dropped,
            "hicache_bytes_stored": s["hicache_pages_stored"] * page_nbytes,
            "hicache_bytes_loaded": s["hicache_pages_loaded"] * page_nbytes,
        })
        if self.storage is not None:
            s.update(self.storage.snapshot())
        return s
