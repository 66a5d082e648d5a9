"""The router's startup in-process, against real loopback HTTP workers (no model): it serves
as soon as one listed worker is healthy (a dead one joins later or never), and it keeps
fetching the workers' tokenizer until one serves it (`sgl_router_tokenizer_loaded`)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sgl.router.config import RouterConfig
from sgl.router.state import Router
from tests.server_proc import free_port
from tests.test_router_tokenizer import _tiny_tokenizer_json


class FakeWorker:
    """/health answers 200; /get_tokenizer 503 until `tokenizer_ready` is set."""

    def __init__(self) -> None:
        self.tokenizer_ready = threading.Event()
        self.tokenizer_asks = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/get_tokenizer":
                    owner.tokenizer_asks += 1
                    if owner.tokenizer_ready.is_set():
                        self._send(200, {"tokenizer_json": _tiny_tokenizer_json()})
                    else:
                        self._send(503, {"error": "busy"})
                else:
                    self._send(404, {})

            def _send(self, status: int, body: object) -> None:
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


@pytest.fixture
def worker() -> Iterator[FakeWorker]:
    w = FakeWorker()
    yield w
    w.close()


async def _until(pred, what: str, bound: float = 60.0) -> None:  # noqa: ANN001
    for _ in range(int(bound / 0.05)):  # a bound on waiting, not a timing assertion
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


@pytest.mark.timeout(120)
def test_serves_once_one_worker_is_healthy_and_keeps_fetching_the_tokenizer(worker: FakeWorker) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = RouterConfig(worker_urls=[dead, worker.url], worker_startup_timeout_secs=1800.0,
                       policy="round_robin").resolved()

    async def main() -> None:
        router = Router(cfg)
        try:
            # The dead worker would hold startup for 1800 s if startup waited for every worker.
            await asyncio.wait_for(router.start(), 60)
            live, gone = router.registry.get(worker.url), router.registry.get(dead)
            assert live is not None and live.state.healthy
            assert gone is not None and not gone.state.healthy  # registered, out of rotation
            assert [w.url for w in router.registry.candidates()] == [worker.url]
            assert b"sgl_router_tokenizer_loaded 0.0" in router.metrics.render()
            await _until(lambda: worker.tokenizer_asks >= 2, "the tokenizer fetch is retried")
            assert router.tokenizer is None
            worker.tokenizer_ready.set()
            await _until(lambda: router.tokenizer is not None, "the tokenizer arrives")
            assert b"sgl_router_tokenizer_loaded 1.0" in router.metrics.render()
        finally:
            await asyncio.wait_for(router.stop(), 30)

    asyncio.run(main())
