"""`kv_aware`: route by what each worker *holds* (its KV events), traded against its load.

For a request with token ids, each candidate worker W gets

    cost(W) = w * uncached_prefill_tokens(W) + load(W)

    uncached_prefill_tokens(W) = num_prompt_tokens - num_cached_tokens(W)
    num_cached_tokens(W)       = page_size * (leading pages of the prompt's hash chain W holds,
                                 or is computing now for a request this router sent it)
    load(W)                    = W's queued prefill work net of its cache + 8 per running
                                 request (GET /get_load, polled; see load_monitor.py)
                                 + uncached prompt tokens this router sent W since that poll

and the cheapest wins (ties: fewer in flight, then candidate order). Both terms are in
tokens of work standing between the request and its first token on W: its own prefill
that the cache does not cover, and everything W has to get through first. w weighs the
first against the second, and it is large (default 16) for two reasons. An uncached
prefill costs W more than its time: its new pages *evict* other prefixes from W's small
pool (later misses for other tenants), while a queue drains and is forgotten. And
`/get_load`'s running tokens count a decoding request's whole context, although the
work it still stands for is a few decode steps, so load overstates the wait.
`benchmarks/kv_aware_weight.py` (the real class on a simulated 3-worker, 16-tenant,
600-token-system-prompt workload, 4096-token pools, step costs estimated, not calibrated)
measured, at 20 req/s (saturation):
w=1 hit rate 0.39 / TTFT p99 2.49 s, w=4 0.71 / 0.49 s, w=8 0.81 / 0.44 s, w=16 0.84 /
0.40 s, w=32 the same as 16 (round robin 0.32 / 3.90 s); lighter rates rank the same.
Above ~16 the load term only breaks ties and still spills a prefix to another worker when
the holder is more than w x (its saved tokens) behind. A skewed (one hot tenant) load was
not measured.

Which worker holds what: `KvIndex`, fed by one `KvEventSubscriber` per worker (endpoints
from its `/get_server_info` `kv_events` entry, fetched by the policy, retried until it
answers). A worker is scored *approximately* — by a prefix tree of what
this router sent it (`PrefixTrees`, capped at the worker's `max_total_tokens`, LRU) —
while its events cannot be trusted: it publishes none, its stream has been silent for
`kv_events_stale_secs` (the worker heartbeats about once a second), or it cleared its
cache (AllBlocksCleared) or we lost events within `kv_events_cleared_grace_secs`. The
approximate trees are fed with every routed request, so they are warm when needed.
Requests without token ids (a worker without `/get_tokenizer`) are scored approximately
on their text everywhere, in estimated tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import zmq.asyncio

from sgl.kv_events.hashing import page_hashes
from sgl.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from sgl.router.kv_index import KvIndex
from sgl.router.kv_subscriber import EventSource, KvEventSubscriber, LocalEventFeed, event_source
from sgl.router.load_monitor import LoadMonitor
from sgl.router.policies.base import RouteRequest, WorkerState
from sgl.router.policies.options import PolicyOptions
from sgl.router.policies.prefix_trees import PrefixTrees, routing_key
from sgl.router.policies.simple import CHARS_PER_TOKEN, PolicyBase, prompt_tokens

logger = logging.getLogger(__name__)

SERVER_INFO_RETRY_SECS = 1.0
# A routed request's pages count as held by its worker from routing until this long after it
# finished; by then its own BlockStored events (sent after its prefill step) have arrived.
PENDING_GRACE_SECS = 1.0


@dataclass
class _Worker:
    state: WorkerState
    source: EventSource | None = None
    no_events: bool = False  # the worker said it publishes none
    subscriber: KvEventSubscriber | LocalEventFeed | None = None
    distrust_until: float = 0.0  # monotonic; approximate scoring until then
    tree_cap: int | None = None  # the worker's KV pool size, in tokens
    task: asyncio.Task[None] | None = None


class KvAwarePolicy(PolicyBase):
    name = "kv_aware"

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self.index = KvIndex()
        self.trees = PrefixTrees(self.options.max_tree_size)
        self.monitor = LoadMonitor(self.options.load_poll_interval_secs, self.options.http_timeout_secs,
                                   dict(self.options.worker_headers))
        self._workers: dict[str, _Worker] = {}
        self._inflight_tokens: dict[str, int] = {}
        self._routed: dict[tuple[int, str], int] = {}  # (id(req), url) -> prompt tokens
        # Pages of requests routed but not yet (surely) announced by their worker's events:
        # url -> page hash -> tokens of the live requests computing it; (id(req), url) -> (token,
        # its hashes). An event about a page drops all its holders: they were all routed before
        # the worker spoke, so its word (stored: the index has it; removed: evicted) wins; a
        # request routed later holds the page again. A request's token is unique, so forgetting
        # it later can never touch another request's hold.
        self._pending: dict[str, dict[int, set[int]]] = {}
        self._pending_of: dict[tuple[int, str], tuple[int, list[int]]] = {}
        self._next_token = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._client: httpx.AsyncClient | None = None
        self._evictor: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[None]] = set()  # cancelled connects, subscriber stops: awaited by stop()
        self._started = False
        self.counts = dict.fromkeys(
            ("cache_hits", "cache_misses", "precise_scores", "approx_scores", "events_received",
             "prompt_tokens", "predicted_cached_tokens", "cleared"), 0)

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start load polling, tree eviction and, per worker, event discovery + subscription."""
        if self._started:
            return
        self._started = True
        self._ctx = zmq.asyncio.Context()
        self._client = httpx.AsyncClient(timeout=self.options.http_timeout_secs,
                                         headers=dict(self.options.worker_headers))
        await self.monitor.start()
        for w in self._workers.values():
            self._spawn_connect(w)
        if self.options.eviction_interval_secs > 0:
            self._evictor = asyncio.get_running_loop().create_task(self._evict_loop())

    async def stop(self) -> None:
        """Stop every background task, close the sockets and the HTTP client; idempotent."""
        self._started = False
        tasks = [w.task for w in self._workers.values() if w.task is not None]
        if self._evictor is not None:
            tasks.append(self._evictor)
            self._evictor = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, *self._bg, return_exceptions=True)
        for w in self._workers.values():
            w.task = None
            if w.subscriber is not None:
                await w.subscriber.stop()
                w.subscriber = None
        await self.monitor.stop()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes any socket left open; term() alone could wait forever
            self._ctx = None

    def add_worker(self, worker: WorkerState) -> None:
        if worker.url in self._workers:
            return
        w = self._workers[worker.url] = _Worker(worker)
        self.trees.add(worker.url)
        self.monitor.add_worker(worker.url)
        self._inflight_tokens.setdefault(worker.url, 0)
        if self._started:
            self._spawn_connect(w)

    def remove_worker(self, url: str) -> None:
        w = self._workers.pop(url, None)
        self.index.remove_worker(url)
        self.trees.remove(url)
        self.monitor.remove_worker(url)
        self._inflight_tokens.pop(url, None)
        self._pending.pop(url, None)
        if w is not None:
            if w.task is not None:
                w.task.cancel()
                self._keep(w.task)
            if w.subscriber is not None:
                sub, w.subscriber = w.subscriber, None
                self._keep(asyncio.get_running_loop().create_task(sub.stop()))

    def _keep(self, task: asyncio.Task[None]) -> None:
        """Hold a fire-and-forget task until it ends (the loop keeps only weak references)."""
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # -------------------------------------------------------------- discovery
    def _spawn_connect(self, w: _Worker) -> None:
        w.task = asyncio.get_running_loop().create_task(self._connect(w))

    async def _connect(self, w: _Worker) -> None:
        if w.subscriber is not None:
            return  # fed in-process (attach_local_feed)
        url = w.state.url
        info: object = None
        warned = False
        while info is None:
            try:
                assert self._client is not None
                resp = await self._client.get(f"{url}/get_server_info")
                if resp.status_code == 200:
                    info = resp.json()
                    break
                if not warned:
                    warned = True  # e.g. 401: the workers' key is not the router's
                    logger.warning("GET %s/get_server_info answered %d; retrying (no KV events until it answers)",
                                   url, resp.status_code)
            except (httpx.HTTPError, ValueError) as exc:
                logger.debug("GET %s/get_server_info failed: %s", url, exc)
            await asyncio.sleep(SERVER_INFO_RETRY_SECS)
        if isinstance(info, dict) and isinstance(info.get("max_total_tokens"), int):
            w.tree_cap = info["max_total_tokens"]
        source = event_source(url, info)
        if source is None:
            w.no_events = True
            logger.info("worker %s publishes no KV events: routing to it approximately", url)
            return
        assert self._ctx is not None
        w.source = source
        sub = KvEventSubscriber(
            url, source.endpoint, source.replay_endpoint, source.topic, self._on_batch, self._on_reset, self._ctx
        )
        await sub.start()
        w.subscriber = sub

    def attach_local_feed(self, url: str, page_size: int, max_total_tokens: int | None = None) -> LocalEventFeed:
        """Feed `url`'s events in-process instead of over ZMQ (co-located workers, simulators)."""
        w = self._workers[url]
        w.source = EventSource(endpoint="inproc", replay_endpoint=None, topic="", page_size=page_size)
        w.tree_cap = max_total_tokens
        feed = LocalEventFeed(url, self._on_batch)
        w.subscriber = feed
        return feed

    def _on_batch(self, url: str, batch: KVEventBatch) -> None:
        w = self._workers.get(url)
        if w is None:
            return
        pending = self._pending.get(url)
        for ev in batch.events:
            self.index.apply(url, ev)
            if pending and isinstance(ev, (BlockStored, BlockRemoved)):
                for h in ev.block_hashes:  # the worker has spoken about these pages: the index is the truth
                    pending.pop(h, None)  # drops only the holds made before this event
            if isinstance(ev, AllBlocksCleared):
                self.trees.clear(url)
                self.counts["cleared"] += 1
                w.distrust_until = time.monotonic() + self.options.kv_events_cleared_grace_secs
        self.counts["events_received"] += len(batch.events)

    def _on_reset(self, url: str) -> None:
        """Events were lost for good (or the worker restarted): rebuild the index from now on."""
        self.index.clear(url)
        w = self._workers.get(url)
        if w is not None:
            w.distrust_until = time.monotonic() + self.options.kv_events_cleared_grace_secs

    def is_precise(self, url: str, now: float | None = None) -> bool:
        """Whether `url` is scored from its KV events right now."""
        w = self._workers.get(url)
        if w is None or w.subscriber is None:
            return False
        now = time.monotonic() if now is None else now
        return w.subscriber.silent_for(now) <= self.options.kv_events_stale_secs and now >= w.distrust_until

    # ---------------------------------------------------------------- routing
    def cached_tokens(self, req: RouteRequest, urls: Sequence[str]) -> dict[str, int]:
        """Each worker's (predicted) cached prefix of the request, in tokens."""
        now = time.monotonic()
        key = routing_key(req)
        out: dict[str, int] = {}
        by_page_size: dict[int, list[str]] = {}
        for url in urls:
            w = self._workers.get(url)
            if req.token_ids is not None and w is not None and w.source is not None and self.is_precise(url, now):
                by_page_size.setdefault(w.source.page_size, []).append(url)
                self.counts["precise_scores"] += 1
            else:
                matched = self.trees.match(url, key)
                out[url] = matched if req.token_ids is not None else matched // CHARS_PER_TOKEN
                self.counts["approx_scores"] += 1
        for page_size, group in by_page_size.items():
            assert req.token_ids is not None
            hashes = page_hashes(req.token_ids, page_size)
            pages = self.index.match(hashes, group)
            for url, n in pages.items():
                out[url] = max(n, self._pending_pages(url, hashes)) * page_size
        return out

    def _pending_pages(self, url: str, hashes: Sequence[int]) -> int:
        """Leading pages of `hashes` that requests routed to `url` are computing right now.

        The index learns a prefix only once the worker has prefilled it; without this, a
        tenant's second request arriving during its first one's prefill would look uncached
        everywhere and be spread over the workers.
        """
        pending = self._pending.get(url)
        n = 0
        if pending:
            while n < len(hashes) and pending.get(hashes[n]):
                n += 1
        return n

    def load(self, url: str) -> int:
        reported = self.monitor.load(url)
        return reported if reported is not None else self._inflight_tokens.get(url, 0)

    def costs(self, req: RouteRequest, candidates: Sequence[WorkerState]) -> dict[str, float]:
        """cost(W) for each candidate (see the module docstring); for stats and benchmarks."""
        return self._score(req, candidates)[2]

    def _score(
        self, req: RouteRequest, candidates: Sequence[WorkerState]
    ) -> tuple[int, dict[str, int], dict[str, float]]:
        n = prompt_tokens(req)
        cached = self.cached_tokens(req, [c.url for c in candidates])
        weight = self.options.kv_aware_prefill_weight
        costs = {c.url: weight * max(n - cached[c.url], 0) + self.load(c.url) for c in candidates}
        return n, cached, costs

    def select(self, req: RouteRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        n, cached, costs = self._score(req, candidates)
        chosen = min(candidates, key=lambda c: (costs[c.url], c.in_flight))
        hit = cached[chosen.url]
        self.counts["cache_hits" if hit > 0 else "cache_misses"] += 1
        self.counts["prompt_tokens"] += n
        self.counts["predicted_cached_tokens"] += min(hit, n)
        self._note_routed(req, chosen.url, n, max(n - hit, 0))
        return chosen

    def _note_routed(self, req: RouteRequest, url: str, n: int, uncached: int) -> None:
        key = routing_key(req)
        self.trees.insert(url, key)
        w = self._workers.get(url)
        if w is not None and w.tree_cap is not None and req.token_ids is not None:
            self.trees.evict_to(w.tree_cap, [url])  # the worker cannot hold more than its pool
        self.monitor.note_routed(url, uncached)  # the prefill work it adds, as the worker counts it
        self._inflight_tokens[url] = self._inflight_tokens.get(url, 0) + n
        self._routed[(id(req), url)] = n
        if w is not None and w.source is not None and req.token_ids is not None:
            hashes = page_hashes(req.token_ids, w.source.page_size)
            token, self._next_token = self._next_token, self._next_token + 1
            pending = self._pending.setdefault(url, {})
            for h in hashes:
                pending.setdefault(h, set()).add(token)
            earlier = self._pending_of.pop((id(req), url), None)
            if earlier is not None:  # routed to the same worker again (a retry): one hold is enough
                self._forget_pending(url, *earlier)
            self._pending_of[(id(req), url)] = (token, hashes)

    def on_done(self, req: RouteRequest, worker: WorkerState, ok: bool) -> None:
        n = self._routed.pop((id(req), worker.url), 0)
        if worker.url in self._inflight_tokens:
            self._inflight_tokens[worker.url] = max(0, self._inflight_tokens[worker.url] - n)
        held = self._pending_of.pop((id(req), worker.url), None)
        if held is not None:
            try:
                asyncio.get_running_loop().call_later(PENDING_GRACE_SECS, self._forget_pending, worker.url, *held)
            except RuntimeError:  # no loop (direct use in tests): forget at once
                self._forget_pending(worker.url, *held)

    def _forget_pending(self, url: str, token: int, hashes: list[int]) -> None:
        pending = self._pending.get(url)
        if pending is None:
            return
        for h in hashes:
            holders = pending.get(h)
            if holders is not None:
                holders.discard(token)
                if not holders:
                    del pending[h]

    async def _evict_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.eviction_interval_secs)
            self.trees.evict_to(self.options.max_tree_size)

    def stats(self) -> dict[str, float]:
        now = time.monotonic()
        subs = [w.subscriber for w in self._workers.values() if w.subscriber is not None]
        out = {k: float(v) for k, v in self.counts.items()}
        out.update(
            tree_size=float(self.trees.total_size()),
            index_blocks=float(self.index.num_blocks()),
            stale_workers=float(sum(not self.is_precise(u, now) for u in self._workers)),
            event_gaps=float(sum(s.gaps for s in subs)),
            events_replayed=float(sum(s.replayed for s in subs)),
            event_resets=float(sum(s.resets for s in subs)),
        )
        out.update(self.monitor.stats())
        return out
