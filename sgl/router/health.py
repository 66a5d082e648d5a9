"""Worker health: the periodic checker, and the wait for a new worker's first good check.

Every `--health-check-interval-secs` each worker's `--health-check-endpoint` is fetched
(within `--health-check-timeout-secs`), in every worker set (PD mode: prefill and decode);
`--health-failure-threshold` failures in a row take it out of rotation,
`--health-success-threshold` passes in a row bring it back.
Besides the timer, the request path calls `probe_soon(url)` when a request to a worker
failed to connect, so a dead worker leaves rotation without waiting for the next tick.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from sgl.router.registry import Fleet, Worker

logger = logging.getLogger("sgl.router")


async def check_once(client: httpx.AsyncClient, url: str, endpoint: str, timeout: float,
                     headers: dict[str, str] | None = None) -> str | None:
    """None when `url` + `endpoint` answers 200 in time, else the reason."""
    try:
        r = await client.get(url + endpoint, timeout=timeout, headers=headers)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return None if r.status_code == 200 else f"health check answered {r.status_code}"


async def wait_healthy(client: httpx.AsyncClient, url: str, endpoint: str, timeout: float, deadline_secs: float,
                       headers: dict[str, str] | None = None, poll_secs: float = 0.5) -> str | None:
    """Poll until `url` passes a check (None) or `deadline_secs` pass (the last reason)."""
    deadline = time.monotonic() + deadline_secs
    while True:
        err = await check_once(client, url, endpoint, min(timeout, max(0.1, deadline - time.monotonic())), headers)
        if err is None or time.monotonic() + poll_secs > deadline:
            return err
        await asyncio.sleep(poll_secs)


class HealthChecker:
    def __init__(self, registry: Fleet, client: httpx.AsyncClient, *, endpoint: str, timeout: float,
                 interval: float, failure_threshold: int, success_threshold: int,
                 headers: dict[str, str] | None = None) -> None:
        self.registry = registry
        self.client = client
        self.endpoint = endpoint
        self.timeout = timeout
        self.interval = interval
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.headers = headers
        self._task: asyncio.Task[None] | None = None
        self._probing: set[str] = set()
        self._probes: set[asyncio.Task[None]] = set()  # held, so stop() can end them

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        tasks = [*self._probes, *([self._task] if self._task is not None else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await asyncio.gather(*(self.check(w) for w in self.registry.all()), return_exceptions=True)

    async def check(self, w: Worker) -> None:
        err = await check_once(self.client, w.url, self.endpoint, self.timeout, self.headers)
        if self.registry.get(w.url) is not w:
            return  # removed meanwhile
        changed = self.registry.record_health(w, err is None, err, self.failure_threshold, self.success_threshold)
        if changed is False:
            logger.warning("worker %s left rotation: %s", w.url, err)
        elif changed is True:
            logger.info("worker %s is healthy again", w.url)

    def probe_soon(self, url: str) -> None:
        """Check `url` now, once at a time, repeating the checks (no sleep between failures
        beyond the timeout) until the worker either leaves rotation or passes."""
        if url in self._probing:
            return
        self._probing.add(url)
        task = asyncio.get_running_loop().create_task(self._probe(url))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, url: str) -> None:
        try:
            for _ in range(self.failure_threshold):
                w = self.registry.get(url)
                if w is None or not w.state.healthy:
                    return
                before = w.health_failures
                await self.check(w)
                if w.health_failures <= before:
                    return  # it passed: the failed request was a fluke
                await asyncio.sleep(0.05)
        finally:
            self._probing.discard(url)
