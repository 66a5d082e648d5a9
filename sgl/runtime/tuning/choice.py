"""The plain result of path calibration: what runs where, and where each answer came from.

`PathChoice` is built once per worker (tuning/calibrate.py) and read by the worker build
(worker/build.py) and `/get_server_info`. Each item's source says why it holds: `flag`
(an explicit option), `measured` (timed at this start), `cache` (timed at an earlier
start on the same host, build and model), `busy` (timed at this start while other
processes used the CPUs: used, not cached), `only` (a single candidate applies here) or
`default` (not measured: not a bf16 CPU model, or tensor parallel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ITEMS = ("attention_backend", "linear", "decode_threads", "decode_max_rows")
SOURCES = ("flag", "measured", "busy", "cache", "only", "default")


@dataclass(frozen=True)
class PathChoice:
    attention_backend: str  # the attention backend's name for prefill/extend: "cpu" | "torch" | "triton"
    linear: str  # bf16 CPU matmuls outside the C decode step: "bf16" | "fp32" | "gguf"
    decode_threads: int  # threads of the C decode step: 1 | 2
    decode_max_rows: int  # most rows of a step that runs on the C decode step
    sources: dict[str, str] = field(default_factory=dict)  # item -> one of SOURCES
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # item -> candidate -> median ms

    @property
    def decode_split(self) -> bool:
        """Whether a decode batch of more than decode_max_rows runs as several C steps:
        only where the C step was timed against the torch forward and won at every count
        (elsewhere, e.g. a host whose bf16 GEMMs have hardware, big batches stay on torch)."""
        t = self.timings_ms.get("decode_max_rows") or {}
        counts = [k[2:] for k in t if k.startswith("c@")]
        return bool(counts) and all(f"torch@{n}" in t and t[f"torch@{n}"] > t[f"c@{n}"] for n in counts)

    def info(self) -> dict[str, Any]:
        """The choice as plain JSON-able data (server info, logs)."""
        return {"attention_backend": self.attention_backend, "linear": self.linear,
                "decode_threads": self.decode_threads, "decode_max_rows": self.decode_max_rows,
                "decode_split": self.decode_split,
                "sources": dict(self.sources), "timings_ms": {k: dict(v) for k, v in self.timings_ms.items()}}

    def describe(self) -> str:
        return ", ".join(f"{item}={getattr(self, item)} ({self.sources.get(item, '?')})" for item in ITEMS)
