"""One worker's KV-event stream: a ZMQ SUB socket, gap repair through the replay socket.

The worker publishes `(topic, seq, payload)` on PUB and keeps recent batches behind a
ROUTER "replay" socket (vLLM's protocol): a client sends `(b"", start_seq)` from a DEALER
and gets back `(b"", seq, payload)` for every kept batch with seq >= start_seq, then
`(b"", -1, b"")` as the end mark. This subscriber hands every batch, in sequence order, to
`on_batch(url, batch)`; when a sequence number is skipped (the SUB socket dropped
messages, or we connected late: the first batch seen has seq > 0) it replays the missing
range first. If the range cannot be replayed (no replay socket, timeout, batches already
gone) it calls `on_reset(url)` — the caller's index for this worker is no longer exact
and must be rebuilt from scratch — and carries on from the live stream. A sequence that
goes *down* means the worker restarted: also a reset.

`last_message_at` (monotonic) moves on every batch, the worker's ~1 s empty heartbeat
batches included, so "silent for N seconds" means the stream, not the cache, is idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from sgl.kv_events.wire import KVEventBatch, decode_batch, decode_seq, encode_seq

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_SECS = 1.0


class KvEventSubscriber:
    def __init__(
        self,
        url: str,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        on_batch: Callable[[str, KVEventBatch], None],
        on_reset: Callable[[str], None],
        ctx: zmq.asyncio.Context,
    ) -> None:
        self.url = url
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._ctx = ctx
        self.last_seq: int | None = None
        self.last_message_at: float | None = None
        self.batches = 0
        self.events = 0
        self.gaps = 0
        self.replayed = 0
        self.resets = 0
        self.decode_errors = 0
        self._task: asyncio.Task[None] | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None

    async def start(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._replay = None

    def silent_for(self, now: float | None = None) -> float:
        """Seconds since the last batch (infinite before the first)."""
        if self.last_message_at is None:
            return float("inf")
        return (time.monotonic() if now is None else now) - self.last_message_at

    # ------------------------------------------------------------------ loop
    async def _run(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3:
                self.decode_errors += 1
                continue
            try:
                seq = decode_seq(frames[1])
                batch = decode_batch(frames[2])
            except (msgspec.DecodeError, ValueError) as exc:
                logger.warning("undecodable KV event batch from %s: %s", self.url, exc)
                self.decode_errors += 1
                continue
            self.last_message_at = time.monotonic()
            if self.last_seq is not None and seq <= self.last_seq:
                logger.info("KV event sequence of %s went back (%d -> %d): worker restarted", self.url, self.last_seq, seq)
                self._reset()
            expected = 0 if self.last_seq is None else self.last_seq + 1
            if seq > expected:
                self.gaps += 1
                if not await self._replay_range(expected, seq) and self.last_seq is not None:
                    self._reset()  # missed batches we cannot get back: the index is not exact
            self._deliver(seq, batch)

    def _deliver(self, seq: int, batch: KVEventBatch) -> None:
        self.last_seq = seq
        self.batches += 1
        self.events += len(batch.events)
        self._on_batch(self.url, batch)

    def _reset(self) -> None:
        self.resets += 1
        self.last_seq = None
        self._on_reset(self.url)

    async def _replay_range(self, start: int, stop: int) -> bool:
        """Deliver batches start..stop-1 from the replay socket; True if none is missing.

        Catching up after connecting (nothing delivered yet), a replay that begins later
        than `start` is still fine: the history we miss is older than anything we know,
        and missing old history only makes the index know less (conservative).
        """
        if not self.replay_endpoint:
            return False
        if self._replay is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.replay_endpoint)
            self._replay = sock
        sock = self._replay
        catching_up = self.last_seq is None
        await sock.send_multipart([b"", encode_seq(start)])
        want, broken = start, False
        try:
            while True:  # read to the end mark, so the next replay starts clean
                frames = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_SECS)
                while frames and not frames[0]:
                    frames = frames[1:]  # the empty delimiter
                if len(frames) != 2:
                    continue
                seq = decode_seq(frames[0])
                if seq < 0 or not frames[1]:
                    break  # end mark
                if broken or seq < want or seq >= stop:
                    continue  # already delivered / the live stream brings it
                if seq != want and not (catching_up and want == start):
                    broken = True  # the replay buffer no longer has `want`
                    continue
                self._deliver(seq, decode_batch(frames[1]))
                self.replayed += 1
                want = seq + 1
        except (asyncio.TimeoutError, msgspec.DecodeError, ValueError) as exc:
            logger.warning("KV event replay from %s failed: %r", self.url, exc)
            # A late answer would confuse the next replay: start over with a fresh socket.
            sock.close(linger=0)
            self._replay = None
            return False
        return not broken and (want == stop or catching_up)


@dataclass(frozen=True)
class EventSource:
    """Where a worker publishes, from its `/get_server_info` `kv_events` entry."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    page_size: int


def event_source(worker_url: str, server_info: object) -> EventSource | None:
    """The worker's KV-event source, or None when it publishes none (or says so oddly).

    A worker binds `tcp://*:5557` (or 0.0.0.0); a subscriber must connect to the worker's
    own host, taken from its URL.
    """
    if not isinstance(server_info, dict):
        return None
    kv = server_info.get("kv_events")
    if not isinstance(kv, dict) or not isinstance(kv.get("endpoint"), str):
        return None
    page_size = kv.get("page_size")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        return None
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    replay = kv.get("replay_endpoint")
    topic = kv.get("topic")
    return EventSource(
        endpoint=_at_host(kv["endpoint"], host),
        replay_endpoint=_at_host(replay, host) if isinstance(replay, str) and replay else None,
        topic=topic if isinstance(topic, str) else "",
        page_size=page_size,
    )


def _at_host(endpoint: str, host: str) -> str:
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return endpoint
    addr, colon, port = rest.rpartition(":")
    if addr in ("*", "0.0.0.0", "[::]", "::", ""):
        return f"{scheme}://{host}:{port}" if colon else endpoint
    return endpoint


class LocalEventFeed:
    """An event stream the caller pushes into in-process (a co-located worker, a simulator):
    the same face as `KvEventSubscriber` to the policy, without sockets or sequence gaps."""

    def __init__(self, url: str, on_batch: Callable[[str, KVEventBatch], None]) -> None:
        self.url = url
        self._on_batch = on_batch
        self.last_message_at: float | None = time.monotonic()
        self.batches = self.events = self.gaps = self.replayed = self.resets = 0

    def push(self, batch: KVEventBatch) -> None:
        self.last_message_at = time.monotonic()
        self.batches += 1
        self.events += len(batch.events)
        self._on_batch(self.url, batch)

    def silent_for(self, now: float | None = None) -> float:
        assert self.last_message_at is not None
        return (time.monotonic() if now is None else now) - self.last_message_at

    async def stop(self) -> None:
        pass
