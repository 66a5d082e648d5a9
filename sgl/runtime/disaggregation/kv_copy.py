"""KV pool <-> one contiguous transfer buffer (protocol.py's payload layout).

The prefill gathers the K/V of a room's slots from every layer into one buffer (one
copy: the slots are scattered over the pool, and an independent buffer lets the prefill
unlock its KV as soon as the buffer exists, before the network is done with it); the
decode scatters a received buffer into the slots it reserved. Both run on the scheduler
thread, between steps, so they are ordered with the forward passes that read and write
the same pool without any other synchronization.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from sgl.runtime.disaggregation.protocol import KVLayout


def layout_of(pool: Any) -> KVLayout:
    return KVLayout(str(pool.dtype).replace("torch.", ""), pool.num_layers, pool.num_kv_heads, pool.head_dim)


def payload_nbytes(layout: KVLayout, num_tokens: int) -> int:
    elem = torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
    return 2 * layout.num_layers * num_tokens * layout.num_kv_heads * layout.head_dim * elem


def gather(pool: Any, slots: list[int]) -> torch.Tensor:
    """[2, layers, len(slots), heads, head_dim] on the CPU, contiguous."""
    out = torch.empty((2, pool.num_layers, len(slots), pool.num_kv_heads, pool.head_dim), dtype=pool.dtype)
    if not slots:
        return out
    idx = torch.tensor(slots, dtype=torch.long, device=pool.k_buffers[0].device)
    for layer in range(pool.num_layers):
        out[0, layer].copy_(pool.k_buffers[layer].index_select(0, idx))
        out[1, layer].copy_(pool.v_buffers[layer].index_select(0, idx))
    return out


def as_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (bf16 has no numpy dtype)."""
    return t.view(torch.uint8).reshape(-1).numpy().data


def scatter(pool: Any, slots: list[int], payload: Any, layout: KVLayout) -> None:
    """Write a received payload (a buffer) into `slots` of every layer."""
    n = len(slots)
    if n == 0:
        return
    with warnings.catch_warnings():  # a read-only network buffer: we only read it
        warnings.simplefilter("ignore")
        raw = torch.frombuffer(payload, dtype=torch.uint8)
    kv = raw.view(getattr(torch, layout.dtype)).view(2, layout.num_layers, n, layout.num_kv_heads, layout.head_dim)
    dev = pool.k_buffers[0].device
    idx = torch.tensor(slots, dtype=torch.long, device=dev)
    for layer in range(pool.num_layers):
        pool.k_buffers[layer].index_copy_(0, idx, kv[0, layer].to(dev))
        pool.v_buffers[layer].index_copy_(0, idx, kv[1, layer].to(dev))
