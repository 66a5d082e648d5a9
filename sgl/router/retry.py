"""When and how long to wait before retrying a proxied request.

A request is retried only while nothing of its answer has reached the client: on a
connection error, a read error or timeout before the response head, or a retryable status
(408, 429, 500, 502, 503, 504) — a 4xx that the client caused is never retried. The
delay grows exponentially, is capped, and is spread by jitter so that many requests
failing together do not return together.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryOptions:
    max_attempts: int = 5  # the first attempt included
    initial_backoff_ms: int = 50
    max_backoff_ms: int = 30000
    multiplier: float = 1.5
    jitter: float = 0.2

    def delay_secs(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `retry` (1 = the first retry)."""
        base = min(self.initial_backoff_ms * self.multiplier ** (retry - 1), self.max_backoff_ms)
        spread = (rng or random).uniform(-self.jitter, self.jitter) if self.jitter else 0.0
        return max(0.0, base * (1.0 + spread)) / 1000.0


def retryable_status(status: int) -> bool:
    return status in RETRYABLE_STATUS
