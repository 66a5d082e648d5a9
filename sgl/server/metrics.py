"""Prometheus metrics for one server app, in a registry of its own: ours (`sgl_*`) and the
same facts under SGLang's names (`sglang:*`), so SGLang's Grafana dashboard and the
Kubernetes Gateway API Inference Extension's endpoint picker read an `sgl` server unchanged.

Request counts and latencies are observed by the access-log middleware and the engine
client as requests happen; engine state (running/waiting requests, KV usage, cache hit
rate) is read from `engine.get_server_info()` at scrape time, so `/metrics` always shows
the current pool. A private `CollectorRegistry` keeps two apps in one process (tests)
from colliding.

SGLang's names carry SGLang's one label, `model_name` (the served name; the dashboard
filters on it), and SGLang's default histogram buckets, so quantiles line up with an
SGLang fleet. Their meanings follow SGLang: `sglang:token_usage` and
`sglang:num_used_tokens` count KV slots held by requests (the evictable prefix cache is
free space), `sglang:num_queue_reqs` the requests not yet admitted. `sglang:gen_throughput`
and `sglang:cache_hit_rate` are rates over the recent past, computed here in the API
process (`RecentRates`) from the engine's counters at each reading (a scrape or a
/get_load): over the last WINDOW_S seconds, or since the previous reading if readings are
further apart. The hierarchical cache's series (`sgl_hicache_*` and SGLang's HiCache
names) come from `hicache_metrics.py`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from sgl.server.hicache_metrics import HiCacheCollector
from sgl.server.pd_metrics import PDCollector

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# SGLang's default buckets (sglang/srt/metrics/collector.py, TokenizerMetricsCollector).
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_E2E_BUCKETS = SGLANG_TTFT_BUCKETS + (600, 1200, 1800, 2400)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
                      0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)

# Engine server-info keys exported as gauges: key -> (metric name, help).
_ENGINE_GAUGES = {
    "num_running_reqs": ("sgl_num_running_reqs", "Requests in the running (decode) batch"),
    "num_waiting_reqs": ("sgl_num_waiting_reqs", "Requests waiting for admission"),
    "kv_used_tokens": ("sgl_kv_used_tokens", "KV pool slots in use (including evictable cache)"),
    "kv_free_tokens": ("sgl_kv_free_tokens", "KV pool slots free"),
    "kv_total_tokens": ("sgl_kv_total_tokens", "KV pool capacity in tokens"),
    "cache_hit_rate": ("sgl_cache_hit_rate", "Fraction of prompt tokens served from the radix cache"),
    # Speculative decoding (present when it is on): cumulative since start.
    "spec_accept_rate": ("sgl_spec_accept_rate", "Fraction of speculative draft tokens the model accepted"),
    "spec_accept_length": ("sgl_spec_accept_length", "Tokens a request's decode step yields on average "
                                                     "(1 + accepted drafts per step)"),
    "spec_draft_tokens_total": ("sgl_spec_draft_tokens", "Speculative draft tokens proposed since start"),
    "spec_accepted_tokens_total": ("sgl_spec_accepted_tokens", "Speculative draft tokens accepted since start"),
}

WINDOW_S = 10.0


def _num(info: dict[str, Any], key: str) -> float | None:
    v = info.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class RecentRates:
    """Generated tokens/s and prefix-cache hit rate over the recent past, from samples of
    the engine's monotone counters (generated_tokens_total, prompt_tokens_total,
    cached_tokens_total). The baseline is the newest sample at least `window_s` old (or
    the oldest one), so a rate always spans at least two readings."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, float, float, float]] = deque()

    def add(self, info: dict[str, Any], now: float | None = None) -> None:
        gen, prompt, cached = (_num(info, k) for k in ("generated_tokens_total", "prompt_tokens_total",
                                                        "cached_tokens_total"))
        if gen is None or prompt is None or cached is None:
            return
        t = time.monotonic() if now is None else now
        self.samples.append((t, gen, prompt, cached))
        while len(self.samples) > 2 and self.samples[1][0] <= t - self.window_s:
            self.samples.popleft()

    def gen_throughput(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, g0, _, _), (t1, g1, _, _) = self.samples[0], self.samples[-1]
        return max(g1 - g0, 0.0) / (t1 - t0) if t1 > t0 else 0.0

    def cache_hit_rate(self) -> float | None:
        """Cached / prompt tokens of the requests finished in the window (None: none did)."""
        if len(self.samples) < 2:
            return None
        (_, _, p0, c0), (_, _, p1, c1) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (p1 - p0) if p1 > p0 else None


def observe_many(hist: Any, value: float, n: int) -> None:
    """Observe `value` n times. One request's n inter-token gaps are observed at its mean
    gap; a loop would cost O(tokens) per request on the event loop, so add n to the bucket
    and n*value to the sum at once where prometheus_client exposes them (0.2x releases)."""
    buckets, bounds, total = (getattr(hist, a, None) for a in ("_buckets", "_upper_bounds", "_sum"))
    if buckets is None or bounds is None or total is None:
        for _ in range(n):
            hist.observe(value)
        return
    total.inc(value * n)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(n)
            break


class SGLangMetrics:
    """The `sglang:*` series (see the module docstring), labelled with the served name."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r, lbl = registry, ["model_name"]

        def gauge(name: str, help_: str) -> Any:
            return Gauge(name, help_, lbl, registry=r).labels(model_name=model_name)

        def counter(name: str, help_: str) -> Any:  # the client adds the _total suffix
            return Counter(name, help_, lbl, registry=r).labels(model_name=model_name)

        def histogram(name: str, help_: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, help_, lbl, buckets=buckets, registry=r).labels(model_name=model_name)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of KV slots held by requests.")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens", "The KV pool capacity in tokens.")
        self.token_usage = gauge("sglang:token_usage", "The token usage: used tokens / KV pool capacity.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate (recent requests).")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s), recent.")
        self.spec_accept_length = gauge("sglang:spec_accept_length",
                                        "The average acceptance length of speculative decoding.")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.num_requests = counter("sglang:num_requests", "Number of requests processed.")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              SGLANG_TTFT_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             SGLANG_ITL_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                             SGLANG_E2E_BUCKETS)

    def refresh(self, info: dict[str, Any], rates: RecentRates) -> None:
        running, waiting = _num(info, "num_running_reqs"), _num(info, "num_waiting_reqs")
        used, evictable, total = (_num(info, k) for k in ("kv_used_tokens", "kv_evictable_tokens", "kv_total_tokens"))
        if running is not None:
            self.num_running_reqs.set(running)
        if waiting is not None:
            self.num_queue_reqs.set(waiting)
        if used is not None and total:
            held = max(used - (evictable or 0.0), 0.0)
            self.num_used_tokens.set(held)
            self.max_total_num_tokens.set(total)
            self.token_usage.set(held / total)
        recent = rates.cache_hit_rate()
        overall = _num(info, "cache_hit_rate")
        if recent is not None or overall is not None:
            self.cache_hit_rate.set(recent if recent is not None else overall)
        self.gen_throughput.set(rates.gen_throughput())
        accept_length = _num(info, "spec_accept_length")
        if accept_length is not None:
            self.spec_accept_length.set(accept_length)


class Metrics:
    """All metrics of one app; methods are cheap and safe to call from handlers."""

    def __init__(self, model_name: str = "default") -> None:
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
        self.sglang = SGLangMetrics(r, model_name)
        self.hicache = HiCacheCollector(model_name)  # KV tier series (hicache_metrics.py), only when on
        r.register(self.hicache)
        self.pd = PDCollector()  # PD transfer series (pd_metrics.py), only on prefill/decode workers
        r.register(self.pd)
        self.rates = RecentRates()

    def observe_http(self, path: str, status: int) -> None:
        self.requests.labels(path=path, status=str(status)).inc()

    def observe_generation(self, meta: dict[str, Any], latency_s: float, ttft_s: float | None) -> None:
        """Account one finished generation (one choice) from its meta_info."""
        prompt = int(meta.get("prompt_tokens") or 0)
        completion = int(meta.get("completion_tokens") or 0)
        cached = int(meta.get("cached_tokens") or 0)
        sg = self.sglang
        for ours, theirs, n in ((self.prompt_tokens, sg.prompt_tokens, prompt),
                                (self.generation_tokens, sg.generation_tokens, completion),
                                (self.cached_tokens, sg.cached_tokens, cached)):
            ours.inc(n)
            theirs.inc(n)
        sg.num_requests.inc()
        fr = meta.get("finish_reason")
        self.finished.labels(finish_reason=(fr or {}).get("type", "none") if isinstance(fr, dict) else str(fr)).inc()
        self.e2e.observe(latency_s)
        sg.e2e.observe(latency_s)
        if ttft_s is None and isinstance(meta.get("ttft"), (int, float)):
            ttft_s = float(meta["ttft"])  # the engine measures it for non-streamed requests
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            sg.ttft.observe(ttft_s)
            if completion > 1:
                gap = max(latency_s - ttft_s, 0.0) / (completion - 1)
                self.tpot.observe(gap)
                observe_many(sg.itl, gap, completion - 1)

    def note_engine_state(self, server_info: dict[str, Any]) -> None:
        """A reading of the engine's counters for the recent rates (scrapes and /get_load)."""
        self.rates.add(server_info)

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
        self.hicache.update(info)
        self.pd.update(info)
        if server_info:
            self.note_engine_state(server_info)
            self.sglang.refresh(server_info, self.rates)
        return generate_latest(self.registry)
