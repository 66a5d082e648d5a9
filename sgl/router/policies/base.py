"""The seam between the router's request path and its routing policies (plain data).

The request path (`sgl/router/app.py`) turns each request into a `RouteRequest`, asks the
policy to `select` one of the healthy candidate workers, and reports back with `on_done`.
The worker registry owns `WorkerState` objects (health, circuit breaker, in-flight counts);
policies only read them. A policy may run background work (event subscriptions, load
polling, tree eviction) between `start` and `stop`, on the router's event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class RouteRequest:
    """What a policy sees of one request."""

    endpoint: str  # "/generate", "/v1/completions", "/v1/chat/completions"
    text: str  # routing text: the prompt, or the rendered conversation for chat
    token_ids: list[int] | None = None  # the prompt's ids, when the client sent them or the router tokenized
    request_id: str | None = None


@dataclass
class WorkerState:
    """One worker as the registry sees it; policies read, the registry writes."""

    url: str  # "http://host:port", no trailing slash
    in_flight: int = 0  # requests this router has outstanding on it
    healthy: bool = True
    extra: dict[str, object] = field(default_factory=dict)  # registry-specific (server info, ...)


class Policy(Protocol):
    """Picks a worker for a request. `select` is called with at least one candidate, all
    healthy and with a closed circuit; it must return one of them and never block."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def add_worker(self, worker: WorkerState) -> None: ...

    def remove_worker(self, url: str) -> None: ...

    def select(self, req: RouteRequest, candidates: Sequence[WorkerState]) -> WorkerState: ...

    def on_done(self, req: RouteRequest, worker: WorkerState, ok: bool) -> None: ...

    def stats(self) -> dict[str, float]:
        """Numbers for the router's /metrics (e.g. tree_size, cache_hits, cache_misses)."""
        ...
