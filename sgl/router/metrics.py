"""The router's Prometheus metrics (`sgl_router_*`), one registry per app (no globals).

Counted as requests pass:
    sgl_router_requests_total{route, status}      answers sent (streams: 502 cut by the worker, 499 client left)
    sgl_router_request_duration_seconds{route}    time to the full answer (streams: to the last byte)
    sgl_router_retries_total{route}               attempts beyond the first
    sgl_router_worker_requests_total{worker, outcome}   attempts per worker (ok / error)
    sgl_router_pd_requests_total{prefill, decode, outcome}   PD mode: attempts per pair (ok, error:
                                                  failed and retried or answered as an error,
                                                  client_error: a 4xx passed on, abandoned)
    sgl_router_pd_failures_total{side, reason}    PD mode: failed calls by side (prefill / decode)
                                                  and kind (connection, timeout, status, read,
                                                  error_event, stream)
Read at scrape time from the live objects:
    sgl_router_worker_in_flight{worker}           requests outstanding on each worker
    sgl_router_worker_healthy{worker}             1 in rotation by health checks, else 0
    sgl_router_circuit_state{worker}              0 closed, 1 open, 2 half-open
    sgl_router_healthy_workers / sgl_router_workers
    sgl_router_admission_active / _queued, sgl_router_admission_rejected_total{reason}
    sgl_router_tokenizer_loaded                   1 once the workers' tokenizer is here
    sgl_router_<stat>{policy[, role]}             every number of each policy's `stats()`, e.g.
                                                  cache_hits, cache_misses, tree_size (PD mode adds
                                                  role: the worker set, "prefill" or "decode")
"""

from __future__ import annotations

import contextlib

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _Live:
    """A collector whose values are read from the router's objects at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        in_flight = GaugeMetricFamily("sgl_router_worker_in_flight", "requests outstanding on the worker",
                                      labels=["worker"])
        healthy = GaugeMetricFamily("sgl_router_worker_healthy", "1 when the worker passes health checks",
                                    labels=["worker"])
        circuit = GaugeMetricFamily("sgl_router_circuit_state", "circuit breaker: 0 closed, 1 open, 2 half-open",
                                    labels=["worker"])
        for w in s["workers"]:
            in_flight.add_metric([w["url"]], w["in_flight"])
            healthy.add_metric([w["url"]], 1 if w["healthy"] else 0)
            circuit.add_metric([w["url"]], w["circuit_code"])
        yield from (in_flight, healthy, circuit)
        yield GaugeMetricFamily("sgl_router_workers", "workers known to the router", value=len(s["workers"]))
        yield GaugeMetricFamily("sgl_router_healthy_workers", "workers in rotation by health checks",
                                value=sum(1 for w in s["workers"] if w["healthy"]))
        yield GaugeMetricFamily("sgl_router_admission_active", "generation requests holding a slot",
                                value=s["admission_active"])
        yield GaugeMetricFamily("sgl_router_admission_queued", "generation requests waiting for a slot",
                                value=s["admission_queued"])
        yield GaugeMetricFamily("sgl_router_tokenizer_loaded", "1 once the workers' tokenizer is fetched "
                                "(chat routed on the rendered template, kv_aware on token ids)",
                                value=1 if s.get("tokenizer_loaded") else 0)
        rejected = CounterMetricFamily("sgl_router_admission_rejected", "requests refused by admission control",
                                       labels=["reason"])
        rejected.add_metric(["queue_full"], s["rejected_full"])
        rejected.add_metric(["queue_timeout"], s["rejected_timeout"])
        yield rejected
        families: dict[str, GaugeMetricFamily] = {}
        pd = any(p["role"] != "worker" for p in s["policies"])  # a role label only where there are roles
        for p in s["policies"]:
            for key, value in sorted(p["stats"].items()):
                name = "sgl_router_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                g = families.get(name) or GaugeMetricFamily(name, f"routing policy statistic {key!r}",
                                                            labels=["policy", "role"] if pd else ["policy"])
                families[name] = g
                g.add_metric([p["policy"], p["role"]] if pd else [p["policy"]], float(value))
        yield from families.values()


class RouterMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("sgl_router_requests", "answers sent by the router", ["route", "status"],
                                registry=self.registry)
        self.duration = Histogram("sgl_router_request_duration_seconds", "time to the full answer", ["route"],
                                  buckets=_BUCKETS, registry=self.registry)
        self.retries = Counter("sgl_router_retries", "attempts beyond the first", ["route"], registry=self.registry)
        self.worker_requests = Counter("sgl_router_worker_requests", "attempts per worker", ["worker", "outcome"],
                                       registry=self.registry)
        self.pd_requests = Counter("sgl_router_pd_requests", "PD mode: attempts per (prefill, decode) pair",
                                   ["prefill", "decode", "outcome"], registry=self.registry)
        self.pd_failures = Counter("sgl_router_pd_failures", "PD mode: failed calls by side and kind",
                                   ["side", "reason"], registry=self.registry)
        self.registry.register(_Live(snapshot))  # type: ignore[arg-type]

    def forget_worker(self, url: str) -> None:
        """Drop a removed worker's series: with pods coming and going the set would only grow."""
        for counter, keyed in ((self.worker_requests, 1), (self.pd_requests, 2)):
            for labels in list(counter._metrics):  # noqa: SLF001 - prometheus_client keeps no other index
                if url in labels[:keyed]:
                    with contextlib.suppress(KeyError):
                        counter.remove(*labels)

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.duration.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
