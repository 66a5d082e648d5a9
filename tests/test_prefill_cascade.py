"""Cascade attention's grouping (pieces, padding, budgets) gives the plain path's answer.

The cascade path packs queries into padded groups and slices long extends into pieces; a
wrong index there shows up as a row of the output taken from the wrong query or key set,
so every case compares the whole output against the plain per-request path.
"""

from __future__ import annotations

import random

import pytest
import torch

from sgl.runtime.attention import cascade
from sgl.runtime.attention.torch_backend import TorchAttentionBackend
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.memory.kv_pool import KVPool


def _case(shared: int, own_cached: list[int], extend: list[int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv_heads, group, d = 2, 3, 32
    pool = KVPool(8192, 1, kv_heads, d, dtype)
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=g).to(dtype))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=g).to(dtype))
    table = torch.zeros((len(extend) + 3, 2048), dtype=torch.int64)
    free = list(range(1, 8192))
    random.Random(seed).shuffle(free)
    shared_slots = [free.pop() for _ in range(shared)]
    rows = random.Random(seed + 1).sample(range(len(extend) + 3), len(extend))  # table rows out of order
    prefix_lens, out_loc = [], []
    for r, c, e in zip(rows, own_cached, extend):
        own = [free.pop() for _ in range(c + e)]
        table[r, : shared + c + e] = torch.tensor(shared_slots + own)
        prefix_lens.append(shared + c)
        out_loc.extend(own[c:])
    t = sum(extend)
    fb = ForwardBatch.build([7] * t, out_loc, rows, prefix_lens, extend, table)
    q = torch.randn((t, kv_heads * group, d), generator=g).to(dtype)
    k = torch.randn((t, kv_heads, d), generator=g).to(dtype)
    v = torch.randn((t, kv_heads, d), generator=g).to(dtype)
    return pool, fb, q, k, v


def _attend(pool: KVPool, fb: ForwardBatch, q, k, v, use_cascade: bool, monkeypatch) -> tuple[torch.Tensor, object]:
    monkeypatch.setattr(cascade, "MIN_SHARED", 1 if use_cascade else 10**9)
    backend = TorchAttentionBackend(pool)
    backend.init_forward(fb)
    assert (backend._cascade is not None) == use_cascade
    return backend.forward(q, k, v, 0, fb).float(), backend._cascade


CASES = [
    ([0, 3, 7, 1, 0, 2], [1, 1, 1, 1, 1, 1]),  # decode batch
    ([0, 5, 2, 0], [4, 1, 9, 2]),  # mixed extends incl. a decode row
    ([0, 2, 0, 1, 0, 3], [1, 1, 1, 1, 1, 60]),  # one long extend among decodes
    ([4, 0, 11], [37, 50, 23]),  # long extends: sliced into pieces under a small budget
]


@pytest.mark.parametrize("cells", [1 << 18, 700, 90])  # default, a few groups, slices + many groups
@pytest.mark.parametrize("own_cached, extend", CASES)
def test_grouped_cascade_matches_plain(own_cached, extend, cells, monkeypatch) -> None:
    monkeypatch.setattr(cascade, "MAX_GROUP_CELLS", cells)
    pool, fb, q, k, v = _case(40, own_cached, extend, torch.float32)
    plain, _ = _attend(pool, fb, q, k, v, False, monkeypatch)
    out, plan = _attend(pool, fb, q, k, v, True, monkeypatch)
    assert torch.allclose(out, plain, atol=2e-5, rtol=2e-5), (out - plain).abs().max()
    # Every token of the step is produced by exactly one group.
    covered = torch.cat([grp.t_index for grp in plan.groups]).sort().values
    assert torch.equal(covered, torch.arange(fb.num_tokens))
    if cells == 90:
        assert len(plan.groups) > 1


def test_long_extend_is_sliced_under_budget(monkeypatch) -> None:
    monkeypatch.setattr(cascade, "MAX_GROUP_CELLS", 1000)
    pool, fb, q, k, v = _case(64, [0, 5], [120, 3], torch.float32)
    out, plan = _attend(pool, fb, q, k, v, True, monkeypatch)
    plain, _ = _attend(pool, fb, q, k, v, False, monkeypatch)
    assert torch.allclose(out, plain, atol=2e-5, rtol=2e-5)
    assert max(grp.e for grp in plan.groups) < 120  # the 120-token extend was sliced
    for grp in plan.groups:  # the padded score block of each group stays within the budget
        assert grp.n * grp.e * (64 + grp.l) <= 1000


def test_bf16_decode_batch_close_to_plain(monkeypatch) -> None:
    pool, fb, q, k, v = _case(300, [0, 1, 5, 2, 9, 4, 3, 0], [1] * 8, torch.bfloat16, seed=3)
    plain, _ = _attend(pool, fb, q, k, v, False, monkeypatch)
    out, plan = _attend(pool, fb, q, k, v, True, monkeypatch)
    assert len(plan.groups) == 1 and plan.groups[0].identity
    assert torch.allclose(out, plain, atol=3e-2, rtol=3e-2), (out - plain).abs().max()
