"""Prepacked CPU linears (kernels/cpu/linear.py) are used only where verified on this host.

Packing checks each weight shape against F.linear at CHECK_ROWS row counts and keeps the
packed product only up to the last count that matched bit for bit (an AMX host's packed
product first differs at 33 rows). The policy is tested on every host with a stand-in
packed product that, like that host's, rounds differently from 33 rows on; the real
oneDNN path is tested where this CPU can pack bf16 weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgl.runtime.kernels.cpu import linear as lin

BF = torch.bfloat16


def _amx_like(monkeypatch) -> None:
    """A packed product equal to F.linear up to 32 rows and one bf16 ulp off past them."""
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(lin, "_reorder", lambda w: w.clone())

    def packed_mm(x, packed, bias):
        y = F.linear(x, packed, bias)
        return y if x.shape[0] <= 32 else y + y.abs().clamp_min(1e-3) * 2**-7

    monkeypatch.setattr(lin, "_packed_mm", packed_mm)


def test_packed_path_stops_at_the_last_verified_row_count(monkeypatch):
    _amx_like(monkeypatch)
    w = torch.randn(96, 64).to(BF)
    packed = lin.pack_weight(w)
    assert packed is not None and packed.max_rows == 32
    for rows in (1, 7, 32, 33, 100, 300):
        x = torch.randn(rows, 64).to(BF)
        assert torch.equal(lin.linear(x, w, packed), F.linear(x, w)), rows


def test_verification_runs_once_per_shape_and_bias(monkeypatch):
    _amx_like(monkeypatch)
    calls: list[tuple] = []
    real = lin._verified_rows
    monkeypatch.setattr(lin, "_verified_rows", lambda w, p, b: calls.append((tuple(w.shape), b is None)) or real(w, p, b))
    verified: dict = {}
    for seed in range(3):
        lin.pack_weight(torch.randn(96, 64).to(BF), None, verified)
    lin.pack_weight(torch.randn(96, 64).to(BF), torch.randn(96).to(BF), verified)
    lin.pack_weight(torch.randn(48, 64).to(BF), None, verified)
    assert calls == [((96, 64), True), ((96, 64), False), ((48, 64), True)]


def test_no_row_count_matches_means_no_packing(monkeypatch):
    _amx_like(monkeypatch)
    monkeypatch.setattr(lin, "_packed_mm", lambda x, p, b: F.linear(x, p, b) + 1)
    assert lin.pack_weight(torch.randn(96, 64).to(BF)) is None


def test_real_packing_on_this_host_is_bit_identical_where_used():
    """Where oneDNN can pack bf16 weights here, every row count up to max_rows gives
    F.linear's bits (with and without bias); elsewhere packing declines quietly."""
    w, b = torch.randn(160, 96).to(BF), torch.randn(160).to(BF)
    for bias in (None, b):
        packed = lin.pack_weight(w, bias)
        if packed is None:
            pytest.skip("oneDNN cannot pack bf16 weights on this CPU (no AVX512-BW/VL/DQ or AVX-NE-CONVERT)")
        assert packed.max_rows in lin.CHECK_ROWS
        for rows in range(1, packed.max_rows + 1, 3):
            x = torch.randn(rows, 96).to(BF)
            assert torch.equal(lin.linear(x, w, packed, bias), F.linear(x, w, bias)), rows
