"""The set of workers the router knows, and which of them may take a request now.

Each `Worker` pairs the policy-facing `WorkerState` (url, in-flight count, healthy flag)
with what only the router tracks: its circuit breaker and health-check streaks. A worker is
a *candidate* when it is healthy and its circuit allows a request. Removing a worker takes
it out of the set and the policy at once; requests already on it keep their `Worker`
object and finish normally (their bookkeeping touches only that object).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sgl.router.circuit import CircuitBreaker, CircuitOptions
from sgl.router.policies.base import Policy, WorkerState


@dataclass
class Worker:
    state: WorkerState
    circuit: CircuitBreaker
    health_failures: int = 0  # consecutive failed checks
    health_successes: int = 0  # consecutive passed checks
    last_error: str | None = None
    requests_total: int = 0
    failures_total: int = 0
    info: dict[str, object] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.state.url

    def available(self) -> bool:
        return self.state.healthy and self.circuit.allow()

    def describe(self) -> dict[str, object]:
        return {"url": self.url, "healthy": self.state.healthy, "in_flight": self.state.in_flight,
                "circuit": self.circuit.state, "requests_total": self.requests_total,
                "failures_total": self.failures_total, "last_error": self.last_error}


class Registry:
    def __init__(self, policy: Policy, circuit: CircuitOptions) -> None:
        self.policy = policy
        self.circuit_opts = circuit
        self._workers: dict[str, Worker] = {}

    def __contains__(self, url: str) -> bool:
        return url in self._workers

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def add(self, url: str, healthy: bool = True) -> Worker:
        if url in self._workers:
            return self._workers[url]
        w = Worker(WorkerState(url=url, healthy=healthy), CircuitBreaker(self.circuit_opts))
        self._workers[url] = w
        self.policy.add_worker(w.state)
        return w

    def remove(self, url: str) -> Worker | None:
        w = self._workers.pop(url, None)
        if w is not None:
            self.policy.remove_worker(url)
        return w

    def candidates(self, exclude: Iterable[str] = ()) -> list[Worker]:
        """Workers a request may go to now, leaving out `exclude` (those it already failed on)
        unless nothing else is left."""
        avail = [w for w in self._workers.values() if w.available()]
        skip = set(exclude)
        fresh = [w for w in avail if w.url not in skip]
        return fresh or avail

    def healthy(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.state.healthy]

    def record_health(self, w: Worker, ok: bool, error: str | None, failure_threshold: int,
                      success_threshold: int) -> bool | None:
        """Apply one health-check result; returns the new `healthy` flag when it changed."""
        if ok:
            w.health_failures, w.health_successes = 0, w.health_successes + 1
            if not w.state.healthy and w.health_successes >= success_threshold:
                w.state.healthy, w.last_error = True, None
                return True
        else:
            w.health_successes, w.health_failures = 0, w.health_failures + 1
            w.last_error = error
            if w.state.healthy and w.health_failures >= failure_threshold:
                w.state.healthy = False
                return False
        return None
