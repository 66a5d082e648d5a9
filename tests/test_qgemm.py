"""The tiled product over GGUF blocks (kernels/cpu/qgemm.c), the `--cpu-linear gguf` path:
int8 activation rows times the weights' integer values in AVX512-VNNI dot products.

Against references: the float64 product of gguf-py's dequantized weights within the
activation-rounding bound (plus the bf16 rounding of the output); the decode step's block
product (quant.c) to fp32 order. Invariants: a row's bits do not depend on the rows beside
it; the plain-C and VNNI builds give the same bits; odd shapes (outputs not a multiple of
the 16-wide tile, 1..33 rows) and the bias; Q6_K, which has no tile form, is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from sgl.runtime.kernels.cpu import binding
from sgl.runtime.kernels.cpu.linear import tile_mm, tile_weight
from tests.test_quant_kernels import BOUND, FP32_SLACK, _kernels, _product, _random_blocks, _x

pytestmark = pytest.mark.skipif(binding.kernels() is None, reason="no C compiler for the CPU kernels")

TILED = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K]


def _tiles(t: T, blocks: np.ndarray, n_in: int, bias: torch.Tensor | None = None):
    tw = tile_weight(torch.from_numpy(blocks), int(t), (blocks.shape[0], n_in), bias, threads=2)
    assert tw is not None
    return tw


def _run(k: binding.Kernels, tw, x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    """The product on build `k` (the tile form is the same bytes for every build)."""
    y = torch.empty(x.shape[0], tw.out, dtype=torch.bfloat16)
    bias = tw.bias.data_ptr() if tw.bias is not None else None
    assert k.qgemm(tw.tiles.data_ptr(), tw.wtype, tw.out, tw.n_in, x.data_ptr(), x.shape[0], bias, y.data_ptr(),
                   threads) == 0
    return y


@pytest.mark.parametrize("t", TILED, ids=lambda t: t.name)
def test_product_within_the_activation_rounding_bound(t):
    rng = np.random.default_rng(int(t) + 50)
    n_in = 768 if t == T.Q4_K else 544  # 544: 17 blocks
    blocks = _random_blocks(t, 40, n_in, rng)  # 40 outputs: two whole tiles and a partial one
    bias = torch.randn(40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tw = _tiles(t, blocks, n_in, bias)
    w = dequantize(blocks, t).astype(np.float64)
    for rows in (1, 7, 9, 33):
        x = _x(rows, n_in, rows)
        y = tile_mm(x, tw).double().numpy()
        xf = x.double().numpy()
        ref = xf @ w.T + bias.double().numpy()
        scale = np.linalg.norm(xf, axis=1)[:, None] * np.linalg.norm(w, axis=1)[None, :]
        err = np.abs(y - ref)
        assert (err <= (BOUND + FP32_SLACK) * scale + np.abs(ref) * 2.0 ** -8).all(), (rows, (err / scale).max())
        # the decode step's product of the same blocks: the same integers, another fp32 order
        dec = _product(binding.kernels(), t, blocks, x) + bias.float().numpy()
        assert np.abs(y - dec).max() <= np.abs(dec).max() * 2.0 ** -7 + 1e-3


@pytest.mark.parametrize("t", TILED, ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_whatever_shares_its_call(t):
    n_in = 512
    blocks = _random_blocks(t, 24, n_in, np.random.default_rng(9))
    tw = _tiles(t, blocks, n_in)
    x = _x(37, n_in, 11)  # four groups of 8 rows and a partial one
    whole = tile_mm(x, tw)
    for i in (0, 5, 8, 36):
        assert torch.equal(tile_mm(x[i: i + 1], tw), whole[i: i + 1]), i
    assert torch.equal(tile_mm(x[3:20], tw), whole[3:20])
    one_thread = _run(binding.kernels(), tw, x, threads=1)
    assert torch.equal(one_thread, whole)


@pytest.mark.parametrize("t", TILED, ids=lambda t: t.name)
def test_plain_c_and_vnni_builds_give_the_same_bits(t):
    plain = _kernels("x86-64-v2")
    assert plain.qgemm_simd() == 0
    n_in = 256 if t == T.Q4_K else 96
    blocks = _random_blocks(t, 19, n_in, np.random.default_rng(13))
    bias = torch.randn(19, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    tw = _tiles(t, blocks, n_in, bias)
    x = _x(10, n_in, 17)
    assert torch.equal(_run(plain, tw, x), _run(binding.kernels(), tw, x))


@pytest.mark.parametrize("t", TILED, ids=lambda t: t.name)
def test_non_finite_and_tiny_activations_agree_on_every_build(t):
    """A row holding NaN or inf gives NaN (not a clamped finite value), a block too small to
    scale (127 / amax overflows) counts as zeros, and both builds agree; other rows are as
    without them."""
    plain = _kernels("x86-64-v2")
    n_in = 256 if t == T.Q4_K else 96
    tw = _tiles(t, _random_blocks(t, 19, n_in, np.random.default_rng(21)), n_in)
    x = _x(4, n_in, 23)
    x[1, 5] = float("nan")
    x[2, 40] = float("-inf")
    x[3, :32] = 1e-38
    zeroed = x[3:4].clone()
    zeroed[0, :32] = 0
    for k in (plain, binding.kernels()):
        y = _run(k, tw, x)
        assert torch.isnan(y[1:3]).all() and not torch.isnan(y[0]).any() and not torch.isnan(y[3]).any()
        assert torch.equal(y[3:4], _run(k, tw, zeroed))
        assert torch.equal(y[0:1], _run(k, tw, x[0:1]))
    assert torch.equal(_run(plain, tw, x[[0, 3]]), _run(binding.kernels(), tw, x[[0, 3]]))


def test_types_without_a_tile_form_are_refused():
    k = binding.kernels()
    assert k.qgemm_packed_bytes(int(T.Q6_K), 16, 256) == 0
    assert k.qgemm_packed_bytes(int(binding.WeightType.BF16), 16, 256) == 0
    assert k.qgemm_packed_bytes(int(T.Q4_1), 16, 48) == 0  # not whole blocks
    blocks = _random_blocks(T.Q6_K, 16, 256, np.random.default_rng(1))
    assert tile_weight(torch.from_numpy(blocks), int(T.Q6_K), (16, 256), None, 2) is None


def test_a_product_of_the_wrong_width_is_refused():
    rng = np.random.default_rng(7)
    tw = _tiles(T.Q8_0, _random_blocks(T.Q8_0, 16, 64, rng), 64)
    for bad in (torch.zeros(3, 32), torch.zeros(2, 3, 64), torch.zeros(64)):
        with pytest.raises(ValueError, match="needs x of shape"):
            tile_mm(bad, tw)
    assert tile_mm(torch.zeros(3, 64), tw).shape == (3, 16)
