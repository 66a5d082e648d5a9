"""The scheduler's counters and current load as plain data (/get_server_info, /metrics).

num_running_tokens: context held by admitted requests (prompt + output so far);
num_waiting_tokens: tokens waiting requests will prefill (their prompt, plus the output
so far of a retracted one); num_pending_prefill_tokens: the prefill work queued, i.e. what
the cache does not cover of the waiting requests (a read-only tree match each) plus what
admitted requests have still to prefill; generated_tokens_total: every output token so
far, running requests included (generation_tokens_total counts at finish only).
"""

from __future__ import annotations

from typing import Any


def scheduler_snapshot(s: Any) -> dict[str, Any]:
    """Counters and the current load of scheduler `s` (cheap: sums per-request lengths)."""
    kv = s.kv
    total = kv.allocator.capacity
    free = kv.allocator.num_free
    prompt = s.stats["prompt_tokens_total"]
    admitted = s.running + s.prefilling
    queued = s.waiting + s.grammar_wait
    live_output = sum(len(r.output_ids) for r in admitted + queued)
    return {
        **s.stats,
        "num_running_reqs": len(admitted),
        "num_waiting_reqs": len(queued),
        "num_running_tokens": sum(r.fill_len for r in admitted),
        "num_waiting_tokens": sum(r.fill_len for r in queued),
        "num_pending_prefill_tokens": sum(r.fill_len - kv.tree.prefix_len(r.fill_ids) for r in queued)
        + sum(max(r.fill_len - r.num_computed, 0) for r in s.prefilling),
        "generated_tokens_total": s.stats["generation_tokens_total"] + live_output,
        "max_total_tokens": total,
        "kv_total_tokens": total,
        "kv_free_tokens": free,
        "kv_used_tokens": total - free,
        "kv_cached_tokens": kv.tree.total_size(),
        "kv_evictable_tokens": kv.tree.evictable_size(),
        "kv_usage": (total - free) / total if total else 0.0,
        "cache_hit_rate": (s.stats["cached_tokens_total"] / prompt) if prompt else 0.0,
        **_hicache(s),
        **(s.spec.snapshot() if s.spec is not None else {"spec_algorithm": None}),
        **(s.pd.snapshot() if s.pd is not None else {"disaggregation_mode": "null"}),
    }


def _hicache(s: Any) -> dict[str, Any]:
    hc = s.kv.hicache
    if hc is None:
        return {"hicache_enabled": False}
    host_pool = getattr(s.executor, "host_pool", None)
    out = {"hicache_enabled": True, **hc.snapshot(host_pool.page_nbytes if host_pool is not None else 0)}
    out.update(getattr(s.executor, "copy_stats", {}))
    return out
