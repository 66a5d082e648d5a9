"""Batched mask application: one vectorized masked_fill over the constrained rows only.

This is the executor's mask path: its sampler (runtime/executor/sampler.py) fills a
reused bool buffer [B, V] (True = allowed) by asking each constrained row's grammar to
`fill_mask` its row, then calls `apply_masks` once. Rows that are not listed are
untouched, so unconstrained requests pay nothing; if no row is constrained the logits
are returned as they are.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .base import Grammar


def or_into(mask_row: torch.Tensor, allowed: np.ndarray) -> None:
    """mask_row[:n] |= allowed (bool [n]): in place on a CPU row's numpy view (no torch
    dispatch), else through a copy on the row's device."""
    if mask_row.device.type == "cpu":
        row = mask_row.numpy()
        np.logical_or(row[: allowed.size], allowed, out=row[: allowed.size])
    else:
        mask_row[: allowed.size] |= torch.from_numpy(np.ascontiguousarray(allowed)).to(mask_row.device)


def allocate_masks(batch_size: int, width: int) -> torch.Tensor:
    """An all-False bool mask [batch_size, width] on the CPU (filled by grammars)."""
    return torch.zeros((batch_size, width), dtype=torch.bool)


def fill_masks(grammars: Sequence[Grammar | None], masks: torch.Tensor) -> list[int]:
    """Fill row i from grammars[i] (None = unconstrained); returns the filled row indices."""
    rows: list[int] = []
    cpu = masks.device.type == "cpu"
    for i, g in enumerate(grammars):
        if g is not None:
            if cpu:  # a memset: torch's zero_ of a 49k-wide row wakes its thread pool
                masks[i].numpy().fill(False)
            else:
                masks[i].zero_()
            g.fill_mask(masks[i])
            rows.append(i)
    return rows


def apply_masks(logits: torch.Tensor, masks: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Set disallowed logits to -inf in `rows` (in place; also returned).

    `masks` is [B, Vm] aligned with `logits` [B, V]; columns at or past Vm (lm_head
    padding wider than the vocabulary) count as disallowed.
    """
    if not rows:
        return logits
    idx = torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
    m = masks.index_select(0, idx.to(masks.device)).to(logits.device, non_blocking=True)
    width = logits.shape[-1]
    if m.shape[-1] < width:
        m = torch.nn.functional.pad(m, (0, width - m.shape[-1]), value=False)
    elif m.shape[-1] > width:
        m = m[:, :width]
    sub = logits.index_select(0, idx).masked_fill_(~m, float("-inf"))
    logits.index_copy_(0, idx, sub)
    return logits
