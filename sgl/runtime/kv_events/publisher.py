"""Send KV event batches over ZMQ exactly as vLLM's `ZmqEventPublisher` does, from a
background thread, so a slow or absent consumer never stalls the scheduler.

Wire (one home: `sgl/kv_events/wire.py`): the PUB socket sends multipart
``(topic, seq, payload)``; `seq` is 8 bytes big-endian, 0 for the first batch and +1 per
batch; `payload` is a msgpack `KVEventBatch(ts, events, data_parallel_rank)`.

- PUB endpoint: bound when its host is a wildcard (``*``, ``0.0.0.0``, ``::``) or it is
  ipc/inproc, else connected to a subscriber that binds (vLLM's rule). A wildcard port
  (``:*`` or ``:0``) is resolved to the bound one in `endpoint`.
- Replay (optional, always bound): a ROUTER socket. A client (DEALER, or REQ-style with
  the empty delimiter frame) sends the 8-byte big-endian sequence to start from; the
  worker answers one ``(seq, payload)`` message per batch still buffered with a sequence
  >= it (the last `buffer_steps` batches), then the end marker ``(-1 as 8 signed bytes,
  b"")``.
- Heartbeat: after `heartbeat_s` (1 s) without a batch, an empty batch (``events=[]``)
  is sent. It is an ordinary batch: it takes the next sequence number and is buffered
  for replay, so the sequence stays gapless and a consumer can tell a live, idle
  stream from a dead one (silence for a few heartbeats = the worker is gone).
- Back-pressure: batches wait in a queue bounded by `max_queue_size`; when it is full the
  oldest is dropped, counted (`dropped`) and logged. Sequence numbers are taken when a
  batch is queued, so a dropped batch shows as a gap that replay cannot fill: a consumer
  must then treat what it knew of this worker as stale.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from typing import Any

import zmq

from sgl.kv_events.wire import KVEvent, KVEventBatch, encode_batch, encode_seq
from sgl.runtime.kv_events.config import HEARTBEAT_S, KVEventsSettings, offset_endpoint

log = logging.getLogger("sgl.kv_events")

END_SEQ = encode_seq(-1)
LINGER_MS = 500  # on close: time for the last batches to leave, never a hang
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")
_LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")


def binds(endpoint: str, connect: bool | None = None) -> bool:
    """Whether the PUB socket binds `endpoint` (else it connects to a subscriber that binds).

    vLLM's rule (wildcard host, ipc, inproc: bind) plus loopback hosts: a worker that
    publishes to subscribers on its own machine only binds 127.0.0.1, never every interface.
    The config's `connect` key (ours) overrides the rule either way.
    """
    if connect is not None:
        return not connect
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.split("://", 1)[-1].rpartition(":")[0]
    return host in _WILDCARD_HOSTS or host in _LOOPBACK_HOSTS or host.startswith("127.")


class ZmqEventPublisher:
    """PUB + optional replay ROUTER + heartbeat; `publish` from any thread, `close` once."""

    def __init__(self, settings: KVEventsSettings, data_parallel_rank: int | None = None,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self.topic = settings.topic
        self.data_parallel_rank = data_parallel_rank
        self.heartbeat_s = heartbeat_s
        self.dropped = 0
        self._max_queue = settings.max_queue_size
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=settings.buffer_steps)
        self._queue: collections.deque[tuple[int, float, list[KVEvent]]] = collections.deque()
        self._lock = threading.Lock()
        self._seq = 0
        self._closing = False
        self._ctx = zmq.Context()
        self._replay: zmq.Socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, LINGER_MS)
            self._pub.setsockopt(zmq.SNDHWM, settings.hwm)
            endpoint = offset_endpoint(settings.endpoint, data_parallel_rank)
            assert endpoint is not None
            if binds(endpoint, settings.connect):
                self._pub.bind(endpoint)
                endpoint = _resolved(endpoint, self._pub)
            else:
                self._pub.connect(endpoint)
            self.endpoint = endpoint
            self.replay_endpoint = offset_endpoint(settings.replay_endpoint, data_parallel_rank)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, LINGER_MS)
                self._replay.bind(self.replay_endpoint)
                self.replay_endpoint = _resolved(self.replay_endpoint, self._replay)
        except Exception:
            self._close_sockets()
            raise
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._run, name="sgl-kv-events", daemon=True)
        self._thread.start()

    # -- any thread -----------------------------------------------------------------------
    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch (its sequence number is taken now)."""
        with self._lock:
            if self._closing:
                return
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.dropped += 1
                if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, 8, ...: no log flood
                    log.warning("KV event queue full (%d batches): dropped the oldest; %d dropped so far",
                                self._max_queue, self.dropped)
            self._queue.append((self._seq, time.time(), events))
            self._seq += 1
        self._wake()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the thread, close the sockets (bounded by LINGER_MS)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        self._thread.join(timeout)
        self._close_sockets()

    # -- the sender thread ------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        last_sent = time.monotonic()
        while True:
            wait_ms = max(0, math.ceil((last_sent + self.heartbeat_s - time.monotonic()) * 1000))
            ready = dict(poller.poll(wait_ms))
            if self._wake_r in ready:
                _drain(self._wake_r)
            if self._replay is not None and self._replay in ready:
                self._serve_replay()
            with self._lock:
                batches = list(self._queue)
                self._queue.clear()
                closing = self._closing
            for seq, ts, events in batches:
                self._send(seq, ts, events)
                last_sent = time.monotonic()
            if closing:
                return
            if time.monotonic() - last_sent >= self.heartbeat_s:
                self.publish([])  # picked up by the next pass (publish wakes the poller)
                last_sent = time.monotonic()

    def _send(self, seq: int, ts: float, events: list[KVEvent]) -> None:
        payload = encode_batch(KVEventBatch(ts=ts, events=events, data_parallel_rank=self.data_parallel_rank))
        try:
            self._pub.send_multipart((self.topic.encode(), encode_seq(seq), payload))
        except zmq.ZMQError:  # PUB drops rather than blocks; anything else must not kill the thread
            log.exception("could not send KV event batch %d", seq)
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            envelope, start = frames[:-1], frames[-1]
            if len(start) != 8:
                log.warning("bad KV event replay request (%d frames, last %d bytes): answering the end marker",
                            len(frames), len(start))
                start_seq = 1 << 62  # nothing is that new: only the end marker goes back
            else:
                start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((*envelope, encode_seq(seq), payload))
            self._replay.send_multipart((*envelope, END_SEQ, b""))

    # -- plumbing -----------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # full: the thread is awake anyway; closed: gone
            pass

    def _close_sockets(self) -> None:
        for sock in (getattr(self, "_pub", None), self._replay):
            if sock is not None:
                sock.close(linger=LINGER_MS)
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _resolved(endpoint: str, sock: zmq.Socket) -> str:
    """`endpoint` with a wildcard port (``*``/``0``) replaced by the port actually bound."""
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or port not in ("*", "0"):
        return endpoint
    bound: Any = sock.getsockopt(zmq.LAST_ENDPOINT)
    return f"{base}:{bound.decode().rpartition(':')[2]}"
