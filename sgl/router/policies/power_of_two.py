"""`power_of_two`: two random candidates, the less loaded wins (SGLang's power-of-two choices).

Load is what the worker reports on `/get_load` (queued + running tokens, via
`LoadMonitor`) plus the prompt tokens this router sent it since that poll; ties, and
workers whose load is unknown, are decided by the router's own in-flight count. Two
random choices instead of the global minimum keep many routers (or a stale poll) from
stampeding the one worker that looked idlest.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from sgl.router.load_monitor import LoadMonitor
from sgl.router.policies.base import RouteRequest, WorkerState
from sgl.router.policies.options import PolicyOptions
from sgl.router.policies.simple import PolicyBase, prompt_tokens


class PowerOfTwoPolicy(PolicyBase):
    name = "power_of_two"

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self._rng = random.Random(self.options.seed)
        self.monitor = LoadMonitor(self.options.load_poll_interval_secs, self.options.http_timeout_secs,
                                   dict(self.options.worker_headers))

    async def start(self) -> None:
        await self.monitor.start()

    async def stop(self) -> None:
        await self.monitor.stop()

    def add_worker(self, worker: WorkerState) -> None:
        self.monitor.add_worker(worker.url)

    def remove_worker(self, url: str) -> None:
        self.monitor.remove_worker(url)

    def select(self, req: RouteRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        if len(candidates) == 1:
            chosen = candidates[0]
        else:
            i, j = self._rng.sample(range(len(candidates)), 2)
            a, b = candidates[i], candidates[j]
            la, lb = self.monitor.load(a.url), self.monitor.load(b.url)
            if la is not None and lb is not None and la != lb:
                chosen = a if la < lb else b
            else:
                chosen = a if a.in_flight <= b.in_flight else b
        self.monitor.note_routed(chosen.url, prompt_tokens(req))
        return chosen

    def stats(self) -> dict[str, float]:
        return self.monitor.stats()
