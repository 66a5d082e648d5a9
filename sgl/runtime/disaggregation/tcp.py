"""The `tcp` transfer backend: ZMQ over TCP, one I/O thread per side.

Prefill (`TcpKVSender`): a ROUTER socket bound on HOST:--disaggregation-bootstrap-port is
both the bootstrap endpoint and the transfer channel. Decode workers' DEALERs send it
Pull / Cancel; it answers KVReady + payload or Failed to the asking DEALER. It is
ROUTER_MANDATORY, so a send to a decode worker that has gone away fails at once (the room
is dropped then, not after a timeout). Payloads go out with copy=False: the gathered
buffer is handed to ZMQ and kept alive until ZMQ says the frame is sent.

Decode (`TcpKVReceiver`): one DEALER per prefill address, named
"<decode_id>|<incarnation>", so replies reach this incarnation only and a restarted
decode worker is told apart from its predecessor. DEALERs connect lazily and queue
pulls until the prefill is reachable; the caller's deadline bounds the wait, and a
DEALER idle for longer than any wait is closed. A socket monitor reports a connection
that breaks (the prefill died) as `PeerLost`, so the rooms pulled from it fail at once
instead of at their deadline.

Both threads only move bytes: decoded messages go into a queue the scheduler thread
polls (and `wake()` nudges the scheduler loop); everything else happens there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from sgl.runtime.disaggregation.kv_copy import as_bytes
from sgl.runtime.disaggregation.protocol import (Cancel, Failed, KVReady, PeerLost, Pull, PullReceived, Received,
                                                 SendDone, decode_to_decode, decode_to_prefill, encode)

log = logging.getLogger("sgl.pd")

POLL_MS = 200
CONTROL_MAX_BYTES = 1 << 20  # what a prefill accepts in one message: Pull / Cancel are tiny


def peer_identity(decode_id: str, incarnation: int) -> bytes:
    """A decode DEALER's ZMQ identity: replies reach this incarnation only."""
    return f"{decode_id}|{incarnation}".encode()


def _watch_peer(sock: zmq.Socket) -> None:
    """Notice a peer that vanished without a word (a killed host, a NAT that dropped an idle
    connection): ZMTP heartbeats close the connection after ~15 s of silence (the decode's
    monitor then reports PeerLost), TCP keepalive backs them up."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, 5_000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15_000)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)


class _IOThread:
    """A daemon thread running `loop` with a wake-up socket and a command queue."""

    def __init__(self, ctx: zmq.Context, name: str) -> None:
        self.ctx = ctx
        self.commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.events: queue.Queue[Any] = queue.Queue()
        self.stop = threading.Event()
        addr = f"inproc://sgl-pd-wake-{id(self)}"
        self._wake_in = ctx.socket(zmq.PULL)
        self._wake_in.bind(addr)
        self._wake_out = ctx.socket(zmq.PUSH)
        self._wake_out.connect(addr)
        self._wake_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def command(self, *cmd: Any) -> None:
        self.commands.put(cmd)
        with self._wake_lock:
            try:
                self._wake_out.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # the wake pipe is full: the thread wakes anyway and drains the queue
                pass

    def drain_events(self) -> list[Any]:
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        try:
            self.loop()
        except Exception:  # the transport is dead; rooms time out on the scheduler side
            if not self.stop.is_set():
                log.exception("PD transfer thread died")

    def loop(self) -> None:
        raise NotImplementedError

    def drain_wake(self) -> None:
        while True:
            try:
                self._wake_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        self.stop.set()
        self.command("stop")
        self.thread.join(timeout=2)
        self.ctx.destroy(linger=0)


class TcpKVSender(_IOThread):
    """Prefill side of the tcp backend (protocol.KVSender)."""

    def __init__(self, host: str, port: int, wake: Callable[[], None]) -> None:
        super().__init__(zmq.Context(), "sgl-pd-sender")
        self.address = f"{host}:{port}"
        self.wake = wake
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A decode that reconnects under its identity (its connection died, it did not)
        # takes the identity over at once instead of waiting for the old pipe to close.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, CONTROL_MAX_BYTES)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 10_000)
        _watch_peer(self.sock)
        try:
            self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self.ctx.destroy(linger=0)
            raise RuntimeError(f"the prefill worker could not bind its bootstrap socket on {host}:{port} "
                               f"(--disaggregation-bootstrap-port): {e}") from None
        self._in_flight: list[tuple[Any, Any]] = []  # (tracker, buffer owner) until ZMQ is done with it
        self._mismatched = 0  # messages dropped for naming another sender than their connection
        self.thread.start()

    def poll(self) -> list[PullReceived | SendDone]:
        return self.drain_events()

    def send(self, peer: Any, room: int, msg: KVReady | Failed, payload: Any = None) -> None:
        self.command("send", peer, room, msg, payload)

    def loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        while not self.stop.is_set():
            ready = dict(poller.poll(POLL_MS))
            if self.sock in ready:
                self._receive()
            if self._wake_in in ready:
                self.drain_wake()
            self._run_commands()
            self._in_flight = [(t, b) for t, b in self._in_flight if not t.done]

    def _receive(self) -> None:
        got = False
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                log.warning("dropping a malformed PD message (%d frames)", len(frames))
                continue
            try:
                msg = decode_to_prefill(frames[1])
            except Exception:
                log.warning("dropping an undecodable PD message", exc_info=True)
                continue
            if frames[0] != peer_identity(msg.decode_id, msg.incarnation):
                # A consistency check, not authentication (a peer picks its own identity):
                # replies go to the connection, rooms are keyed by the named sender, and the
                # two must agree, so a confused peer cannot cancel another's rooms.
                self._mismatched += 1
                if self._mismatched <= 10:  # a misbehaving peer must not flood the log
                    log.warning("dropping a PD %s from %r that names %s|%d as its sender", type(msg).__name__,
                                frames[0][:80], msg.decode_id[:80], msg.incarnation)
                continue
            self.events.put(PullReceived(frames[0], msg))
            got = True
        if got:
            self.wake()

    def _run_commands(self) -> None:
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] != "send":
                continue
            _, peer, room, msg, payload = cmd
            try:
                frames: list[Any] = [peer, encode(msg)]
                if payload is not None:
                    frames.append(as_bytes(payload))
                tracker = self.sock.send_multipart(frames, copy=False, track=True)
                if payload is not None:
                    self._in_flight.append((tracker, payload))
                self.events.put(SendDone(room, True))
            except Exception as e:  # noqa: BLE001 - one bad send fails its room, not the thread
                self.events.put(SendDone(room, False, f"{type(e).__name__}: {e}"))
            self.wake()


class TcpKVReceiver(_IOThread):
    """Decode side of the tcp backend (protocol.KVReceiver)."""

    def __init__(self, decode_id: str, incarnation: int, wake: Callable[[], None], idle_close_s: float) -> None:
        """`idle_close_s`: a DEALER with no traffic that long is closed (prefill pods come and go
        under new addresses; each open one would reconnect forever). Give it more than the
        longest a pulled room may wait, so no awaited reply can arrive after."""
        super().__init__(zmq.Context(), "sgl-pd-receiver")
        self.identity = peer_identity(decode_id, incarnation)
        self.wake = wake
        self.idle_close_s = idle_close_s
        # touched by the I/O thread only
        self.dealers: dict[tuple[str, int], zmq.Socket] = {}
        self.monitors: dict[zmq.Socket, tuple[str, int]] = {}
        self.last_used: dict[tuple[str, int], float] = {}
        self.thread.start()

    def pull(self, addr: tuple[str, int], msg: Pull) -> None:
        self.command("send", addr, msg)

    def cancel(self, addr: tuple[str, int], msg: Cancel) -> None:
        self.command("send", addr, msg)

    def poll(self) -> list[Received | PeerLost]:
        return self.drain_events()

    def _dealer(self, addr: tuple[str, int], poller: zmq.Poller) -> zmq.Socket:
        sock = self.dealers.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5_000)  # a prefill that is gone for good: back off
            _watch_peer(sock)
            host, port = addr
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            try:
                sock.connect(f"tcp://{host}:{port}")
            except zmq.ZMQError:  # a malformed address: no socket left behind
                sock.disable_monitor()
                mon.close(linger=0)
                sock.close(linger=0)
                raise
            poller.register(mon, zmq.POLLIN)
            self.monitors[mon] = addr
            poller.register(sock, zmq.POLLIN)
            self.dealers[addr] = sock
        self.last_used[addr] = time.monotonic()
        return sock

    def _close_idle(self, poller: zmq.Poller) -> None:
        now = time.monotonic()
        for addr in [a for a, t in self.last_used.items() if now - t > self.idle_close_s]:
            sock = self.dealers.pop(addr)
            del self.last_used[addr]
            mon = next(m for m, a in self.monitors.items() if a == addr)
            del self.monitors[mon]
            poller.unregister(sock)
            poller.unregister(mon)
            sock.disable_monitor()
            mon.close(linger=0)
            sock.close(linger=0)
            log.info("closed the idle PD connection to %s:%s", *addr)

    def loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        while not self.stop.is_set():
            ready = dict(poller.poll(POLL_MS))
            for addr, sock in list(self.dealers.items()):
                if sock in ready:
                    self.last_used[addr] = time.monotonic()
                    self._receive(sock)
            for mon, addr in list(self.monitors.items()):
                if mon in ready:
                    self._monitor(mon, addr)
            if self._wake_in in ready:
                self.drain_wake()
            while True:
                try:
                    cmd = self.commands.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "send":
                    try:
                        self._dealer(cmd[1], poller).send(encode(cmd[2]), zmq.NOBLOCK)
                    except Exception as e:  # noqa: BLE001 - queue full, bad address: the deadline fails the room
                        log.warning("could not send %s to %s:%s: %s", type(cmd[2]).__name__, *cmd[1], e)
            self._close_idle(poller)

    def _monitor(self, mon: zmq.Socket, addr: tuple[str, int]) -> None:
        lost = False
        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                break
            lost = lost or event["event"] == zmq.EVENT_DISCONNECTED
        if lost:
            self.events.put(PeerLost(addr, time.monotonic()))
            self.wake()

    def _receive(self, sock: zmq.Socket) -> None:
        got = False
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                msg = decode_to_decode(frames[0].bytes)
            except Exception:
                log.warning("dropping an undecodable PD message", exc_info=True)
                continue
            payload = frames[1].buffer if len(frames) > 1 else None
            if isinstance(msg, KVReady) and payload is None:  # over TCP the KV always follows
                msg = Failed(msg.room, "KVReady arrived without its payload frame")
            self.events.put(Received(msg, payload))
            got = True
        if got:
            self.wake()
