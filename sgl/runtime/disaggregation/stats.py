"""PD transfer counters of one worker, as plain data for the scheduler snapshot (and so
/get_server_info and /metrics): bytes and tokens moved, a histogram of transfer times,
failures by reason, and the rooms held now.

On the decode side a transfer's time runs from sending the Pull to the KV being in the
pool (what the request waited for, including the prefill's compute when the Pull came
first); on the prefill side, from the prefill being done to the send being handed over.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from typing import Any

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class PDStats:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.bytes_total = 0
        self.tokens_total = 0
        self.transfers_total = 0
        self.seconds_sum = 0.0
        self.bucket_counts = [0] * (len(SECONDS_BUCKETS) + 1)  # the last one: +Inf
        self.failures: Counter[str] = Counter()

    def transfer(self, nbytes: int, ntokens: int, seconds: float) -> None:
        self.bytes_total += nbytes
        self.tokens_total += ntokens
        self.transfers_total += 1
        self.seconds_sum += seconds
        self.bucket_counts[bisect_left(SECONDS_BUCKETS, seconds)] += 1

    def failure(self, reason: str) -> None:
        self.failures[reason] += 1

    def snapshot(self, rooms_held: int) -> dict[str, Any]:
        cumulative, total = [], 0
        for le, c in zip(list(SECONDS_BUCKETS) + [float("inf")], self.bucket_counts):
            total += c
            cumulative.append([le if le != float("inf") else "+Inf", total])
        return {
            "disaggregation_mode": self.mode,
            "pd_rooms_held": rooms_held,
            "pd_transfers_total": self.transfers_total,
            "pd_transfer_bytes_total": self.bytes_total,
            "pd_transfer_tokens_total": self.tokens_total,
            "pd_transfer_seconds_sum": self.seconds_sum,
            "pd_transfer_seconds_buckets": cumulative,
            "pd_transfer_failures_total": dict(self.failures),
        }
