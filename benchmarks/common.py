"""Benchmark helpers: timing, tables, JSON output, machine bounds (bandwidth, bf16/fp32 FLOP/s)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

# Same OpenMP setting as the engine (sgl/runtime/__init__.py), applied before torch loads so
# every system measured in this process (ours, transformers) runs under it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _lscpu(field: str) -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    for line in out.splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_model() -> str:
    """lscpu's model name: hosts of one machine kind differ (Zen 3, Zen 4, AMX Xeons)."""
    return _lscpu("Model name")


def cpu_flags() -> str:
    """lscpu's flags line: which vector units ran (avx2, avx512_bf16, amx_tile, ...)."""
    return _lscpu("Flags")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure_bandwidth_gbs(size_mb: int = 512, reps: int = 5) -> float:
    """Memory read+write bandwidth of a large copy (the decode bound's denominator)."""
    a = torch.empty(size_mb * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best / 1e9


def measure_bf16_tflops(n: int = 2048, reps: int = 5) -> float:
    return measure_tflops(torch.bfloat16, n, reps)


def measure_fp32_tflops(n: int = 2048, reps: int = 5) -> float:
    return measure_tflops(torch.float32, n, reps)


def measure_int8_tflops(n: int = 2048, reps: int = 5) -> float:
    """The rate of our tiled int8 product over GGUF blocks (kernels/cpu/qgemm.c, the
    `--cpu-linear gguf` path) on an n x n Q8_0 matrix (best of `reps`), in TFLOP/s of the
    equivalent float product; 0 where the build has no AVX512-VNNI (the path is not offered)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from sgl.runtime.kernels.cpu.binding import kernels
    from sgl.runtime.kernels.cpu.linear import tile_mm, tile_weight

    k = kernels()
    if k is None or k.qgemm_simd() != 1:
        return 0.0
    w = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    blocks = torch.from_numpy(np.ascontiguousarray(quantize(w, GGMLQuantizationType.Q8_0)))
    tw = tile_weight(blocks, int(GGMLQuantizationType.Q8_0), (n, n), None, min(2, torch.get_num_threads()))
    x = torch.randn(n, n, dtype=torch.bfloat16)
    tile_mm(x, tw)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        tile_mm(x, tw)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def measure_tflops(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """Square matmul rate in `dtype` (best of `reps`)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    cols = list(rows[0].keys())
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print(f"\n## {title}\n")
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)) + " |")


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    machine = {"cpu": cpu_model(), "flags": cpu_flags(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "threads": torch.get_num_threads()}
    data = {"machine": machine, **data}
    path.write_text(json.dumps(data, indent=2))
    print(f"\nhost: {machine['cpu']}\nwrote {path}")
    return path
