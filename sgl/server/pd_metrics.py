"""PD disaggregation's /metrics series, read at scrape time from the engine's server info
(the worker's `pd_*` counters, sgl/runtime/disaggregation/stats.py), on prefill and
decode workers only:

- `sgl_pd_transfer_bytes_total`, `sgl_pd_transfer_tokens_total`: KV moved (sent on a
  prefill worker, received on a decode worker);
- `sgl_pd_transfer_seconds`: a histogram of transfer times (decode: Pull sent -> KV in
  the pool; prefill: prefill done -> send handed over);
- `sgl_pd_transfer_failures_total{reason}`: rooms that failed, by reason (timeout,
  prefill_failed, unreachable, decode_restarted, cancelled, mismatch, aborted, ...);
- `sgl_pd_rooms_held`: rooms held now (prefill: KV kept for a room; decode: requests
  waiting for their KV).

A custom collector, as for the hierarchical cache: the worker keeps the running totals
(and the histogram's cumulative buckets), this reports them as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric


class PDCollector:
    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    def update(self, info: dict[str, Any]) -> None:
        self.info = info

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        info = self.info
        if info.get("disaggregation_mode") in (None, "null"):
            return
        yield CounterMetricFamily("sgl_pd_transfer_bytes", "KV bytes moved between prefill and decode workers",
                                  value=float(info.get("pd_transfer_bytes_total", 0)))
        yield CounterMetricFamily("sgl_pd_transfer_tokens", "Tokens whose KV moved between prefill and decode workers",
                                  value=float(info.get("pd_transfer_tokens_total", 0)))
        buckets = [(str(le), float(c)) for le, c in info.get("pd_transfer_seconds_buckets", [])]
        if buckets:
            yield HistogramMetricFamily("sgl_pd_transfer_seconds", "KV transfer time per room",
                                        buckets=buckets, sum_value=float(info.get("pd_transfer_seconds_sum", 0.0)))
        fam = CounterMetricFamily("sgl_pd_transfer_failures", "Rooms whose KV transfer failed, by reason",
                                  labels=["reason"])
        for reason, n in sorted((info.get("pd_transfer_failures_total") or {}).items()):
            fam.add_metric([reason], float(n))
        yield fam
        yield GaugeMetricFamily("sgl_pd_rooms_held", "Rooms held now (prefill: KV kept; decode: waiting for KV)",
                                value=float(info.get("pd_rooms_held", 0)))
