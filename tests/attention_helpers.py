"""A KV pool with random K/V and a ragged batch over it, for the attention backend tests."""

from __future__ import annotations

import random

import torch

from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.memory.kv_pool import KVPool


def pool_and_batch(shared: int, cached: list[int], extend: list[int], kv: int, group: int, d: int,
                   dtype: torch.dtype = torch.bfloat16, seed: int = 0, q_scale: float = 1.0):
    """(pool, batch, q, k, v): every request starts with the same `shared` slots, then
    cached[i] own cached slots, then extend[i] new tokens (slots drawn at random, table rows
    from 1 so row 0 is not special)."""
    g = torch.Generator().manual_seed(seed)
    n_slots = 4096
    pool = KVPool(n_slots, 1, kv, d, dtype)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=g).to(dtype))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=g).to(dtype))
    table = torch.zeros((len(extend) + 2, 1024), dtype=torch.int64)
    free = list(range(1, n_slots))
    random.Random(seed).shuffle(free)
    shared_slots = [free.pop() for _ in range(shared)]
    rows, prefix, out_loc = [], [], []
    for i, (c, e) in enumerate(zip(cached, extend)):
        own = [free.pop() for _ in range(c + e)]
        table[i + 1, : shared + c + e] = torch.tensor(shared_slots + own)
        rows.append(i + 1)
        prefix.append(shared + c)
        out_loc.extend(own[c:])
    t = sum(extend)
    fb = ForwardBatch.build([5] * t, out_loc, rows, prefix, extend, table)
    q = (q_scale * torch.randn((t, kv * group, d), generator=g)).to(dtype)
    k = torch.randn((t, kv, d), generator=g).to(dtype)
    v = torch.randn((t, kv, d), generator=g).to(dtype)
    return pool, fb, q, k, v
