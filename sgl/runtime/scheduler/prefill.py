"""Prefill admission: which waiting requests enter the next prefill batch, and how many
of their tokens (chunked prefill) this step computes.

A request is admitted when a request->token row is free, the running set has room,
and the rest of its prompt, with the rest of every prompt being chunked, fits in the KV
pool (free + evictable) beyond a reserve kept for the running requests' future decode
tokens. Slots are allocated here, so each admission
sees the pool as the previous one left it. A waiting request that shares a long uncached
prefix with one admitted in the same batch is deferred one step: after that step the
prefix is in the tree and it is reused instead of computed twice (n>1, forks, batches).

With the hierarchical cache, the device hit is continued from the host and storage tiers:
those tokens get fresh slots (allocated with the new ones) and are loaded, not computed,
so they cost KV space but no prefill budget. A request whose storage prefetch the policy
says to wait for stays in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl.runtime.scheduler.kv_cache import KVCache
from sgl.runtime.scheduler.policy import order_waiting
from sgl.runtime.scheduler.req import Req

SHARED_PREFIX_DEFER = 32  # tokens of uncached overlap that make a request wait one step


@dataclass
class PrefillLimits:
    max_prefill_tokens: int
    chunk_size: int
    max_running: int
    decode_reserve: int  # slots kept free for running requests' decode steps


def _shares_uncached_prefix(req: Req, matched: int, admitted: list[Req]) -> bool:
    fill = req.fill_ids
    end = matched + SHARED_PREFIX_DEFER
    if len(fill) < end:
        return False
    head = fill[:end]
    return any(len(a.input_ids) >= end and a.fill_ids[:end] == head for a in admitted)


def _unlock(kv: KVCache, req: Req) -> None:
    kv.tree.dec_lock_ref(req.last_node)
    req.last_node = None
    req.slots = []
    req.num_tree_tokens = 0


def schedule_prefill(
    kv: KVCache, policy: str, waiting: list[Req], prefilling: list[Req], num_running: int, lim: PrefillLimits
) -> list[tuple[Req, int]]:
    """Returns the plan; moves admitted requests from `waiting` to `prefilling`."""
    plan: list[tuple[Req, int]] = []
    budget = lim.max_prefill_tokens
    for req in prefilling:  # chunked requests continue first
        n = min(req.num_pending, lim.chunk_size, budget)
        if n <= 0:
            break
        slots = kv.alloc(n)
        if slots is None:
            break
        kv.extend(req, slots)
        budget -= n
        plan.append((req, n))
    if not waiting or budget <= 0:
        return plan
    admitted: list[Req] = []
    chunked = sum(p.num_pending for p in prefilling)  # prompt tokens still to come, kept up to date below
    for req in order_waiting(policy, waiting, kv.tree):
        if num_running + len(prefilling) >= lim.max_running or budget <= 0:
            break
        if kv.hicache is not None and kv.hicache.storage_pending(req):
            continue
        max_match = max(0, req.fill_len - 1)
        if req.wants_input_logprobs:
            max_match = max(0, min(max_match, req.first_logprob_row()))
        matched = kv.match_and_lock(req, max_match)
        hit = kv.match_lower_tiers(req, max_match)
        if _shares_uncached_prefix(req, matched + hit.num_tokens, admitted):
            _unlock(kv, req)
            continue
        rest = req.fill_len - matched - hit.num_tokens
        n = min(rest, lim.chunk_size, budget)
        # Room for the whole rest of its prompt and of every prompt being chunked, not only
        # this chunk: two chunked prompts that fit the pool only one at a time would each
        # hold half of it and wait for the other for good.
        if kv.available() < hit.num_tokens + rest + chunked + lim.decode_reserve and (plan or num_running
                                                                                        or prefilling):
            _unlock(kv, req)
            break
        slots = kv.alloc(hit.num_tokens + n)
        if slots is None or not kv.attach_row(req):
            if slots is not None:
                kv.allocator.free(slots)
            _unlock(kv, req)
            break
        kv.extend(req, slots)
        if hit.loads:
            assert kv.hicache is not None
            kv.hicache.commit(hit, slots)
        if not req.admitted_once:
            req.num_cached_tokens = matched + hit.num_tokens
            if kv.hicache is not None:
                req.cached_tokens_details = {"device": matched, "host": hit.host_tokens,
                                             "storage": hit.storage_tokens}
                kv.hicache.stats["hicache_device_hit_tokens"] += matched
            req.admitted_once = True
        budget -= n
        chunked += req.num_pending
        waiting.remove(req)
        prefilling.append(req)
        admitted.append(req)
        plan.append((req, n))
    return plan
