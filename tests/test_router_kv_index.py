"""The KV index and the kv_aware policy, fed over real ZMQ sockets by a tiny publisher.

The publisher here speaks the worker's wire protocol (sgl.kv_events.wire): PUB multipart
(topic, seq, payload) and a ROUTER replay socket answering (b"", start_seq) with every kept
batch from start_seq and an end mark. It can "drop" a batch (keep it for replay but never
publish it) to make a sequence gap. Worker metadata (/get_server_info, /get_load) comes
from a real HTTP server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
import zmq
import zmq.asyncio

from sgl.kv_events.hashing import ROOT_HASH, page_hashes
from sgl.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from sgl.router.kv_index import KvIndex
from sgl.router.kv_subscriber import event_source
from sgl.router.policies import PolicyOptions, RouteRequest, WorkerState, make_policy
from sgl.router.policies.kv_aware import KvAwarePolicy
from tests.json_http import JsonServer

PAGE = 16
TOPIC = "kv-events"


def stored(tokens: list[int], parent: int | None = None, start_page: int = 0) -> BlockStored:
    hashes = page_hashes(tokens, PAGE, parent if parent is not None else ROOT_HASH)
    return BlockStored(hashes, parent, tokens, PAGE, None, "cpu")


# ------------------------------------------------------------------ pure index
def test_index_match_store_remove_clear() -> None:
    idx = KvIndex()
    p = list(range(100, 164))  # 4 pages
    h = page_hashes(p, PAGE)
    idx.apply("A", stored(p))
    idx.apply("B", stored(p[:32]))
    assert idx.match(h, ["A", "B", "C"]) == {"A": 4, "B": 2, "C": 0}
    idx.apply("A", BlockRemoved([h[1]], "cpu"))  # a hole: pages after it are useless
    assert idx.match(h, ["A", "B"]) == {"A": 1, "B": 2}
    # Continuation stored with a parent: chained from it.
    idx.apply("B", stored(p[32:], parent=h[1]))
    assert idx.match(h, ["B"]) == {"B": 4}
    idx.check_invariants()
    idx.apply("B", AllBlocksCleared())
    assert idx.match(h, ["A", "B"]) == {"A": 1, "B": 0}
    assert idx.num_blocks("B") == 0 and idx.num_blocks() == 3
    idx.check_invariants()


def test_index_translates_foreign_hashes() -> None:
    """A worker hashing its own way (vLLM) is indexed under our chain, via the page tokens."""
    idx = KvIndex()
    p = list(range(7, 7 + 48))
    ours = page_hashes(p, PAGE)
    theirs = [111, 222, 333]
    idx.apply("V", BlockStored(theirs[:2], None, p[:32], PAGE, None, None))
    idx.apply("V", BlockStored(theirs[2:], theirs[1], p[32:], PAGE, None, None))
    assert idx.match(ours, ["V"]) == {"V": 3}
    idx.apply("V", BlockRemoved([333], None))
    assert idx.match(ours, ["V"]) == {"V": 2}
    idx.check_invariants()


def test_event_source_from_server_info() -> None:
    info = {"kv_events": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://0.0.0.0:5558",
                          "topic": "kv", "page_size": 16, "data_parallel_rank": 0}}
    src = event_source("http://10.1.2.3:30000", info)
    assert src is not None
    assert (src.endpoint, src.replay_endpoint, src.topic, src.page_size) == (
        "tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558", "kv", 16)
    assert event_source("http://h:1", {"kv_events": None}) is None
    assert event_source("http://h:1", {}) is None
    assert event_source("http://h:1", {"kv_events": {"endpoint": "tcp://*:1", "page_size": 0}}) is None
    kept = event_source("http://h:1", {"kv_events": {"endpoint": "tcp://other:9", "page_size": 4}})
    assert kept is not None and kept.endpoint == "tcp://other:9" and kept.replay_endpoint is None


# ------------------------------------------------------------------ a tiny worker
class TinyPublisher:
    """PUB + ROUTER replay, on the test's event loop."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests = 0
        self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, events: list, drop: bool = False, keep: bool = True) -> None:
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events))
        if keep:
            self.buffer.append((self.seq, payload))
        if not drop:
            await self.pub.send_multipart([TOPIC.encode(), encode_seq(self.seq), payload])
        self.seq += 1

    async def _serve_replay(self) -> None:
        while True:
            ident, _empty, start = await self.router.recv_multipart()
            self.replay_requests += 1
            for seq, payload in self.buffer:
                if seq >= decode_seq(start):
                    await self.router.send_multipart([ident, b"", encode_seq(seq), payload])
            await self.router.send_multipart([ident, b"", encode_seq(-1), b""])

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self.pub.close(linger=0)
        self.router.close(linger=0)


class InfoServer(JsonServer):
    """A real HTTP server with a worker's /get_server_info and /get_load."""

    def __init__(self) -> None:
        self.info: object = {"kv_events": None}
        self.load = {"num_waiting_tokens": 0, "num_running_tokens": 0}
        super().__init__(self._answer)

    def _answer(self, path: str, headers: object) -> tuple[int, object] | None:
        body = {"/get_server_info": self.info, "/get_load": self.load}.get(path)
        return None if body is None else (200, body)


@pytest.fixture
def info_servers() -> Iterator[list[InfoServer]]:
    servers = [InfoServer() for _ in range(2)]
    yield servers
    for s in servers:
        s.close()


async def until(cond: Callable[[], bool], what: str, limit: float = 15.0) -> None:
    """Wait for a condition the background tasks bring about (a bound, not a timing test)."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.01)


async def heartbeat_until(pub: TinyPublisher, cond: Callable[[], bool], what: str) -> None:
    """Publish empty batches (the worker's idle heartbeat) until `cond` (the SUB socket joins late)."""
    deadline = time.monotonic() + 15
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await pub.publish([])
        await asyncio.sleep(0.02)


def run(body: Callable[..., Awaitable[None]], *args: object) -> None:
    asyncio.run(body(*args))


PROMPT = list(range(1000, 1080))  # 5 pages of 16
REQ = RouteRequest("/generate", "", PROMPT + [1, 2, 3])


async def _setup(info_servers: list[InfoServer], **opts: object):
    ctx = zmq.asyncio.Context()
    pubs = [TinyPublisher(ctx) for _ in info_servers]
    for srv, pub in zip(info_servers, pubs):
        srv.info = {"max_total_tokens": 4096, "kv_events": {
            "endpoint": f"tcp://*:{pub.port}", "replay_endpoint": f"tcp://0.0.0.0:{pub.replay_port}",
            "topic": TOPIC, "page_size": PAGE, "data_parallel_rank": 0}}
    options = PolicyOptions(load_poll_interval_secs=0.02, **opts)  # type: ignore[arg-type]
    policy = make_policy("kv_aware", options)
    assert isinstance(policy, KvAwarePolicy)
    ws = [WorkerState(s.url) for s in info_servers]
    for w in ws:
        policy.add_worker(w)
    await policy.start()
    for w, pub in zip(ws, pubs):
        await heartbeat_until(pub, lambda w=w: policy.is_precise(w.url), f"{w.url} subscribed")
    await until(lambda: all(policy.monitor.load(w.url) is not None for w in ws), "loads polled")
    return ctx, pubs, policy, ws


async def _teardown(ctx: zmq.asyncio.Context, pubs: list[TinyPublisher], policy: KvAwarePolicy) -> None:
    await policy.stop()
    for p in pubs:
        await p.close()
    ctx.term()


# ------------------------------------------------------------------ kv_aware over ZMQ
def test_kv_aware_follows_events_removals_and_clears(info_servers: list[InfoServer]) -> None:
    async def body() -> None:
        ctx, (pa, pb), policy, (a, b) = await _setup(info_servers)
        try:
            # B holds the prompt's 5 pages (the router never sent it anything).
            await pb.publish([stored(PROMPT)])
            await until(lambda: policy.index.num_blocks(b.url) == 5, "B's pages indexed")
            assert policy.cached_tokens(REQ, [a.url, b.url]) == {a.url: 0, b.url: 80}
            assert policy.select(REQ, [a, b]) is b
            policy.on_done(REQ, b, True)
            # B evicts pages 3..4: 48 cached tokens, still the better choice.
            await pb.publish([BlockRemoved(page_hashes(PROMPT, PAGE)[3:], "cpu")])
            await until(lambda: policy.index.num_blocks(b.url) == 3, "removal applied")
            assert policy.cached_tokens(REQ, [a.url, b.url])[b.url] == 48
            # A holds all of it: A wins now.
            await pa.publish([stored(PROMPT)])
            await until(lambda: policy.index.num_blocks(a.url) == 5, "A's pages indexed")
            assert policy.select(REQ, [a, b]) is a
            policy.on_done(REQ, a, True)
            # A clears its cache: not trusted for the grace period, scored by its tree
            # (which was cleared too), so it is back to 0 cached tokens.
            await pa.publish([AllBlocksCleared()])
            await until(lambda: not policy.is_precise(a.url), "A distrusted after clear")
            assert policy.index.num_blocks(a.url) == 0
            assert policy.cached_tokens(REQ, [a.url, b.url]) == {a.url: 0, b.url: 48}
            s = policy.stats()
            assert s["events_received"] >= 3 and s["cleared"] == 1 and s["stale_workers"] == 1
            assert s["cache_hits"] == 2
        finally:
            await _teardown(ctx, [pa, pb], policy)

    run(body)


def test_kv_aware_gap_is_replayed(info_servers: list[InfoServer]) -> None:
    async def body() -> None:
        ctx, pubs, policy, (a, b) = await _setup(info_servers)
        pa = pubs[0]
        try:
            await pa.publish([stored(PROMPT[:32])], drop=True)  # never reaches the SUB socket
            await pa.publish([stored(PROMPT[32:80], parent=page_hashes(PROMPT, PAGE)[1])])
            await until(lambda: policy.index.num_blocks(a.url) == 5, "gap replayed")
            assert policy.cached_tokens(REQ, [a.url])[a.url] == 80
            s = policy.stats()
            assert s["event_gaps"] >= 1 and s["events_replayed"] >= 1 and s["event_resets"] == 0
            assert policy.is_precise(a.url)
        finally:
            await _teardown(ctx, pubs, policy)

    run(body)


def test_kv_aware_unreplayable_gap_resets_worker(info_servers: list[InfoServer]) -> None:
    async def body() -> None:
        ctx, pubs, policy, (a, b) = await _setup(info_servers, kv_events_cleared_grace_secs=0.2)
        pa = pubs[0]
        try:
            await pa.publish([stored(PROMPT)])
            await until(lambda: policy.index.num_blocks(a.url) == 5, "stored")
            # A removal we never see and that the replay buffer lost: the index would lie.
            await pa.publish([BlockRemoved(page_hashes(PROMPT, PAGE), "cpu")], drop=True, keep=False)
            await pa.publish([])
            await until(lambda: policy.stats()["event_resets"] == 1, "reset after a lost batch")
            assert policy.index.num_blocks(a.url) == 0
            # Back to precise after the grace period (heartbeats keep it fresh).
            await heartbeat_until(pa, lambda: policy.is_precise(a.url), "trusted again")
        finally:
            await _teardown(ctx, pubs, policy)

    run(body)


def test_kv_aware_silent_stream_falls_back_to_approximate(info_servers: list[InfoServer]) -> None:
    async def body() -> None:
        ctx, (pa, pb), policy, (a, b) = await _setup(info_servers, kv_events_stale_secs=0.3)
        try:
            await pa.publish([stored(PROMPT)])
            await until(lambda: policy.index.num_blocks(a.url) == 5, "stored")
            await heartbeat_until(pb, lambda: not policy.is_precise(a.url), "A silent, B alive")
            assert policy.is_precise(b.url)
            # A is scored by what we sent it (nothing yet), not by its events.
            assert policy.cached_tokens(REQ, [a.url, b.url]) == {a.url: 0, b.url: 0}
            assert policy.stats()["stale_workers"] == 1
            # Route once to A (put it first): from now on its tree knows the prompt.
            first = policy.select(REQ, [a, b])
            policy.on_done(REQ, first, True)
            cached = policy.cached_tokens(REQ, [first.url])[first.url]
            assert first is a and cached == len(REQ.token_ids or [])
            # A speaks again: precise again.
            await heartbeat_until(pa, lambda: policy.is_precise(a.url), "A back")
            assert policy.cached_tokens(REQ, [a.url])[a.url] == 80
        finally:
            await _teardown(ctx, [pa, pb], policy)

    run(body)


def test_kv_aware_trades_cache_against_reported_load(info_servers: list[InfoServer]) -> None:
    async def body() -> None:
        ctx, (pa, pb), policy, (a, b) = await _setup(info_servers)
        try:
            await pa.publish([stored(PROMPT)])
            await until(lambda: policy.index.num_blocks(a.url) == 5, "stored")
            assert policy.select(REQ, [a, b]) is a  # A holds it, both idle
            policy.on_done(REQ, a, True)
            # A reports a long queue: more than w * the 83 uncached tokens B would need.
            info_servers[0].load = {"num_waiting_tokens": 5000, "num_running_tokens": 0}
            await until(lambda: (policy.monitor.load(a.url) or 0) >= 5000, "load polled")
            assert policy.select(REQ, [a, b]) is b
            costs = policy.costs(REQ, [a, b])
            w = policy.options.kv_aware_prefill_weight
            assert costs[a.url] == pytest.approx(w * 3 + policy.load(a.url))
        finally:
            await _teardown(ctx, [pa, pb], policy)

    run(body)


def test_kv_aware_worker_without_events_is_approximate(info_servers: list[InfoServer]) -> None:
    async def body() -> None:
        policy = make_policy("kv_aware", PolicyOptions(load_poll_interval_secs=0.02))
        assert isinstance(policy, KvAwarePolicy)
        ws = [WorkerState(s.url) for s in info_servers]  # info: {"kv_events": None}
        for w in ws:
            policy.add_worker(w)
        await policy.start()
        try:
            await until(lambda: all(policy._workers[w.url].no_events for w in ws), "discovered")
            first = policy.select(REQ, ws)
            policy.on_done(REQ, first, True)
            again = RouteRequest("/generate", "", PROMPT + [9])
            assert policy.select(again, ws) is first  # the approximate tree remembers
            assert policy.stats()["stale_workers"] == 2
            # A worker removed while running: no error, gone from scoring.
            policy.remove_worker(ws[1].url)
            assert policy.select(again, ws[:1]) is ws[0]
        finally:
            await policy.stop()

    run(body)


def test_kv_aware_counts_pages_in_flight_before_their_events(info_servers: list[InfoServer]) -> None:
    """A tenant's second request, arriving while its first is still being prefilled (no
    BlockStored yet), goes to the same worker instead of being spread by load."""

    async def body() -> None:
        ctx, pubs, policy, (a, b) = await _setup(info_servers)
        try:
            await until(lambda: policy.is_precise(a.url) and policy.is_precise(b.url), "both streams live")
            first = policy.select(REQ, [a, b])
            other = b if first is a else a
            assert policy.cached_tokens(REQ, [a.url, b.url]) == {first.url: 80, other.url: 0}
            second = RouteRequest("/generate", "", PROMPT + [7, 8, 9])
            assert policy.select(second, [a, b]) is first
            # The worker evicts page 4 meanwhile: its word beats the prediction.
            await (pubs[0] if first is a else pubs[1]).publish([BlockRemoved(page_hashes(PROMPT, PAGE)[4:], "cpu")])
            await until(lambda: policy.cached_tokens(REQ, [first.url])[first.url] == 64, "removal overrides")
            policy.on_done(REQ, first, True)
            policy.on_done(second, first, True)
            await until(lambda: policy.cached_tokens(REQ, [first.url])[first.url] == 0, "forgotten after the grace")
        finally:
            await _teardown(ctx, pubs, policy)

    run(body)


def test_kv_aware_pending_pages_are_exact_per_request() -> None:
    """An older request's hold, forgotten after its worker spoke about the pages (stored,
    then evicted), must not cancel a newer request's hold on the same pages."""
    policy = make_policy("kv_aware", PolicyOptions(eviction_interval_secs=0))
    assert isinstance(policy, KvAwarePolicy)
    a = WorkerState("http://a")
    policy.add_worker(a)
    feed = policy.attach_local_feed(a.url, PAGE)
    first = RouteRequest("/generate", "", PROMPT + [1])
    assert policy.select(first, [a]) is a
    assert policy.cached_tokens(REQ, [a.url]) == {a.url: 80}  # in flight: counts as held
    feed.push(KVEventBatch(0.0, [stored(PROMPT)], None))
    feed.push(KVEventBatch(0.0, [BlockRemoved(page_hashes(PROMPT, PAGE), "cpu")], None))
    assert policy.cached_tokens(REQ, [a.url]) == {a.url: 0}  # evicted: the worker's word wins
    second = RouteRequest("/generate", "", PROMPT + [2])
    assert policy.select(second, [a]) is a
    policy.on_done(first, a, True)  # no running loop: forgotten at once
    assert policy.cached_tokens(REQ, [a.url]) == {a.url: 80}  # the second request still holds them
    policy.on_done(second, a, True)
    assert policy.cached_tokens(REQ, [a.url]) == {a.url: 0}
    assert policy._pending == {a.url: {}} and policy._pending_of == {}
