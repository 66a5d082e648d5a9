"""Timers of the candidate paths on the model's real shapes (medians of a few repeats
after a warm-up), each returning {candidate: milliseconds}.

They run in the worker before it serves, on a KV pool and request table of their own
(`Bench`, a few hundred tokens of context): the engine's pool is untouched and no
request exists yet. The slots hold garbage KV; timing does not depend on the values.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.kernels.cpu.linear import tile_mm
from sgl.runtime.memory.kv_pool import KVPool

PREFILL_ROWS = 256  # a prefill chunk's rows for the linear and attention timings
CONTEXT = 256  # tokens of context under the timed attention and decode steps


def median_ms(fn: Callable[[], Any], reps: int = 3, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(times)


class Bench:
    """A pool and request table for timing: `rows` table rows, each reading the same
    `context` slots and writing its own new slots after them."""

    def __init__(self, model: Any, context: int, rows: int, new_per_row: int = 1) -> None:
        c = model.config
        self.context, self.new = context, new_per_row
        n_slots = 1 + context + rows * new_per_row  # slot 0 is reserved
        heads = getattr(model, "num_local_kv_heads", c.num_kv_heads)
        self.pool = KVPool(n_slots, c.num_layers, heads, c.head_dim, model.dtype, "cpu")
        for buf in (*self.pool.k_buffers, *self.pool.v_buffers):
            buf.normal_(0, 1)
        width = context + new_per_row
        self.table = torch.zeros(rows, width, dtype=torch.int64)
        self.table[:, :context] = torch.arange(1, context + 1)
        for r in range(rows):
            lo = 1 + context + r * new_per_row
            self.table[r, context:] = torch.arange(lo, lo + new_per_row)
        self.vocab = c.vocab_size

    def decode(self, rows: int) -> ForwardBatch:
        """One decode step of `rows` requests, each on the shared context."""
        ids = [(7 * r + 11) % self.vocab for r in range(rows)]
        loc = [int(self.table[r, self.context]) for r in range(rows)]
        return ForwardBatch.build(ids, loc, list(range(rows)), [self.context] * rows, [1] * rows, self.table)

    def extend(self) -> ForwardBatch:
        """One request's `new_per_row` tokens after the context (a prefill chunk over a cached prefix)."""
        ids = [(3 * i + 5) % self.vocab for i in range(self.new)]
        loc = self.table[0, self.context:].tolist()
        return ForwardBatch.build(ids, loc, [0], [self.context], [self.new], self.table)


def linear_paths(layer: Any, rows: int = PREFILL_ROWS, reps: int = 5, tiles: list | None = None) -> dict[str, float]:
    """One layer's four projections on `rows` bf16 rows: bf16 GEMMs vs fp32 GEMMs on fp32
    copies, and with `tiles` (the four in qgemm.c's tile form) int8 products over GGUF blocks."""
    ws = [layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, w.shape[1], generator=g).to(torch.bfloat16) for w in ws]
    w32 = [w.detach().float() for w in ws]

    def bf16() -> None:
        for x, w in zip(xs, ws):
            F.linear(x, w)

    def fp32() -> None:
        for x, w in zip(xs, w32):
            F.linear(x.float(), w).to(torch.bfloat16)

    def gguf() -> None:
        for x, tw in zip(xs, tiles or []):
            tile_mm(x, tw)

    # Three warm-up runs each: torch's OpenMP threads spin for a while after its GEMMs and
    # would share the cores with the first tiled products (measured: 4.5-8.5 ms right
    # after a bf16 product vs 3.5-4.1 back to back, as a prefill runs them).
    with torch.inference_mode():
        out = {"bf16": median_ms(bf16, reps, 3), "fp32": median_ms(fp32, reps, 3)}
        if tiles is not None:
            out["gguf"] = median_ms(gguf, reps, 3)
        return out


def attention_backends(model: Any, names: list[str], reps: int = 3) -> dict[str, float]:
    """Each backend's attention over all layers for a PREFILL_ROWS-token chunk after CONTEXT
    cached tokens (the backends' own init + per-layer calls, no matmuls)."""
    from sgl.runtime.attention.registry import create_attention_backend

    c = model.config
    h, kv = getattr(model, "num_local_heads", c.num_heads), getattr(model, "num_local_kv_heads", c.num_kv_heads)
    bench = Bench(model, CONTEXT, 1, PREFILL_ROWS)
    batch = bench.extend()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(PREFILL_ROWS, h, c.head_dim, generator=g).to(model.dtype)
    k = torch.randn(PREFILL_ROWS, kv, c.head_dim, generator=g).to(model.dtype)
    v = torch.randn(PREFILL_ROWS, kv, c.head_dim, generator=g).to(model.dtype)
    out: dict[str, float] = {}
    for name in names:
        attn = create_attention_backend(name, bench.pool, "cpu")

        def run() -> None:
            attn.init_forward(batch)
            for layer in range(c.num_layers):
                attn.forward(q, k, v, layer, batch)

        with torch.inference_mode():
            out[name] = median_ms(run, reps)
    return out


def decode_threads(model: Any, kernels: Any, reps: int = 3) -> dict[str, float]:
    """The C decode step at 1 and 8 rows (summed) on 1 and on 2 threads."""
    from sgl.runtime.kernels.cpu.decode import MAX_ROWS, CpuDecoder

    bench = Bench(model, CONTEXT, MAX_ROWS)
    batches = [bench.decode(1), bench.decode(MAX_ROWS)]
    out: dict[str, float] = {}
    for threads in (1, 2):
        dec = CpuDecoder(model, kernels, threads, MAX_ROWS)
        total = 0.0
        for batch in batches:
            total += median_ms(lambda: dec.forward(batch, bench.pool), reps)
        out[str(threads)] = total
    return out


def decode_rows(model: Any, kernels: Any, threads: int, attention_backend: str, candidates: list[int],
                reps: int = 2) -> dict[str, float]:
    """The C decode step vs the model's torch forward at each candidate row count, in
    increasing order, stopping after the first count where torch wins. Keys: "c@N", "torch@N"."""
    from sgl.runtime.attention.registry import create_attention_backend
    from sgl.runtime.kernels.cpu.decode import CpuDecoder

    bench = Bench(model, CONTEXT, max(candidates))
    dec = CpuDecoder(model, kernels, threads, max(candidates))
    attn = create_attention_backend(attention_backend, bench.pool, "cpu")
    out: dict[str, float] = {}
    with torch.inference_mode():
        for rows in sorted(candidates):
            batch = bench.decode(rows)
            out[f"c@{rows}"] = median_ms(lambda: dec.forward(batch, bench.pool), reps)
            out[f"torch@{rows}"] = median_ms(lambda: model.forward(batch, attn), reps)
            if out[f"torch@{rows}"] < out[f"c@{rows}"]:
                break
    return out
