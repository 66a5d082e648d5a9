"""Prometheus metrics for one server app, in a registry of its own.

Request counts and latencies are observed by the access-log middleware and the engine
client as requests happen; engine state (running/waiting requests, KV usage, cache hit
rate) is read from `engine.get_server_info()` at scrape time, so `/metrics` always shows
the current pool. A private `CollectorRegistry` keeps two apps in one process (tests)
from colliding.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# Engine server-info keys exported as gauges: key -> (metric name, help).
_ENGINE_GAUGES = {
    "num_running_reqs": ("sgl_num_running_reqs", "Requests in the running (decode) batch"),
    "num_waiting_reqs": ("sgl_num_waiting_reqs", "Requests waiting for admission"),
    "kv_used_tokens": ("sgl_kv_used_tokens", "KV pool slots in use (including evictable cache)"),
    "kv_free_tokens": ("sgl_kv_free_tokens", "KV pool slots free"),
    "kv_total_tokens": ("sgl_kv_total_tokens", "KV pool capacity in tokens"),
    "cache_hit_rate": ("sgl_cache_hit_rate", "Fraction of prompt tokens served from the radix cache"),
}


class Metrics:
    """All metrics of one app; methods are cheap and safe to call from handlers."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("sgl_http_requests", "HTTP requests by path and status",
                                ["path", "status"], registry=r)
        self.in_flight = Gauge("sgl_http_requests_in_flight", "HTTP requests being served", registry=r)
        self.prompt_tokens = Counter("sgl_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("sgl_generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("sgl_cached_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.finished = Counter("sgl_generation_requests", "Finished generations by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("sgl_time_to_first_token_seconds", "Time to first token (streamed requests)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("sgl_time_per_output_token_seconds", "Mean inter-token latency per request",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("sgl_e2e_request_latency_seconds", "Generation latency from submit to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_usage = Gauge("sgl_kv_usage_ratio", "kv_used_tokens / kv_total_tokens", registry=r)
        self.engine_gauges = {k: Gauge(name, help_, registry=r) for k, (name, help_) in _ENGINE_GAUGES.items()}

    def observe_http(self, path: str, status: int) -> None:
        self.requests.labels(path=path, status=str(status)).inc()

    def observe_generation(self, meta: dict[str, Any], latency_s: float, ttft_s: float | None) -> None:
        """Account one finished generation (one choice) from its meta_info."""
        prompt = int(meta.get("prompt_tokens") or 0)
        completion = int(meta.get("completion_tokens") or 0)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(int(meta.get("cached_tokens") or 0))
        fr = meta.get("finish_reason")
        self.finished.labels(finish_reason=(fr or {}).get("type", "none") if isinstance(fr, dict) else str(fr)).inc()
        self.e2e.observe(latency_s)
        if ttft_s is None and isinstance(meta.get("ttft"), (int, float)):
            ttft_s = float(meta["ttft"])  # the engine measures it for non-streamed requests
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if completion > 1:
                self.tpot.observe(max(latency_s - ttft_s, 0.0) / (completion - 1))

    def render(self, server_info: dict[str, Any] | None) -> bytes:
        """Prometheus text exposition, with engine gauges refreshed from `server_info`."""
        info = server_info or {}
        for key, gauge in self.engine_gauges.items():
            val = info.get(key)
            if isinstance(val, (int, float)) and not isinstance(val, bool):
                gauge.set(val)
        used, total = info.get("kv_used_tokens"), info.get("kv_total_tokens")
        if isinstance(used, (int, float)) and isinstance(total, (int, float)) and total:
            self.kv_usage.set(used / total)
        return generate_latest(self.registry)
