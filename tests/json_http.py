"""A real HTTP server on a free loopback port answering GETs with JSON, for router tests
that need a worker's control endpoints (/get_load, /get_server_info, /get_tokenizer, ...)
without starting a model. `answer(path, headers)` returns (status, body) or None (404).
POSTs go to the optional `post(handler, path, headers, body)` (body: the parsed JSON),
which returns (status, body) too, or None once it has written its own answer (a stream,
a dropped connection) through the handler."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Answer = Callable[[str, Mapping[str, str]], "tuple[int, object] | None"]
Post = Callable[[BaseHTTPRequestHandler, str, Mapping[str, str], object], "tuple[int, object] | None"]


class JsonServer:
    def __init__(self, answer: Answer, post: Post | None = None) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                reply = answer(self.path, self.headers)
                if reply is None:
                    self.send_error(404)
                    return
                self._reply(*reply)

            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if post is None:
                    self.send_error(404)
                    return
                reply = post(self, self.path, self.headers, json.loads(raw) if raw else None)
                if reply is not None:
                    self._reply(*reply)

            def _reply(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
