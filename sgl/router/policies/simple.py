"""Load-blind policies (round robin, random) and `PolicyBase`, the no-op half of `Policy`.

`PolicyBase` gives every policy empty `start`/`stop`/`add_worker`/`remove_worker`/`on_done`
and `stats`, so a policy only writes what it uses. `prompt_tokens` is the one place that
turns a request into a token count when the router did not tokenize it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from sgl.router.policies.base import RouteRequest, WorkerState
from sgl.router.policies.options import PolicyOptions

# Characters per token when only text is known: English BPE vocabularies average ~4.
CHARS_PER_TOKEN = 4


def prompt_tokens(req: RouteRequest) -> int:
    """The request's prompt length in tokens: exact from ids, else estimated from the text."""
    if req.token_ids is not None:
        return len(req.token_ids)
    return (len(req.text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


class PolicyBase:
    name = "base"

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.options = options or PolicyOptions()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def add_worker(self, worker: WorkerState) -> None:
        pass

    def remove_worker(self, url: str) -> None:
        pass

    def on_done(self, req: RouteRequest, worker: WorkerState, ok: bool) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


class RoundRobinPolicy(PolicyBase):
    """Candidates in turn. The counter is global, not per candidate list, so when the set
    of healthy workers changes the rotation simply continues over the new list."""

    name = "round_robin"

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self._next = 0

    def select(self, req: RouteRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return worker


class RandomPolicy(PolicyBase):
    name = "random"

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self._rng = random.Random(self.options.seed)

    def select(self, req: RouteRequest, candidates: Sequence[WorkerState]) -> WorkerState:
        return candidates[self._rng.randrange(len(candidates))]
