"""KV bookkeeping for requests: the radix tree, the slot allocator and the req->token
table used together. Every slot is owned by exactly one of: the free list, the tree, or
one live request (its `slots[num_tree_tokens:]`); `check_invariants` proves it. With the
hierarchical cache (`hicache`, scheduler/hicache.py) the tree's full pages are also
registered there, evicted slots demote their pages to the host tier, and every host page
is free or held once (checked too).
"""

from __future__ import annotations

from sgl.radix import RadixTree
from sgl.runtime.memory.allocator import ReqToTokenPool, SlotAllocator
from sgl.runtime.scheduler.hicache import HiCache, TierHit
from sgl.runtime.scheduler.req import Req


class KVCache:
    def __init__(self, tree: RadixTree, allocator: SlotAllocator, req_to_token: ReqToTokenPool,
                 hicache: HiCache | None = None) -> None:
        if hicache is not None and tree.disable:
            raise ValueError("the hierarchical cache needs the radix cache (drop --disable-radix-cache)")
        self.tree = tree
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.hicache = hicache

    # -- capacity -------------------------------------------------------------------
    def available(self) -> int:
        """Slots obtainable now: free plus evictable from the tree."""
        return self.allocator.num_free + self.tree.evictable_size()

    def alloc(self, n: int) -> list[int] | None:
        """n slots, evicting unlocked tree leaves if needed; None if impossible."""
        if self.allocator.num_free < n:
            self.tree.evict(n - self.allocator.num_free, self._free_evicted)
        return self.allocator.alloc(n)

    def _free_evicted(self, slots: list[int]) -> None:
        if self.hicache is not None:
            self.hicache.on_device_free(slots)  # demote before the slots can be handed out again
        self.allocator.free(slots)

    # -- admission ------------------------------------------------------------------
    def match_and_lock(self, req: Req, max_match: int) -> int:
        """Attach the longest cached prefix (at most max_match tokens) to req; lock it."""
        key = req.fill_ids[:max_match]
        m = self.tree.match_prefix(key)
        self.tree.inc_lock_ref(m.last_node)
        req.last_node = m.last_node
        req.slots = list(m.values)
        req.num_tree_tokens = len(m.values)
        if self.hicache is not None:
            self.hicache.note_device_hit(req.slots)
        return len(m.values)

    def match_lower_tiers(self, req: Req, max_match: int) -> TierHit:
        """Host / storage pages that continue req's device hit (call after match_and_lock)."""
        if self.hicache is None:
            return TierHit()
        return self.hicache.match(req, req.num_tree_tokens, max_match)

    def attach_row(self, req: Req) -> bool:
        row = self.req_to_token.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        self.req_to_token.write(row, 0, req.slots)
        return True

    def extend(self, req: Req, new_slots: list[int]) -> None:
        assert req.req_pool_idx is not None
        self.req_to_token.write(req.req_pool_idx, len(req.slots), new_slots)
        req.slots.extend(new_slots)

    # -- caching --------------------------------------------------------------------
    def truncate(self, req: Req, keep: int) -> None:
        """Free the request's own slots past `keep` (KV computed for tokens it no longer has)."""
        assert keep >= req.num_tree_tokens, "cannot drop KV the tree owns"
        if keep < len(req.slots):
            self.allocator.free(req.slots[keep:])
            del req.slots[keep:]

    def cache_unfinished(self, req: Req) -> None:
        """After a prefill chunk: share the computed tokens through the tree and move
        the lock to the new deepest node, so later requests (forks, n>1) reuse them."""
        if self.tree.disable:
            return
        n = req.num_computed
        key = req.fill_ids[:n]
        dup = self.tree.insert(key, req.slots)
        # slots[num_tree_tokens:dup] duplicate what the tree already had: free ours.
        if dup > req.num_tree_tokens:
            self.allocator.free(req.slots[req.num_tree_tokens : dup])
        m = self.tree.match_prefix(key)
        assert len(m.values) == n, "tree lost tokens that were just inserted"
        self.tree.inc_lock_ref(m.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = m.last_node
        req.slots = list(m.values)
        req.num_tree_tokens = n
        if req.req_pool_idx is not None:
            self.req_to_token.write(req.req_pool_idx, 0, req.slots)
        if self.hicache is not None:
            self.hicache.note_inserted(req, req.slots)

    def release(self, req: Req) -> None:
        """Finished, aborted or retracted: hand computed KV to the tree (or free it),
        unlock the prefix and give back the table row."""
        if req.draft_slots:  # a step with drafts failed before its update
            self.allocator.free(req.draft_slots)
            req.draft_ids, req.draft_slots = [], []
        n = req.num_computed
        if self.tree.disable:
            self.allocator.free(req.slots[req.num_tree_tokens :])
        else:
            dup = self.tree.insert(req.fill_ids[:n], req.slots)
            if dup > req.num_tree_tokens:
                self.allocator.free(req.slots[req.num_tree_tokens : dup])
            if self.hicache is not None and n >= self.hicache.page_size:
                self.hicache.note_inserted(req, self.tree.match_prefix(req.fill_ids[:n]).values)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        if req.req_pool_idx is not None:
            self.req_to_token.free(req.req_pool_idx)
        req.slots = []
        req.num_tree_tokens = 0
        req.last_node = None
        req.req_pool_idx = None

    def flush(self) -> bool:
        """Drop the whole tree; refused (False) while any node is locked."""
        if self.tree.disable:  # nothing is cached, and live requests hold the root: keep it
            return True
        if self.tree.protected_size() > 0:
            return False
        self.allocator.free(self.tree.all_values())
        self.tree.reset()
        if self.hicache is not None:
            self.hicache.flush()
        return True

    def check_invariants(self, live: list[Req]) -> None:
        self.tree.check_invariants()
        owned = list(self.tree.all_values())
        if self.hicache is not None:
            self.hicache.check_invariants(set(owned))
        for r in live:
            owned.extend(r.slots[r.num_tree_tokens :])
        self.allocator.check_invariants(owned)
