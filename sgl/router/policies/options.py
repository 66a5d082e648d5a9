"""The knobs every routing policy reads, in one frozen dataclass (plain data, no parsing).

Names and defaults of the cache-aware knobs are sglang-router's (`--cache-threshold`,
`--balance-abs-threshold`, ...), so the router's CLI can map its flags one to one; the rest
are ours (load polling, KV-event staleness, the kv_aware cost weight). Each field's help is
its `metadata["help"]`, for a CLI generated from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _f(default: object, help: str) -> object:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class PolicyOptions:
    cache_threshold: float = _f(  # type: ignore[assignment]
        0.3,
        "cache_aware: route to the worker with the longest prefix match when "
        "matched/len >= this; else to the worker with the smallest tree",
    )
    balance_abs_threshold: int = _f(  # type: ignore[assignment]
        64,
        "cache_aware: the load is imbalanced when (max_load - min_load) > this "
        "and the relative threshold also trips; then route to the least loaded",
    )
    balance_rel_threshold: float = _f(  # type: ignore[assignment]
        1.5,
        "cache_aware: the load is imbalanced when max_load > min_load * this "
        "and the absolute threshold also trips",
    )
    eviction_interval_secs: float = _f(  # type: ignore[assignment]
        60.0, "seconds between LRU evictions of the approximate prefix trees"
    )
    max_tree_size: int = _f(  # type: ignore[assignment]
        2**22, "approximate tree: most tokens (or characters) kept per worker after an eviction (~80 "
        "bytes each: ~330 MB per worker at the default; a tree past twice this is trimmed at once)"
    )
    load_poll_interval_secs: float = _f(  # type: ignore[assignment]
        0.1, "power_of_two / kv_aware: seconds between GET /get_load polls of each worker"
    )
    kv_aware_prefill_weight: float = _f(  # type: ignore[assignment]
        16.0,
        "kv_aware: w in cost = w * uncached_prefill_tokens + load_tokens "
        "(see policies/kv_aware.py for why)",
    )
    kv_events_stale_secs: float = _f(  # type: ignore[assignment]
        3.0,
        "kv_aware: a worker whose event stream (heartbeats included) is silent this long "
        "is scored by the approximate tree instead of its events",
    )
    kv_events_cleared_grace_secs: float = _f(  # type: ignore[assignment]
        2.0,
        "kv_aware: after AllBlocksCleared, score the worker approximately this long "
        "(its index is empty but it may be refilling)",
    )
    http_timeout_secs: float = _f(  # type: ignore[assignment]
        2.0, "timeout of the policies' own HTTP calls (/get_load, /get_server_info)"
    )
    seed: int | None = _f(None, "random / power_of_two: RNG seed (None: from the OS)")  # type: ignore[assignment]
    # Not a flag: the router fills it from --api-key, so the policies' own calls authenticate.
    worker_headers: tuple[tuple[str, str], ...] = field(  # type: ignore[assignment]
        default=(), metadata={"help": "headers of the policies' HTTP calls to the workers", "cli": False})

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        for name in (
            "balance_abs_threshold",
            "eviction_interval_secs",
            "max_tree_size",
            "kv_aware_prefill_weight",
            "kv_events_stale_secs",
            "kv_events_cleared_grace_secs",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("load_poll_interval_secs", "http_timeout_secs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
