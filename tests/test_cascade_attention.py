"""Cascade attention (shared prefix attended once) equals the plain per-request path."""

from __future__ import annotations

import pytest
import torch

from sgl.runtime.attention.cascade import common_prefix_len
from sgl.runtime.attention.torch_backend import TorchAttentionBackend

from tests.attention_helpers import pool_and_batch


def _run(shared: int, own_cached: list[int], extend: list[int], dtype: torch.dtype, cascade: bool,
         kv_heads: int = 3, group: int = 3, d: int = 64, seed: int = 0) -> torch.Tensor:
    pool, fb, q, k, v = pool_and_batch(shared, own_cached, extend, kv_heads, group, d, dtype, seed)
    backend = TorchAttentionBackend(pool)
    import sgl.runtime.attention.cascade as tb

    old = tb.MIN_SHARED
    tb.MIN_SHARED = 1 if cascade else 10**9
    try:
        backend.init_forward(fb)
        assert (backend._shared is not None) == (cascade and len(extend) > 1)
        return backend.forward(q, k, v, 0, fb).float()
    finally:
        tb.MIN_SHARED = old


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("own_cached, extend", [
    ([0, 3, 7, 1], [1, 1, 1, 1]),  # decode batch
    ([0, 5, 2], [4, 1, 9]),  # extend batch incl. a decode row
    ([0, 0], [3, 6]),  # extend right after the shared prefix
    ([0, 2, 0, 1, 0, 3], [1, 1, 1, 1, 1, 60]),  # uneven extends: per-request loop, not padding
])
def test_cascade_matches_plain(dtype: torch.dtype, tol: float, own_cached: list[int], extend: list[int]) -> None:
    a = _run(70, own_cached, extend, dtype, cascade=True)
    b = _run(70, own_cached, extend, dtype, cascade=False)
    assert torch.allclose(a, b, atol=tol, rtol=tol), (a - b).abs().max()


def test_common_prefix_len() -> None:
    rows = torch.tensor([[1, 2, 3, 4], [1, 2, 9, 4], [1, 2, 3, 5]])
    assert common_prefix_len(rows, 4) == 2
    assert common_prefix_len(rows, 1) == 1
    assert common_prefix_len(rows[:1], 4) == 0
    assert common_prefix_len(torch.tensor([[1, 2], [1, 2]]), 2) == 2
