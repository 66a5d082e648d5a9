"""The set of workers the router knows, and which of them may take a request now.

Each `Worker` pairs the policy-facing `WorkerState` (url, in-flight count, healthy flag)
with what only the router tracks: its circuit breaker and health-check streaks. A worker is
a *candidate* when it is healthy and its circuit allows a request. Removing a worker takes
it out of the set and the policy at once; requests already on it keep their `Worker`
object and finish normally (their bookkeeping touches only that object).

A `Registry` is one worker set with its own policy: the only one in regular mode, the
prefill set and the decode set in PD mode. `Fleet` is every set of one router, for what
spans them (health checks, /get_server_info, /flush_cache, the tokenizer).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

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
    role: str = "worker"  # "worker" (regular mode), "prefill" or "decode" (PD mode)
    bootstrap_port: int | None = None  # a prefill's --disaggregation-bootstrap-port, as configured

    @property
    def url(self) -> str:
        return self.state.url

    @property
    def host(self) -> str:
        """The URL's host, verbatim (a name is not resolved): a prefill's bootstrap_host."""
        return urlsplit(self.url).hostname or ""

    def available(self) -> bool:
        return self.state.healthy and self.circuit.allow()

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {"url": self.url, "role": self.role, "healthy": self.state.healthy,
                                  "in_flight": self.state.in_flight, "circuit": self.circuit.state,
                                  "requests_total": self.requests_total, "failures_total": self.failures_total,
                                  "last_error": self.last_error}
        if self.role == "prefill":
            out["bootstrap_port"] = self.bootstrap_port
        return out


class Registry:
    def __init__(self, policy: Policy, circuit: CircuitOptions, role: str = "worker") -> None:
        self.policy = policy
        self.circuit_opts = circuit
        self.role = role
        self._workers: dict[str, Worker] = {}

    def __contains__(self, url: str) -> bool:
        return url in self._workers

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def add(self, url: str, healthy: bool = True, bootstrap_port: int | None = None) -> Worker:
        if url in self._workers:
            return self._workers[url]
        w = Worker(WorkerState(url=url, healthy=healthy), CircuitBreaker(self.circuit_opts), role=self.role,
                   bootstrap_port=bootstrap_port)
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


class Fleet:
    """Every worker set of one router (one in regular mode; prefill and decode in PD mode)."""

    def __init__(self, sets: Sequence[Registry]) -> None:
        self.sets = list(sets)

    def role(self, role: str) -> Registry | None:
        return next((r for r in self.sets if r.role == role), None)

    def owner(self, url: str) -> Registry | None:
        return next((r for r in self.sets if url in r), None)

    def __contains__(self, url: str) -> bool:
        return self.owner(url) is not None

    def get(self, url: str) -> Worker | None:
        r = self.owner(url)
        return r.get(url) if r is not None else None

    def all(self) -> list[Worker]:
        return [w for r in self.sets for w in r.all()]

    def healthy(self) -> list[Worker]:
        return [w for r in self.sets for w in r.healthy()]

    def available_by_role(self) -> dict[str, int]:
        """Workers in rotation (healthy, circuit allowing) per set."""
        return {r.role: sum(1 for w in r.all() if w.available()) for r in self.sets}

    def record_health(self, w: Worker, ok: bool, error: str | None, failure_threshold: int,
                      success_threshold: int) -> bool | None:
        r = self.owner(w.url)
        return r.record_health(w, ok, error, failure_threshold, success_threshold) if r is not None else None
