"""The router's startup in-process, against real loopback HTTP workers (no model): it serves
as soon as one listed worker is healthy (a dead one joins later or never), and it keeps
fetching the workers' tokenizer until one serves it (`sgl_router_tokenizer_loaded`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from sgl.router.config import RouterConfig
from sgl.router.state import Router
from tests.server_proc import free_port
from tests.test_router_tokenizer import _tiny_tokenizer_json
from tests.json_http import JsonServer


class FakeWorker(JsonServer):
    """/health answers 200; /get_tokenizer 503 until `tokenizer_ready` is set."""

    def __init__(self) -> None:
        self.tokenizer_ready = threading.Event()
        self.tokenizer_asks = 0
        super().__init__(self._answer)

    def _answer(self, path: str, headers: object) -> tuple[int, object]:
        if path == "/health":
            return 200, {}
        if path == "/get_tokenizer":
            self.tokenizer_asks += 1
            if self.tokenizer_ready.is_set():
                return 200, {"tokenizer_json": _tiny_tokenizer_json()}
            return 503, {"error": "busy"}
        return 404, {}


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


@pytest.mark.timeout(120)
def test_a_discovered_worker_failing_its_first_checks_is_tried_again_until_it_joins() -> None:
    # Kubernetes sends no further event while a pod stays Ready, so the router must keep trying.
    checks = {"n": 0}

    def answer(path: str, headers: object) -> tuple[int, object]:
        if path == "/health":
            checks["n"] += 1
            return (503, {"error": "warming up"}) if checks["n"] <= 4 else (200, {})
        return 404, {}

    server = JsonServer(answer)
    cfg = RouterConfig(worker_startup_timeout_secs=0.2, policy="round_robin").resolved()

    async def main() -> None:
        router = Router(cfg)
        try:
            await asyncio.wait_for(router.start(), 60)
            adding = asyncio.get_running_loop().create_task(router.add_discovered(server.url, retry_initial_s=0.05))
            await asyncio.wait_for(adding, 60)
            w = router.registry.get(server.url)
            assert w is not None and w.state.healthy and checks["n"] == 5
            # a pod that never passes is retried until discovery cancels it (the pod went away)
            checks["n"] = -10**9
            router.remove_worker(server.url)
            adding = asyncio.get_running_loop().create_task(router.add_discovered(server.url, retry_initial_s=0.05))
            await _until(lambda: checks["n"] >= -10**9 + 3, "checked again after failing")
            adding.cancel()
            await asyncio.gather(adding, return_exceptions=True)
            assert router.registry.get(server.url) is None
        finally:
            await asyncio.wait_for(router.stop(), 30)
            server.close()

    asyncio.run(main())
