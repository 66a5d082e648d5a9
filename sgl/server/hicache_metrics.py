"""The hierarchical KV cache's /metrics series, read at scrape time from the engine's
server info (the scheduler's `hicache_*` and `storage_*` counters, scheduler/hicache.py
and scheduler/storage_tier.py): ours as `sgl_hicache_*`, and the same facts under
SGLang's names where SGLang exports them, so an SGLang HiCache dashboard reads an `sgl`
server unchanged.

The engine's numbers are running totals kept in the worker, so this is a custom
collector that reports them as they are at each scrape (a Prometheus `Counter` object
could only be incremented). Nothing is emitted while the hierarchical cache is off.

SGLang names used (their meaning there, in tokens, with the `model_name` label):
`sglang:hicache_host_used_tokens` / `sglang:hicache_host_total_tokens` (the host pool),
`sglang:load_back_tokens_total` (host -> device), `sglang:prefetched_tokens_total`
(storage -> host), `sglang:backuped_tokens_total` (host -> storage). SGLang's histograms
(`sglang:load_back_duration_seconds`, `sglang:prefetch_bandwidth`, ...) are not faked
from totals; their sums are `sgl_hicache_load_seconds_total` here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

TIERS = ("device", "host", "storage")


def _n(info: dict[str, Any], key: str) -> float | None:
    v = info.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class HiCacheCollector:
    """A prometheus_client collector over the latest server info (`update` sets it)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.info: dict[str, Any] = {}

    def update(self, info: dict[str, Any]) -> None:
        self.info = info

    def describe(self) -> list[Metric]:
        return []  # the set of series depends on the server's flags: nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        info = self.info
        if not info.get("hicache_enabled"):
            return
        page = _n(info, "hicache_page_size") or 1.0

        def gauge(name: str, help_: str, key: str, scale: float = 1.0) -> Iterator[Metric]:
            v = _n(info, key)
            if v is not None:
                yield GaugeMetricFamily(name, help_, value=v * scale)

        def counter(name: str, help_: str, key: str, scale: float = 1.0) -> Iterator[Metric]:
            v = _n(info, key)
            if v is not None:
                yield CounterMetricFamily(name, help_, value=v * scale)

        def per_tier(name: str, help_: str, keys: dict[str, str]) -> Iterator[Metric]:
            fam = CounterMetricFamily(name, help_, labels=["tier"])
            for tier, key in keys.items():
                v = _n(info, key)
                if v is not None:
                    fam.add_metric([tier], v)
            if fam.samples:
                yield fam

        # -- ours --------------------------------------------------------------------------
        yield GaugeMetricFamily("sgl_hicache_enabled", "1 when the hierarchical KV cache is on", value=1.0)
        yield from gauge("sgl_hicache_host_tokens_used", "Tokens of KV held in the host tier", "hicache_host_tokens_used")
        yield from gauge("sgl_hicache_host_tokens_total", "Host tier capacity in tokens", "hicache_host_tokens_total")
        yield from gauge("sgl_hicache_host_usage_ratio", "Host tier pages used / pages", "hicache_host_usage")
        yield from per_tier("sgl_hicache_hit_tokens", "Prompt tokens served from each KV tier",
                            {t: f"hicache_{t}_hit_tokens" for t in TIERS})
        yield from per_tier("sgl_hicache_bytes_loaded", "KV bytes loaded: host -> device, storage -> host",
                            {"host": "hicache_bytes_loaded", "storage": "storage_bytes_loaded"})
        yield from per_tier("sgl_hicache_bytes_stored", "KV bytes stored: device -> host, host -> storage",
                            {"host": "hicache_bytes_stored", "storage": "storage_bytes_written"})
        yield from per_tier("sgl_hicache_load_seconds", "Seconds spent loading KV: host -> device copies, "
                            "storage lookups and reads (background)",
                            {"host": "hicache_load_seconds", "storage": "storage_prefetch_seconds"})
        yield from counter("sgl_hicache_store_seconds", "Seconds spent copying KV device -> host",
                           "hicache_store_seconds")
        yield from counter("sgl_hicache_pages_demoted", "Device pages kept in the host tier at eviction",
                           "hicache_pages_demoted")
        yield from counter("sgl_hicache_host_pages_dropped", "Host pages dropped (LRU) to make room",
                           "hicache_host_pages_dropped")
        if info.get("storage_backend") is not None:
            yield from counter("sgl_hicache_storage_writes_dropped", "Storage writes dropped (queue full)",
                               "storage_writes_dropped")
            yield from counter("sgl_hicache_storage_corrupt_pages", "Storage pages failing their checksum "
                               "(treated as misses and deleted)", "storage_corrupt_pages")
            yield from gauge("sgl_hicache_storage_bytes_used", "Bytes held by the storage backend (file)",
                             "storage_bytes_used")
            yield from gauge("sgl_hicache_storage_connected", "1 while the storage backend is reachable (redis)",
                             "storage_connected")

        # -- SGLang's names ---------------------------------------------------------------------
        m = self.model_name

        def sg(fam: Metric, value: float | None) -> Iterator[Metric]:
            if value is not None:
                fam.add_metric([m], value)  # type: ignore[attr-defined]
                yield fam

        used, total = _n(info, "hicache_host_tokens_used"), _n(info, "hicache_host_tokens_total")
        yield from sg(GaugeMetricFamily("sglang:hicache_host_used_tokens", "Tokens of KV held in the host tier.",
                                        labels=["model_name"]), used)
        yield from sg(GaugeMetricFamily("sglang:hicache_host_total_tokens", "Host tier capacity in tokens.",
                                        labels=["model_name"]), total)
        host_hit, storage_hit = _n(info, "hicache_host_hit_tokens"), _n(info, "hicache_storage_hit_tokens")
        loaded = None if host_hit is None else host_hit + (storage_hit or 0.0)
        yield from sg(CounterMetricFamily("sglang:load_back_tokens", "Prompt tokens whose KV was copied host -> device.",
                                          labels=["model_name"]), loaded)
        if info.get("storage_backend") is not None:
            pre, back = _n(info, "storage_pages_prefetched"), _n(info, "storage_pages_written")
            yield from sg(CounterMetricFamily("sglang:prefetched_tokens", "Prompt tokens of KV read from storage into the host tier.",
                                              labels=["model_name"]), None if pre is None else pre * page)
            yield from sg(CounterMetricFamily("sglang:backuped_tokens", "Tokens of KV written from the host tier to storage.",
                                              labels=["model_name"]), None if back is None else back * page)
