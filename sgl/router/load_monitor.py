"""Worker-reported load: polls each worker's `GET /get_load` and adds what we sent since.

A worker answers `/get_load` with one JSON object, or a list of them (one per DP rank);
its load is the sum over entries of the work standing before a new request's first token:
`num_pending_prefill_tokens` (queued prefill net of the prefix cache, which sgl workers
report) plus `DECODE_REQ_TOKENS` per running request; for other workers
`num_waiting_tokens + num_running_tokens`, or SGLang's `num_tokens`, or a bare `load`.
Full prompt lengths would overstate the load of the worker that holds a tenant's prefix
(its queue is mostly cache hits) and push the tenant's next requests elsewhere. Between two polls the router itself is the main source of change,
so `load(url)` is the last reported value plus the prompt tokens routed to the worker
since that poll was *sent* (not answered: a request routed while the poll was in flight
may not be in the answer, so it stays counted until the next one)::

    routed counter:  ... a ......... b ..... now
                         ^ poll sent  ^ answer arrives (reported = R)
    load(url) = R + (routed(now) - routed(a))

A worker that does not answer (no such endpoint, down, timeout) has load `None`
(unknown) until a poll succeeds again; policies then fall back to their own counts.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

logger = logging.getLogger(__name__)

# How long to wait before re-polling a worker whose last poll failed: it may simply not
# serve /get_load (a real SGLang worker of an older version), so don't hammer it.
FAILED_POLL_BACKOFF_SECS = 2.0


def parse_load(body: object) -> int | None:
    """Queued + running tokens from a `/get_load` JSON body; None when it has no such numbers."""
    entries = body if isinstance(body, list) else [body]
    total = 0
    found = False
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        value = _entry_load(entry)
        if value is not None:
            total += value
            found = True
    return total if found else None


# What a decoding request adds to the wait of a new one, in prefill tokens: a decode step
# serves every running request at once (the weights are read once per step), so each costs
# the queue about one token per step for the few steps it overlaps a new prefill.
DECODE_REQ_TOKENS = 8


def _entry_load(entry: dict[str, object]) -> int | None:
    pending, running_reqs = _num(entry.get("num_pending_prefill_tokens")), _num(entry.get("num_running_reqs"))
    if pending is not None:  # sgl workers: the prefill work queued, net of cache hits
        return int(pending + DECODE_REQ_TOKENS * (running_reqs or 0))
    waiting, running = _num(entry.get("num_waiting_tokens")), _num(entry.get("num_running_tokens"))
    if waiting is not None or running is not None:
        return int((waiting or 0) + (running or 0))
    for key in ("num_tokens", "load"):
        value = _num(entry.get(key))
        if value is not None:
            return int(value)
    return None


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


@dataclass
class _Worker:
    routed: int = 0  # prompt tokens routed to it, ever (monotonic)
    reported: int | None = None  # last /get_load answer; None: unknown
    routed_at_poll: int = 0  # `routed` when the answered poll was sent
    polls_ok: int = 0
    polls_failed: int = 0
    warned: bool = False  # a non-200 answer was logged (once per worker)
    task: asyncio.Task[None] | None = None


class LoadMonitor:
    """Polls `/get_load` of every added worker every `interval` seconds, one task per worker
    (a slow worker never delays another's numbers)."""

    def __init__(self, interval: float = 0.1, timeout: float = 2.0, headers: dict[str, str] | None = None) -> None:
        self.interval = interval
        self.timeout = timeout
        self.headers = dict(headers or {})  # the workers' API key, if any
        self._workers: dict[str, _Worker] = {}
        self._client: httpx.AsyncClient | None = None
        self._running = False
        self._ending: set[asyncio.Task[None]] = set()  # polls of removed workers, until they end

    # ---------------------------------------------------------------- workers
    def add_worker(self, url: str) -> None:
        if url in self._workers:
            return
        w = self._workers[url] = _Worker()
        if self._running:
            w.task = asyncio.get_running_loop().create_task(self._poll_loop(url, w))

    def remove_worker(self, url: str) -> None:
        w = self._workers.pop(url, None)
        if w is not None and w.task is not None:
            w.task.cancel()
            self._ending.add(w.task)
            w.task.add_done_callback(self._ending.discard)

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._running:
            return
        self._client = httpx.AsyncClient(timeout=self.timeout, headers=self.headers)
        self._running = True
        loop = asyncio.get_running_loop()
        for url, w in self._workers.items():
            w.task = loop.create_task(self._poll_loop(url, w))

    async def stop(self) -> None:
        self._running = False
        tasks = [w.task for w in self._workers.values() if w.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, *self._ending, return_exceptions=True)
        for w in self._workers.values():
            w.task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ---------------------------------------------------------------- reading
    def note_routed(self, url: str, tokens: int) -> None:
        w = self._workers.get(url)
        if w is not None:
            w.routed += tokens

    def record(self, url: str, value: int | None) -> None:
        """Take `value` as `url`'s answer to a poll sent now (in-process workers, simulators)."""
        w = self._workers.get(url)
        if w is not None:
            w.reported, w.routed_at_poll = value, w.routed

    def load(self, url: str) -> int | None:
        """Reported queued + running tokens plus tokens routed since that poll; None if unknown."""
        w = self._workers.get(url)
        if w is None or w.reported is None:
            return None
        return w.reported + (w.routed - w.routed_at_poll)

    def stats(self) -> dict[str, float]:
        return {
            "load_polls_ok": float(sum(w.polls_ok for w in self._workers.values())),
            "load_polls_failed": float(sum(w.polls_failed for w in self._workers.values())),
        }

    # ---------------------------------------------------------------- polling
    async def poll_once(self, url: str) -> bool:
        """Poll one worker now; True when it answered with a load."""
        w = self._workers.get(url)
        if w is None:
            return False
        client = self._client
        owned = client is None
        if client is None:
            client = httpx.AsyncClient(timeout=self.timeout, headers=self.headers)
        mark = w.routed
        try:
            resp = await client.get(f"{url}/get_load")
            value = parse_load(resp.json()) if resp.status_code == 200 else None
            if resp.status_code != 200 and not w.warned:
                w.warned = True  # e.g. 401 (wrong key) or 404 (an older worker): say it once
                logger.warning("GET %s/get_load answered %d; its load is unknown", url, resp.status_code)
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("load poll of %s failed: %s", url, exc)
            value = None
        finally:
            if owned:
                await client.aclose()
        if value is None:
            w.reported = None
            w.polls_failed += 1
            return False
        w.reported, w.routed_at_poll = value, mark
        w.polls_ok += 1
        return True

    async def _poll_loop(self, url: str, w: _Worker) -> None:
        while self._running and self._workers.get(url) is w:
            ok = await self.poll_once(url)
            await asyncio.sleep(self.interval if ok else max(self.interval, FAILED_POLL_BACKOFF_SECS))
