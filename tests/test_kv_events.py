"""KV cache events in vLLM's wire format, read by a subscriber written here from vLLM's
documented format (its own msgspec structs, pyzmq SUB and a DEALER for replay; nothing
imported from sgl.kv_events.wire, so the tests prove a vLLM-style consumer reads us).

Three layers, all over real ZMQ sockets: the publisher alone (sequence, topic, replay,
heartbeat, drop accounting, connect mode, clean close); the real scheduler with the fake
executor (a random workload under memory pressure: what the subscriber believes held
equals the tree's full pages); the real server (prompt pages, shared prefixes, eviction,
/flush_cache, replay, heartbeat, get_server_info).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Union

import httpx
import msgspec
import pytest
import zmq

from sgl.kv_events.hashing import page_hashes
from sgl.radix import RadixTree, TreeNode
from tests.server_proc import REPO, ServerProc, free_port, group_pids, start_server

# ----------------------------------------------------------------- vLLM's format, declared here


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
END = (-1).to_bytes(8, "big", signed=True)
TOPIC = "kv-events"


def replay(ctx: zmq.Context, endpoint: str, start: int, delimiter: bool = True) -> list[tuple[int, bytes]]:
    """Ask the replay ROUTER for every buffered batch from `start`; (seq, payload) until the end marker."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        head = [b""] if delimiter else []
        sock.send_multipart([*head, start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(30_000), "no replay answer"
            frames = sock.recv_multipart()
            if delimiter:
                assert frames[0] == b""
                frames = frames[1:]
            seq, payload = frames
            if seq == END:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close()


class Stream:
    """A consumer: follows the PUB stream in order (backfilling a late start by replay)
    and keeps the set of pages it believes held, checking each event as it applies it."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str | None, page_size: int) -> None:
        self.ctx = ctx
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.page_size = page_size
        self.payloads: list[bytes] = []  # index = seq
        self.batches: list[KVEventBatch] = []
        self.held: set[int] = set()
        self.announced: set[int] = set()  # ever
        self.removed: set[int] = set()  # ever
        self.stored: list[BlockStored] = []
        self.clears = 0

    def close(self) -> None:
        self.sub.close()

    def pump(self, timeout_ms: int = 100) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq_b, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode() and len(seq_b) == 8
            seq = int.from_bytes(seq_b, "big")
            if seq > len(self.payloads):  # joined late (or missed some): the replay socket has them
                assert self.replay_endpoint is not None, f"missed batches before {seq}"
                for s, p in replay(self.ctx, self.replay_endpoint, len(self.payloads)):
                    if len(self.payloads) == s < seq:
                        self._apply(s, p)
            self._apply(seq, payload)
            timeout_ms = 0

    def wait(self, cond: Callable[[], bool], what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.pump()

    def _apply(self, seq: int, payload: bytes) -> None:
        assert seq == len(self.payloads), f"sequence {seq} after {len(self.payloads) - 1}: not consecutive from 0"
        batch = DECODER.decode(payload)
        self.payloads.append(payload)
        self.batches.append(batch)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == self.page_size and ev.lora_id is None and ev.medium in ("CPU", "GPU")
                assert len(ev.token_ids) == len(ev.block_hashes) * self.page_size
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.held
                parent = 0 if ev.parent_block_hash is None else ev.parent_block_hash
                assert ev.block_hashes == page_hashes(ev.token_ids, self.page_size, parent)
                assert not self.held & set(ev.block_hashes), "a held page announced again"
                self.held |= set(ev.block_hashes)
                self.announced |= set(ev.block_hashes)
                self.stored.append(ev)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= self.held, "removed a page that was not held"
                self.held -= set(ev.block_hashes)
                self.removed |= set(ev.block_hashes)
            else:
                self.held.clear()
                self.clears += 1


def settings(**kw: Any) -> Any:
    from sgl.runtime.kv_events.config import KVEventsSettings

    return KVEventsSettings(**kw)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def subscribe_until_live(ctx: zmq.Context, pub: Any, endpoint: str, replay_ep: str | None = None,
                         page_size: int = 16) -> Stream:
    """A Stream that has seen at least one batch (ZMQ subscriptions take a moment to join)."""
    st = Stream(ctx, endpoint, replay_ep, page_size)
    while not st.payloads:
        if replay_ep is None:
            pub.publish([])  # no replay to backfill from: probe until one arrives
        st.pump(200)
    return st


# -------------------------------------------------------------------------------- publisher


def test_config_flag_errors_name_the_flag() -> None:
    from sgl.runtime.config import EngineConfig

    for bad, words in [("{bad", "JSON object"), ('{"publisher": "kafka"}', "unknown publisher"),
                       ('{"endpoint": 5557}', "endpoint must be str"), ('{"topics": "x"}', "unknown key"),
                       ('{"buffer_steps": 0}', "buffer_steps must be >= 1"), ("[]", "JSON object")]:
        with pytest.raises(ValueError, match="--kv-events-config") as e:
            EngineConfig.from_kwargs(kv_events_config=bad)
        assert words in str(e.value)
    from sgl.runtime.kv_events.config import parse_kv_events_config

    assert parse_kv_events_config('{"enable_kv_cache_events": false}') is None
    assert parse_kv_events_config('{"publisher": "null"}') is None
    s = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": null}')
    assert s is not None and (s.publisher, s.endpoint, s.topic) == ("zmq", "tcp://*:5557", "kv-events")


def test_cli_rejects_bad_config_before_loading_the_model() -> None:
    proc = subprocess.run([sys.executable, "-m", "sgl.launch_server", "--kv-events-config", '{"publisher": "kafka"}'],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--kv-events-config" in proc.stderr and "kafka" in proc.stderr


class BlockStored7(BlockStored, tag="BlockStored"):  # vLLM after lora_name became required
    lora_name: Optional[str]


class Batch7(EventBatch):
    events: list[Union[BlockStored7, BlockRemoved, AllBlocksCleared]]


# Newer vLLM: the same events as field-name maps, with fields we do not send.
class MapEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


def _as_map(cls: type, *extra: tuple) -> type:
    fields = [(f.name, f.type) for f in msgspec.structs.fields(cls)] + list(extra)
    return msgspec.defstruct("Map" + cls.__name__, fields, bases=(MapEvent,), tag=cls.__name__.rstrip("7"))


MapStored = _as_map(BlockStored7, ("extra_keys", Optional[list], None), ("group_idx", Optional[int], None))
MapRemoved = _as_map(BlockRemoved, ("group_idx", Optional[int], None))
MapCleared = _as_map(AllBlocksCleared)
MapBatch = msgspec.defstruct("MapBatch", [("ts", float), ("events", list[Union[MapStored, MapRemoved, MapCleared]]),
                                          ("data_parallel_rank", Optional[int], None)], omit_defaults=True)


def test_every_vllm_form_of_the_events_reads_and_is_read() -> None:
    from sgl.kv_events import wire

    ours = wire.encode_batch(wire.KVEventBatch(ts=1.0, events=[wire.BlockStored(
        block_hashes=[7, 8], parent_block_hash=None, token_ids=[1, 2], block_size=1, lora_id=None, medium="CPU")]))
    assert DECODER.decode(ours).events[0].block_hashes == [7, 8]  # the 6-field form ignores lora_name
    ev = msgspec.msgpack.Decoder(Batch7).decode(ours).events[0]
    assert (ev.block_hashes, ev.lora_name, ev.medium) == ([7, 8], None, "CPU")
    six = msgspec.msgpack.encode(KVEventBatch(ts=2.0, events=[BlockStored([5], None, [3], 1, None, "GPU")]))
    assert wire.decode_batch(six).events[0].block_hashes == [5]  # older vLLM workers
    maps = msgspec.msgpack.encode(MapBatch(ts=3.0, data_parallel_rank=1, events=[
        MapStored([9, 10], 4, [1, 2], 1, None, "GPU", None, group_idx=0), MapRemoved([9], "GPU"), MapCleared()]))
    got = wire.decode_batch(maps)
    assert got.data_parallel_rank == 1 and [type(e).__name__ for e in got.events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert (got.events[0].block_hashes, got.events[0].parent_block_hash, got.events[1].block_hashes) == ([9, 10], 4, [9])
    with pytest.raises(msgspec.DecodeError):
        wire.decode_batch(b"\x93not a batch")


def test_publisher_wire_sequence_replay_and_heartbeat(ctx: zmq.Context) -> None:
    from sgl.kv_events import wire
    from sgl.runtime.kv_events.publisher import ZmqEventPublisher

    pub = ZmqEventPublisher(settings(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"), data_parallel_rank=3)
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.endpoint[-1] != "0"  # port 0 resolved
        port = pub.endpoint.rpartition(":")[2]
        st = subscribe_until_live(ctx, pub, f"tcp://127.0.0.1:{port}", pub.replay_endpoint.replace("*", "127.0.0.1"))
        stored = wire.BlockStored(block_hashes=page_hashes(list(range(32)), 16), parent_block_hash=None,
                                  token_ids=list(range(32)), block_size=16, lora_id=None, medium="CPU")
        pub.publish([stored])
        pub.publish([wire.BlockRemoved(block_hashes=stored.block_hashes, medium="CPU"), wire.AllBlocksCleared()])
        st.wait(lambda: st.clears == 1, "the two batches")
        assert all(b.data_parallel_rank == 3 for b in st.batches)
        ev = next(e for b in st.batches for e in b.events if isinstance(e, BlockStored))
        assert ev.token_ids == list(range(32)) and ev.parent_block_hash is None
        # Idle: heartbeats are empty batches that keep the sequence going.
        n = len(st.payloads)
        st.wait(lambda: len(st.payloads) > n + 1, "two heartbeats")
        assert all(b.events == [] for b in st.batches[n:])
        # Replay from any buffered sequence: the same bytes, in order, then the end marker.
        got = replay(ctx, pub.replay_endpoint.replace("*", "127.0.0.1"), 1)
        assert [s for s, _ in got[: len(st.payloads) - 1]] == list(range(1, len(st.payloads)))
        assert [p for _, p in got[: len(st.payloads) - 1]] == st.payloads[1:]
        # A DEALER without the empty delimiter frame is answered the same way.
        assert replay(ctx, pub.replay_endpoint.replace("*", "127.0.0.1"), 0, delimiter=False)[0] == (0, st.payloads[0])
        assert replay(ctx, pub.replay_endpoint.replace("*", "127.0.0.1"), 10**9) == []
        st.close()
    finally:
        pub.close()


def test_publisher_full_queue_drops_oldest_as_visible_gaps(ctx: zmq.Context) -> None:
    from sgl.runtime.kv_events.publisher import ZmqEventPublisher

    pub = ZmqEventPublisher(settings(endpoint="tcp://127.0.0.1:0", max_queue_size=4), heartbeat_s=3600)
    st = Stream(ctx, pub.endpoint.replace("*", "127.0.0.1"), None, 16)
    seqs: list[int] = []
    while not seqs:  # probes until the subscription has joined
        pub.publish([])
        while st.sub.poll(50):
            seqs.append(int.from_bytes(st.sub.recv_multipart()[1], "big"))
    total = pub._seq + 5000
    for _ in range(5000):
        pub.publish([])
    pub.close()  # sends what is queued, then closes
    while st.sub.poll(1000):
        seqs.append(int.from_bytes(st.sub.recv_multipart()[1], "big"))
    assert seqs == sorted(set(seqs)), "out of order or duplicated"
    # Every sequence number was either sent or counted as dropped; a drop is a gap.
    assert len(set(range(seqs[0], total)) - set(seqs)) == pub.dropped
    assert seqs[-1] == total - 1  # the newest are kept
    st.close()


def test_publisher_connects_to_a_binding_subscriber_and_frees_its_port(ctx: zmq.Context) -> None:
    from sgl.runtime.kv_events.publisher import ZmqEventPublisher, binds

    assert binds("tcp://*:1") and binds("tcp://0.0.0.0:1") and binds("ipc:///tmp/x") and binds("tcp://127.0.0.1:1")
    assert binds("tcp://localhost:1") and not binds("tcp://10.0.0.1:1")
    assert not binds("tcp://127.0.0.1:1", connect=True) and binds("tcp://10.0.0.1:1", connect=False)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    pub = ZmqEventPublisher(settings(endpoint=f"tcp://127.0.0.1:{port}", topic="", connect=True), heartbeat_s=0.05)
    assert sub.poll(30_000), "the heartbeat reaches a subscriber that binds"
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"" and DECODER.decode(payload).events == []
    sub.close()
    pub.close()
    # Closed means closed: the same address binds again at once.
    port2, port3 = free_port(), free_port()
    for _ in range(2):
        ZmqEventPublisher(settings(endpoint=f"tcp://127.0.0.1:{port2}", replay_endpoint=f"tcp://127.0.0.1:{port3}")).close()


# ------------------------------------------------------------ the real scheduler, fake model


def full_pages(tree: RadixTree, page_size: int) -> set[int]:
    out: set[int] = set()
    stack: list[tuple[TreeNode, list[int]]] = [(tree.root, [])]
    while stack:
        node, path = stack.pop()
        if not node.children:
            out |= set(page_hashes(path, page_size))
        stack.extend((c, path + c.key) for c in node.children.values())
    return out


def test_scheduler_workload_events_match_the_tree(ctx: zmq.Context) -> None:
    from sgl.runtime.kv_events.stream import KVEventStream
    from sgl.runtime.sampling_params import SamplingParams
    from sgl.runtime.scheduler.req import Req
    from tests.test_scheduler import make

    s, _ = make(num_slots=160, max_running=8, chunk=24)  # tiny pool: evictions, chunking, retractions
    stream = KVEventStream(settings(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"), s.kv.tree, page_size=4)
    try:
        st = subscribe_until_live(ctx, stream.publisher, stream.publisher.endpoint.replace("*", "127.0.0.1"),
                                  stream.publisher.replay_endpoint.replace("*", "127.0.0.1"), page_size=4)
        rng = random.Random(5)
        prefixes = [[rng.randrange(3, 60) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
        for i in range(30):
            prompt = rng.choice(prefixes) + [rng.randrange(3, 60) for _ in range(rng.randrange(0, 20))]
            s.submit(Req(rid=f"r{i}", input_ids=prompt,
                         params=SamplingParams.from_dict({"max_new_tokens": rng.randrange(1, 12), "temperature": 0})))
            if i % 3 == 0:
                for _ in range(rng.randrange(1, 6)):
                    s.step()
                    stream.flush()  # as the worker does after every iteration
        while s.has_work() or not s.inbox.empty():
            s.step()
            stream.flush()
        assert s.stats["num_finished_total"] == 30
        truth = full_pages(s.kv.tree, 4)
        st.wait(lambda: st.held == truth, "the subscriber to agree with the tree")
        assert st.removed, "the small pool must have evicted announced pages"
        assert stream.tracker.held_hashes() == truth
        s.call(lambda: s.kv.flush())
        s.step()
        stream.flush()
        st.wait(lambda: st.clears == 1, "AllBlocksCleared")
        assert st.held == set()
        st.close()
    finally:
        stream.close()
    assert s.kv.tree.observer is None


def test_worker_snapshot_reports_kv_events(tmp_path: Any) -> None:
    from sgl.runtime.config import EngineConfig
    from sgl.runtime.worker.build import build_kv_events
    from sgl.runtime.worker.serve import Serve
    from tests.test_scheduler import make

    s, _ = make()
    serve = Serve(s, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", parent_pid=0)
    try:
        assert build_kv_events(EngineConfig.from_kwargs(), s, "cpu") is None
        assert serve._snapshot()["kv_events"] is None
        port = free_port()
        cfg = EngineConfig.from_kwargs(kv_events_config=json.dumps({"endpoint": f"tcp://127.0.0.1:{port}"}),
                                       page_size=32, data_parallel_rank=2)
        serve.kv_events = build_kv_events(cfg, s, "cpu")
        assert serve._snapshot()["kv_events"] == {
            "endpoint": f"tcp://127.0.0.1:{port + 2}", "replay_endpoint": None, "topic": "kv-events", "page_size": 32,
            "data_parallel_rank": 2, "heartbeat_s": 1.0, "dropped_batches": 0}
        assert s.kv.tree.observer is serve.kv_events.tracker
    finally:
        serve.close_kv_events()
        serve.ctx.destroy(linger=0)
    assert s.kv.tree.observer is None


# ---------------------------------------------------------------------------- the real server

POOL = 256  # small, so that a few prompts evict the first ones


@pytest.fixture(scope="module")
def server():
    port, replay_port = free_port(), free_port()
    cfg = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
           "topic": TOPIC, "enable_kv_cache_events": True}
    srv = start_server("--max-total-tokens", str(POOL), "--kv-events-config", json.dumps(cfg))
    ctx = zmq.Context()
    st = Stream(ctx, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", 16)
    try:
        yield srv, st, cfg
    finally:
        st.close()
        srv.stop()
        ctx.destroy(linger=0)


def generate(srv: ServerProc, ids: list[int], n: int = 8) -> dict:
    r = httpx.post(srv.url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.server
@pytest.mark.model
def test_server_info_and_heartbeat(server: tuple[ServerProc, Stream, dict]) -> None:
    srv, st, cfg = server
    info = httpx.get(srv.url + "/get_server_info", timeout=30).json()["kv_events"]
    assert info == {"endpoint": cfg["endpoint"], "replay_endpoint": cfg["replay_endpoint"], "topic": TOPIC,
                    "page_size": 16, "data_parallel_rank": None, "heartbeat_s": 1.0, "dropped_batches": 0}
    st.wait(lambda: len(st.payloads) >= 2, "heartbeats from an idle worker")
    assert all(b.events == [] for b in st.batches[:2])  # idle: nothing stored yet, only heartbeats


@pytest.mark.server
@pytest.mark.model
def test_server_prompt_pages_eviction_flush_and_replay(server: tuple[ServerProc, Stream, dict]) -> None:
    srv, st, cfg = server
    prompt = [1000 + 7 * i for i in range(48)]  # 3 full pages; + 7 generated tokens: no 4th page
    h = page_hashes(prompt, 16)
    generate(srv, prompt)
    st.wait(lambda: set(h) <= st.held, "BlockStored of the prompt's pages")
    mine = [e for e in st.stored if set(e.block_hashes) <= set(h)]
    assert [x for e in mine for x in e.block_hashes] == h
    assert [t for e in mine for t in e.token_ids] == prompt
    assert mine[0].parent_block_hash is None

    # A shared prefix: only the new pages are stored, chained to the last shared one.
    other = prompt[:40] + [3000 + i for i in range(24)]  # pages 0, 1 shared; 2, 3 new
    h2 = page_hashes(other, 16)
    generate(srv, other)
    st.wait(lambda: set(h2) <= st.held, "BlockStored of the second prompt's new pages")
    (ev,) = [e for e in st.stored if set(e.block_hashes) & set(h2[2:])]
    assert ev.block_hashes == h2[2:] and ev.parent_block_hash == h[1] and ev.token_ids == other[32:]

    # Fill the small pool: the least recently used pages (the two prompts') are removed.
    for k in range(4):
        generate(srv, [5000 + 1000 * k + i for i in range(POOL // 3)], n=2)
    st.wait(lambda: set(h + h2) <= st.removed, "BlockRemoved of the evicted prompts' pages")
    assert st.removed <= st.announced

    # /flush_cache -> AllBlocksCleared.
    assert httpx.post(srv.url + "/flush_cache", timeout=60).status_code == 200
    st.wait(lambda: st.clears >= 1, "AllBlocksCleared")
    assert st.held == set()

    # Replay from a sequence returns exactly the batches the stream delivered, then the end marker.
    start = len(st.payloads) // 2
    got = replay(st.ctx, cfg["replay_endpoint"].replace("*", "127.0.0.1"), start)
    n = len(st.payloads) - start
    assert [s for s, _ in got[:n]] == list(range(start, len(st.payloads)))
    assert [p for _, p in got[:n]] == st.payloads[start:]
    assert st.batches[0].ts <= st.batches[-1].ts


@pytest.mark.server
@pytest.mark.model
def test_server_stops_cleanly_and_frees_the_event_ports(server: tuple[ServerProc, Stream, dict]) -> None:
    srv, st, cfg = server
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=60) in (0, -signal.SIGTERM), srv.log()[-3000:]
    assert "did not stop cleanly" not in srv.log()
    deadline = time.monotonic() + 15
    while group_pids(srv.proc.pid) and time.monotonic() < deadline:  # the worker exits after the API process
        time.sleep(0.2)
    assert group_pids(srv.proc.pid) == [], "a worker outlived the server"
    ctx = zmq.Context()
    try:  # nothing lingers on the addresses: they bind again at once
        for ep in (cfg["endpoint"], cfg["replay_endpoint"]):
            ctx.socket(zmq.PUB).bind(ep)
    finally:
        ctx.destroy(linger=0)
