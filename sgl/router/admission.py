"""Admission control: at most `max_concurrent` generation requests proxied at once, a
bounded FIFO queue behind them, 429 when the queue is full and 408 when a request waited
longer than the queue timeout (sglang-router's answers).

A released slot is handed directly to the oldest waiter, so a burst cannot overtake the
queue. `limit <= 0` admits everything (no bookkeeping beyond counters for /metrics).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class Rejected(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Admission:
    def __init__(self, limit: int, queue_size: int, queue_timeout_secs: float) -> None:
        self.limit = limit
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout_secs
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.rejected_full = 0
        self.rejected_timeout = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.limit <= 0 or (self.active < self.limit and not self._waiters):
            self.active += 1
            return
        if len(self._waiters) >= self.queue_size:
            self.rejected_full += 1
            raise Rejected(429, f"too many requests: {self.active} running and {len(self._waiters)} queued "
                                f"(--max-concurrent-requests {self.limit}, --queue-size {self.queue_size})")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot arrived as we gave up: pass it on
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            if isinstance(e, asyncio.CancelledError):
                raise
            self.rejected_timeout += 1
            raise Rejected(408, f"request waited {self.queue_timeout:g}s in the router's queue "
                                f"(--queue-timeout-secs) without a free slot") from None
        # The slot was transferred by release(): `active` already counts it.

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand the slot over; active stays the same
                return
        self.active -= 1

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()
