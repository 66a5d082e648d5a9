"""Decode planning: every running request computes its pending tokens (1, or a
jump-forward run). When the pool cannot hold them even after evicting the tree,
requests are retracted: their KV goes back to the tree (evictable), they return to
the front of the waiting queue with their output so far, and resume later with no
error to the user.
"""

from __future__ import annotations

from sgl.runtime.scheduler.kv_cache import KVCache
from sgl.runtime.scheduler.req import Req


def pick_victim(running: list[Req]) -> Req:
    """Least work lost first: fewest output tokens, then the longest prompt."""
    return min(running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))


def schedule_decode(kv: KVCache, running: list[Req], waiting: list[Req]) -> tuple[list[tuple[Req, int]], list[Req]]:
    """Returns (plan, retracted). Requests that cannot fit even alone are left for the
    caller to abort (they are returned in `retracted` with num_retractions < 0)."""
    retracted: list[Req] = []
    while running:
        need = sum(r.num_pending for r in running)
        if kv.available() >= need:
            break
        if len(running) == 1:
            victim = running[0]
            running.remove(victim)
            victim.num_retractions = -1  # cannot fit even alone
            retracted.append(victim)
            break
        victim = pick_victim(running)
        running.remove(victim)
        kv.release(victim)
        victim.num_retractions += 1
        waiting.insert(0, victim)
        retracted.append(victim)
    plan: list[tuple[Req, int]] = []
    for r in running:
        n = r.num_pending
        slots = kv.alloc(n)
        assert slots is not None, "decode allocation failed after the capacity check"
        kv.extend(r, slots)
        plan.append((r, n))
    return plan, retracted
