"""Per-worker circuit breaker: failed requests take a worker out of rotation for a while.

    closed --(failure_threshold consecutive failures within the window)--> open
    open --(timeout elapsed; the next `allow()` lets one trial through)--> half_open
    half_open --(success_threshold successes)--> closed
    half_open --(any failure)--> open (the timeout starts again)

Half-open admits one trial at a time: `allow()` says whether the worker may be *chosen*;
the request path calls `begin()` when it sends one there, and `record()` (or `abandon()`,
when the client left) ends the trial, so the next may go.

Health checks are a separate signal (registry.py): a worker is routed to only when it is
healthy *and* its circuit allows. The clock is injectable so the transitions are tested
without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_CODE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}  # the value of the sgl_router_circuit_state gauge


@dataclass(frozen=True)
class CircuitOptions:
    failure_threshold: int = 10
    success_threshold: int = 3
    timeout_secs: float = 60.0
    window_secs: float = 120.0
    enabled: bool = True


class CircuitBreaker:
    def __init__(self, opts: CircuitOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.opts = opts
        self.clock = clock
        self._state = CLOSED
        self._failures = 0  # consecutive, while closed
        self._last_failure = 0.0
        self._successes = 0  # while half-open
        self._opened_at = 0.0
        self._trial = False  # a half-open trial request is outstanding
        self.opened_total = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self.clock() - self._opened_at >= self.opts.timeout_secs:
            return HALF_OPEN  # reported as half-open once the timeout is over; allow() makes it so
        return self._state

    def allow(self) -> bool:
        """Whether a request may go to this worker now."""
        if not self.opts.enabled:
            return True
        if self._state == OPEN and self.clock() - self._opened_at >= self.opts.timeout_secs:
            self._state, self._successes, self._trial = HALF_OPEN, 0, False
        return self._state == CLOSED or (self._state == HALF_OPEN and not self._trial)

    def begin(self) -> None:
        """A request is being sent to this worker; while half-open it is the one trial."""
        if self.opts.enabled and self._state == HALF_OPEN:
            self._trial = True

    def abandon(self) -> None:
        """The request ended without a verdict on the worker (the client left)."""
        self._trial = False

    def record(self, ok: bool) -> None:
        self._trial = False
        if not self.opts.enabled:
            return
        now = self.clock()
        if ok:
            if self._state == HALF_OPEN:
                self._successes += 1
                if self._successes >= self.opts.success_threshold:
                    self._state, self._failures = CLOSED, 0
            else:
                self._failures = 0
            return
        if self._state == HALF_OPEN:
            self._open(now)
            return
        if now - self._last_failure > self.opts.window_secs:
            self._failures = 0  # the earlier failures are too old to count
        self._failures += 1
        self._last_failure = now
        if self._state == CLOSED and self._failures >= self.opts.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state, self._opened_at, self._successes = OPEN, now, 0
        self.opened_total += 1
