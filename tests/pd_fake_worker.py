"""A stand-in prefill or decode worker for the router's PD tests: a real HTTP server
(tests/json_http.py) that records every generation request it gets and answers as told by
a queue of `Step`s (one per request; an empty queue answers normally). It notices when the
router closes the connection while it holds an answer (`aborted`), as a real worker aborts
the request then. As real ones, a decode answers only once a prefill has "sent the KV" of
its bootstrap rooms (`ROOMS`: a prefill adds a request's rooms when it gets it, unless it is
told to fail), so a decode answer implies the prefill got the request. No model: it tests
only the router's own logic."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.json_http import JsonServer

PREFILL_LOGPROBS = [[-0.5, 11, None], [-0.6, 12, None]]
KV_WAIT_S = 30.0  # a decode whose rooms no prefill got answers 500 after this (a transfer timeout)


class _Rooms:
    """The rooms whose "KV" some prefill has sent, shared by every fake in the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rooms: set[Any] = set()

    def add(self, rooms: list[Any]) -> None:
        with self._lock:
            self._rooms.update(rooms)

    def have(self, rooms: list[Any]) -> bool:
        with self._lock:
            return all(r in self._rooms for r in rooms)


ROOMS = _Rooms()


def _rooms(body: dict[str, Any]) -> list[Any]:
    room = body.get("bootstrap_room")
    return list(room) if isinstance(room, list) else [room]
DECODE_LOGPROBS = [[None, 99, None]]


@dataclass
class Step:
    status: int = 200  # another status: answered at once with an error body
    error: dict[str, Any] | None = None  # the error body for `status` (default: a message naming the role)
    drop: bool = False  # close the connection without answering
    hold: threading.Event | None = None  # answer only once set (the router may leave first)
    hold_s: float = 0.0  # answer only after this long (ditto)
    frames: int = 3  # stream: data frames before [DONE]
    pause: threading.Event | None = None  # stream: wait for it after the first frame
    break_after: int | None = None  # stream: drop the connection after this many frames
    error_event: bool = False  # stream: a 200 whose first frame is an error event


class FakePdWorker(JsonServer):
    def __init__(self, role: str) -> None:
        self.role = role
        self.lock = threading.Lock()
        self.steps: list[Step] = []
        self.requests: list[tuple[str, dict[str, Any], dict[str, str]]] = []  # (path, body, headers)
        self.aborted = 0
        self.finished = 0
        self.flushed = 0
        self.generation = 0  # bumped by reset: a request still held from an earlier test counts nothing
        self._local = threading.local()
        super().__init__(self._get, self._post)
        # The router closing a connection on us is expected: no tracebacks for it.
        self.server.handle_error = lambda *a: None  # type: ignore[method-assign]

    def reset(self, *steps: Step) -> None:
        with self.lock:
            self.steps, self.requests, self.aborted, self.finished = list(steps), [], 0, 0
            self.generation += 1

    def _count_abort(self) -> None:
        with self.lock:
            if self._local.generation == self.generation:
                self.aborted += 1

    def bodies(self) -> list[dict[str, Any]]:
        with self.lock:
            return [b for p, b, _ in self.requests if p != "/flush_cache"]

    def _get(self, path: str, headers: Mapping[str, str]) -> tuple[int, object] | None:
        if path == "/health":
            return 200, {}
        if path in ("/get_server_info", "/server_info"):
            return 200, {"disaggregation_mode": self.role, "model_path": "fake", "url": self.url}
        if path == "/get_model_info":
            return 200, {"model_path": "fake", "role": self.role}
        return None

    def _post(self, h: BaseHTTPRequestHandler, path: str, headers: Mapping[str, str], body: Any) -> Any:
        if path == "/flush_cache":
            with self.lock:
                self.flushed += 1
            return 200, {}
        with self.lock:
            self._local.generation = self.generation
            self.requests.append((path, body, {k.lower(): v for k, v in headers.items()}))
            step = self.steps.pop(0) if self.steps else Step()
        if step.drop:
            _close(h)
            return None
        if self.role == "prefill" and step.status == 200 and not step.error_event:
            ROOMS.add(_rooms(body))  # the KV is on its way to the decode
        if self.role == "decode":
            if not self._held(h, None, KV_WAIT_S, until=lambda: ROOMS.have(_rooms(body))):
                return None
            if not ROOMS.have(_rooms(body)):
                self._done()
                return 500, {"error": {"message": "KV transfer timed out", "code": 500}}
        if not self._held(h, step.hold, step.hold_s):
            return None
        if step.status != 200:
            self._done()
            return step.status, step.error or {"error": {"message": f"{self.role} failed", "code": step.status}}
        if body.get("stream"):
            self._stream(h, body, step)
            return None
        self._done()
        return 200, self._answer(path, body)

    def _answer(self, path: str, body: dict[str, Any]) -> Any:
        rooms = body.get("bootstrap_room")
        if path == "/generate":
            items = rooms if isinstance(rooms, list) else [rooms]
            outs = [self._result(body, r) for r in items]
            return outs if isinstance(rooms, list) else outs[0]
        return {"object": "fake", "role": self.role, "rooms": rooms,
                "choices": [{"index": 0, "text": self.role, "message": {"role": "assistant", "content": self.role}}]}

    def _result(self, body: dict[str, Any], room: Any) -> dict[str, Any]:
        meta: dict[str, Any] = {"role": self.role, "room": room}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = list(PREFILL_LOGPROBS if self.role == "prefill" else DECODE_LOGPROBS)
        return {"text": f"{self.role} text", "meta_info": meta}

    def _stream(self, h: BaseHTTPRequestHandler, body: dict[str, Any], step: Step) -> None:
        # Chunked, as a real worker streams: a connection closed before the last chunk is a
        # broken stream, not the end of the body.
        h.protocol_version = "HTTP/1.1"
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Connection", "close")
        h.end_headers()

        def chunk(data: bytes) -> None:
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()

        try:
            if step.error_event:
                chunk(b'data: {"error": {"message": "KV transfer failed", "code": 500}}\n\ndata: [DONE]\n\n')
                self._done()
                chunk(b"")
                return
            for i in range(step.frames):
                if step.break_after is not None and i == step.break_after:
                    _close(h)
                    return
                chunk(f'data: {{"text": "{self.role}-{i}", "index": {i}}}\n\n'.encode())
                if i == 0 and not self._held(h, step.pause, 0.0):
                    return
            chunk(b"data: [DONE]\n\n")
            self._done()  # counted before the last chunk: whoever read the whole answer sees it counted
            chunk(b"")
        except OSError:
            self._count_abort()

    def _held(self, h: BaseHTTPRequestHandler, event: threading.Event | None, secs: float,
              until: Callable[[], bool] | None = None) -> bool:
        """Wait for `event` and `secs` (or only until `until()` holds, if given); False
        (counted in `aborted`) if the router closed the connection first."""
        deadline = time.monotonic() + secs
        while (event is not None and not event.is_set()) or time.monotonic() < deadline:
            if until is not None and until():
                return True
            if _peer_closed(h.connection):
                self._count_abort()
                return False
            if event is not None:
                event.wait(0.02)
            else:
                time.sleep(0.02)
        return True

    def _done(self) -> None:
        with self.lock:
            if self._local.generation == self.generation:
                self.finished += 1


def _peer_closed(conn: socket.socket) -> bool:
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _close(h: BaseHTTPRequestHandler) -> None:
    h.close_connection = True
    try:
        h.wfile.flush()
        h.connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
