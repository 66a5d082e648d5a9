"""How many drafts are worth verifying: acceptance seen so far against the measured cost
of a row.

A draft row costs `row_cost` of a one-row decode step (measured at start, calibrate.py:
~0.05 where a step streams weights, ~1 where each row is computed on its own, as in a
scalar kernel). A request's drafts are accepted one after another with probability p
each (estimated per request, decayed so it follows the text), so its j-th draft yields a
token with probability p^j. A step's throughput is expected tokens / time; adding a draft
with acceptance q raises it iff q / row_cost > tokens / time. Drafts are added greedily,
most likely first, while that holds:

    tokens = B (one per request), time = 1 + row_cost * (B - 1)
    for q in sorted(p_r^j, descending): if q * time <= row_cost * tokens: stop
                                        tokens += q; time += row_cost

A request that stopped drafting is probed with one draft every PROBE_EVERY steps, so a
text that turns repetitive is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # weight of past steps in a request's acceptance estimate
PROBE_EVERY = 8


@dataclass
class _Seen:
    accepted: float = 1.0  # prior: one accepted and one rejected draft (p = 0.5)
    rejected: float = 1.0
    idle: int = 0  # steps since its last draft

    @property
    def p(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class DraftPolicy:
    def __init__(self, row_cost: float | None) -> None:
        self.row_cost = row_cost  # None: every proposed draft is verified (no gating)
        self._seen: dict[int, _Seen] = {}

    def lengths(self, uids: list[int], proposed: list[int]) -> list[int]:
        """How many of each request's proposed drafts to verify this step."""
        if self.row_cost is None:
            return list(proposed)
        seen = [self._seen.setdefault(u, _Seen()) for u in uids]
        out = [0] * len(uids)
        cands = sorted(((s.p ** (j + 1), i) for i, (s, n) in enumerate(zip(seen, proposed)) for j in range(n)),
                       reverse=True)
        c = max(self.row_cost, 1e-6)
        tokens, time = float(len(uids)), 1.0 + c * (len(uids) - 1)
        for q, i in cands:  # q falls along each request's drafts, so its drafts come in order
            if q * time <= c * tokens:
                break
            out[i] += 1
            tokens += q
            time += c
        for i, s in enumerate(seen):
            if out[i] == 0 and proposed[i] > 0:
                s.idle += 1
                if s.idle >= PROBE_EVERY:
                    out[i] = 1
            if out[i]:
                s.idle = 0
        return out

    def observe(self, uid: int, drafted: int, accepted: int) -> None:
        """A verified step: `accepted` of `drafted` drafts stood (a rejection ends a run)."""
        if drafted == 0 or self.row_cost is None:
            return
        s = self._seen.setdefault(uid, _Seen())
        s.accepted = DECAY * s.accepted + accepted
        s.rejected = DECAY * s.rejected + (1 if accepted < drafted else 0)

    def release(self, uid: int) -> None:
        self._seen.pop(uid, None)
