"""`cache_aware`: SGLang router's approximate cache-aware policy (our implementation).

Per request, over the candidate workers, with load = the router's in-flight requests:

1. If the load is imbalanced — `max - min > balance_abs_threshold` AND
   `max > min * balance_rel_threshold`, sglang-router's two-sided test — route to the
   least loaded worker (locality is worth nothing on a worker that is far behind).
2. Else match the routing key against each worker's approximate tree (`PrefixTrees`:
   what the router sent it). If the longest match covers at least `cache_threshold` of
   the key, route to that worker (ties: fewer in flight).
3. Else route to the worker with the smallest tree: the one whose cache we have filled
   least, so new prefixes spread out instead of crowding one worker.

The chosen worker's tree then gets the key, in every branch. Every
`eviction_interval_secs` each tree is LRU-evicted down to `max_tree_size` keys.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from sgl.router.policies.base import RouteRequest, WorkerState
from sgl.router.policies.options import PolicyOptions
from sgl.router.policies.prefix_trees import PrefixTrees, routing_key
from sgl.router.policies.simple import PolicyBase


def is_imbalanced(loads: Sequence[float], abs_threshold: float, rel_threshold: float) -> bool:
    """sglang-router's test: both the absolute and the relative gap must trip."""
    if len(loads) < 2:
        return False
    hi, lo = max(loads), min(loads)
    return hi - lo > abs_threshold and hi > lo * rel_threshold


class CacheAwarePolicy(PolicyBase):
    name = "cache_aware"

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self.trees = PrefixTrees(self.options.max_tree_size)
        self.cache_hits = 0  # routed by the prefix match (step 2)
        self.cache_misses = 0  # routed to the smallest tree (step 3)
        self.balanced = 0  # routed by the imbalance rule (step 1)
        self._evictor: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._evictor is None and self.options.eviction_interval_secs > 0:
            self._evictor = asyncio.get_running_loop().create_task(self._evict_loop())

    async def stop(self) -> None:
        if self._evictor is not None:
            self._evictor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._evictor
            self._evictor = None

    def add_worker(self, worker: WorkerState) -> None:
        self.trees.add(worker.url)

    def remove_worker(self, url: str) -> None:
        self.trees.remove(url)

    def evict_now(self) -> int:
        return self.trees.evict_to(self.options.max_tree_size)

    async def _evict_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.eviction_interval_secs)
            self.evict_now()

    def select(self, req: RouteRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        key = routing_key(req)
        chosen = self._choose(key, candidates)
        self.trees.insert(chosen.url, key)
        return chosen

    def _choose(self, key: list[int], candidates: Sequence[WorkerState]) -> WorkerState:
        o = self.options
        if is_imbalanced([w.in_flight for w in candidates], o.balance_abs_threshold, o.balance_rel_threshold):
            self.balanced += 1
            return min(candidates, key=lambda w: w.in_flight)
        if key:
            best, best_len = None, 0
            for w in candidates:
                n = self.trees.match(w.url, key)
                if n > best_len or (n == best_len and best is not None and w.in_flight < best.in_flight):
                    best, best_len = w, n
            if best is not None and best_len > 0 and best_len / len(key) >= o.cache_threshold:
                self.cache_hits += 1
                return best
        self.cache_misses += 1
        return min(candidates, key=lambda w: (self.trees.size(w.url), w.in_flight))

    def stats(self) -> dict[str, float]:
        return {
            "tree_size": float(self.trees.total_size()),
            "cache_hits": float(self.cache_hits),
            "cache_misses": float(self.cache_misses),
            "balanced": float(self.balanced),
            "evicted": float(self.trees.evicted),
        }
