"""Measure what a draft row costs on this host, on the model's own decode path.

The answer differs by two orders of magnitude between kernels and CPUs (a step that
streams the weights once for all rows vs one that computes each row on its own), so it is
timed, not assumed: a one-row decode step against a step of `rows` tokens of one request,
both on a short context written into table row `row` before any request exists (the
slots hold garbage KV afterwards, which the first requests overwrite).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from sgl.runtime.executor.forward_batch import ForwardBatch


def measure_row_cost(runner: Any, table: torch.Tensor, rows: int, reps: int = 3, row: int = 0) -> float:
    """(t(rows) - t(1)) / ((rows - 1) * t(1)): one extra row's share of a one-row step."""
    if rows < 2:
        raise ValueError("measuring a row's cost needs at least 2 rows")
    n = rows + 1
    slots = list(range(1, n + 1))  # slot 0 is reserved
    saved = table[row, :n].clone()
    table[row, :n] = torch.tensor(slots, dtype=table.dtype)
    one = ForwardBatch.build([1], [slots[-1]], [row], [n - 1], [1], table, device=table.device)
    many = ForwardBatch.build([1] * rows, slots[1:], [row], [1], [rows], table, device=table.device)

    def best(batch: ForwardBatch) -> float:
        runner.forward(batch)  # warm: kernels built, buffers sized
        t = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.forward(batch)
            if table.device.type == "cuda":
                torch.cuda.synchronize()
            t = min(t, time.perf_counter() - t0)
        return t

    try:
        t1, tn = best(one), best(many)
    finally:
        table[row, :n] = saved
    return max(tn - t1, 0.0) / ((rows - 1) * t1)
