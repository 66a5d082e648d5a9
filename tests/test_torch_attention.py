"""Torch attention backend against a naive per-token reference on random data."""

from __future__ import annotations

import math

import pytest
import torch

from sgl.runtime.attention.torch_backend import TorchAttentionBackend
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.memory.kv_pool import KVPool

H, KV, D, LAYERS = 6, 2, 16, 2


def naive_attention(q, k_all, v_all, prefix_len):
    """q [e, H, D]; k_all/v_all [S, KV, D] for the whole sequence; float64 loops."""
    e = q.shape[0]
    group = H // KV
    out = torch.zeros(e, H, D, dtype=torch.float64)
    for j in range(e):
        visible = prefix_len + j + 1
        for h in range(H):
            kk = k_all[:visible, h // group].double()
            vv = v_all[:visible, h // group].double()
            s = (kk @ q[j, h].double()) / math.sqrt(D)
            out[j, h] = torch.softmax(s, 0) @ vv
    return out


def run_case(prefix_lens, extend_lens, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(256, LAYERS, KV, D, dtype)
    for buf in pool.k_buffers + pool.v_buffers:  # garbage everywhere, incl. unused slots
        buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
    b = len(prefix_lens)
    r2t = torch.zeros(8, 64, dtype=torch.int32)
    # Scattered, non-contiguous slots per request; rows in a shuffled order of the table.
    perm = torch.randperm(255, generator=g) + 1
    rows = [5, 2, 7, 0, 3][:b]
    used = 0
    out_loc: list[int] = []
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        slots = perm[used : used + p + e]
        used += p + e
        r2t[rows[i], : p + e] = slots.to(torch.int32)
        out_loc += slots[p:].tolist()
    t = sum(extend_lens)
    q = torch.randn(t, H, D, generator=g).to(dtype)
    k = torch.randn(t, KV, D, generator=g).to(dtype)
    v = torch.randn(t, KV, D, generator=g).to(dtype)
    batch = ForwardBatch.build([0] * t, out_loc, rows, list(prefix_lens), list(extend_lens), r2t)
    backend = TorchAttentionBackend(pool)
    backend.init_forward(batch)
    layer = 1
    out = backend.forward(q, k, v, layer, batch)
    assert out.shape == (t, H, D) and out.dtype == dtype
    # New k/v landed in the pool at out_cache_loc.
    assert torch.equal(pool.k_buffers[layer][batch.out_cache_loc], k)
    assert torch.equal(pool.v_buffers[layer][batch.out_cache_loc], v)
    start = 0
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        slots = r2t[rows[i], : p + e].long()
        ref = naive_attention(q[start : start + e], pool.k_buffers[layer][slots], pool.v_buffers[layer][slots], p)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[start : start + e].double(), ref, atol=tol, rtol=tol)
        start += e
    return batch


@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [
        ([0], [7]),  # plain prefill
        ([4], [6]),  # extend onto a cached prefix
        ([0, 5, 12], [3, 1, 4]),  # mixed: prefill, decode-like, extend
        ([0, 0], [1, 1]),  # one-token prompts (prefix 0, extend 1)
    ],
)
def test_extend_paths_match_reference(prefix_lens, extend_lens):
    batch = run_case(prefix_lens, extend_lens)
    assert not batch.is_decode


@pytest.mark.parametrize("seq", [[3, 17, 2, 30], [10]])
def test_decode_batch_matches_reference(seq):
    batch = run_case([s - 1 for s in seq], [1] * len(seq), seed=3)
    assert batch.is_decode


def test_bf16_decode_and_extend():
    run_case([6, 10, 2], [1, 1, 1], dtype=torch.bfloat16, seed=1)
    run_case([3, 0], [5, 4], dtype=torch.bfloat16, seed=2)
