"""The C products over GGUF blocks (kernels/cpu/quant.c) against a float64 reference.

For each block type (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), on random tensors and on real ones
from the embedded GGUF: the C dequantization equals gguf-py's exactly, and the product
y = W x equals the float64 product of gguf-py's dequantized W with x within the bound
of the int8 activation rounding. The bound, per output: every activation element is
rounded to d_b q with |x - d_b q| <= d_b / 2 = amax_b / 254 (block b of 32), so

    |y - y~| <= sum_b amax_b / 254 * sum_{k in b} |w_k| <= sqrt(32) / 254 * ||w|| * ||x||

(Cauchy-Schwarz within a block, amax_b^2 <= sum of the block's x^2, then across blocks);
weights are exact (the reference dequantizes the same blocks), fp32 accumulation adds
~1e-6 relative. That worst case is loose, so the RMS error is also held to twice its
expectation for rounding errors uniform in [-d_b/2, d_b/2]: sqrt(sum_k w_k^2 d_b^2 / 12).
Odd output counts, 1..8 activation rows; a row's result is bit-identical whatever rows
share its call; the plain-C build agrees with this CPU's build to fp32 summation order;
the VNNI variants at least compile where the compiler knows the flags.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize, quantize

from sgl.runtime.kernels.cpu import binding
from sgl.runtime.models.loader import embedded_gguf_path

pytestmark = pytest.mark.skipif(binding.kernels() is None, reason="no C compiler for the CPU kernels")

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K]
BOUND = np.sqrt(32) / 254
FP32_SLACK = 1e-4  # of ||w|| ||x||: fp32 block scaling and accumulation, far above what it is


def _host_runs(march: str) -> bool:
    need = {"x86-64-v3": ("avx2", "fma", "f16c", "bmi2"), "x86-64-v2": ("sse4_2", "popcnt")}.get(march, ())
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    return all(f in flags.split() for f in need)


def _kernels(march: str) -> binding.Kernels:
    if march != "native" and not _host_runs(march):
        pytest.skip(f"this CPU cannot run a -march={march} build")
    k = binding.kernels(march)
    if k is None:
        pytest.skip(f"cannot build -march={march}")
    return k


def _random_blocks(t: T, out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [out, row bytes] of valid blocks: real quantization where gguf-py has it (the
    32-element types), else random bytes with finite, small half-float scales (K types)."""
    if t in (T.Q8_0, T.Q4_0, T.Q4_1):
        return np.ascontiguousarray(quantize(rng.standard_normal((out, n_in)).astype(np.float32), t))
    size = {T.Q4_K: 144, T.Q6_K: 210}[t]
    nb = n_in // 256
    b = rng.integers(0, 256, (out, nb, size), dtype=np.uint8)

    def half(scale: float) -> np.ndarray:
        return (rng.random((out, nb)) * scale + 1e-3).astype(np.float16).view(np.uint8).reshape(out, nb, 2)

    if t == T.Q4_K:
        b[:, :, 0:2], b[:, :, 2:4] = half(0.01), half(0.01)
    else:
        b[:, :, 208:210] = half(0.01)
    return np.ascontiguousarray(b.reshape(out, nb * size))


def _product(k: binding.Kernels, t: T, blocks: np.ndarray, x: torch.Tensor) -> np.ndarray:
    out, n_in = blocks.shape[0], x.shape[1]
    y = np.zeros((x.shape[0], out), np.float32)
    assert k.quant_gemv(int(t), blocks.ctypes.data, out, n_in, x.data_ptr(), x.shape[0], y.ctypes.data) == 0
    return y


def _check_bound(t: T, blocks: np.ndarray, x: torch.Tensor, y: np.ndarray) -> None:
    w = dequantize(blocks, t).astype(np.float64)
    xf = x.double().numpy()
    err = np.abs(y - xf @ w.T)
    scale = np.linalg.norm(xf, axis=1)[:, None] * np.linalg.norm(w, axis=1)[None, :]
    assert (err <= (BOUND + FP32_SLACK) * scale).all(), (err / scale).max()
    # the statistical check: RMS error vs its expectation from each block's step d_b
    d = np.abs(xf).reshape(len(xf), -1, 32).max(-1) / 127  # [B, blocks]
    var = (w.reshape(len(w), -1, 32) ** 2).sum(-1) @ (d ** 2).T / 12  # [out, B]
    assert np.sqrt((err ** 2).mean()) <= 2 * np.sqrt(var.mean())


def _x(rows: int, n_in: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, n_in, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).contiguous()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_py_exactly(t):
    k = binding.kernels()
    blocks = _random_blocks(t, 13, 512, np.random.default_rng(1))
    got = np.zeros((13, 512), np.float32)
    assert k.quant_dequant(int(t), blocks.ctypes.data, 13, 512, got.ctypes.data) == 0
    assert np.array_equal(got, dequantize(blocks, t))


@pytest.mark.parametrize("march", ["native", "x86-64-v2"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_random_product_within_the_activation_rounding_bound(t, march):
    k = _kernels(march)
    rng = np.random.default_rng(int(t))
    n_in = 768 if t in (T.Q4_K, T.Q6_K) else 544  # 544: 17 blocks, not a multiple of 64
    blocks = _random_blocks(t, 37, n_in, rng)
    for rows in range(1, 9):
        x = _x(rows, n_in, rows)
        _check_bound(t, blocks, x, _product(k, t, blocks, x))


@pytest.fixture(scope="module")
def real_tensors() -> dict[str, tuple[T, np.ndarray]]:
    """A few matrices of the embedded file as stored: name -> (type, uint8 [rows, bytes])."""
    reader = GGUFReader(str(embedded_gguf_path()))
    want = {"blk.0.attn_q.weight": None, "blk.3.ffn_down.weight": None, "blk.29.ffn_gate.weight": None,
            "token_embd.weight": 1500}
    out = {}
    for t in reader.tensors:
        if t.name in want:
            data = np.asarray(t.data).view(np.uint8)
            out[t.name] = (T(int(t.tensor_type)), np.ascontiguousarray(data[: want[t.name]]))
    return out


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "blk.29.ffn_gate.weight",
                                  "token_embd.weight"])
def test_real_tensor_products_within_the_bound(real_tensors, name):
    t, blocks = real_tensors[name]
    assert t in (T.Q4_1, T.Q8_0)
    k = binding.kernels()
    n_in = dequantize(blocks[:1], t).shape[1]
    for rows in (1, 3, 8):
        x = _x(rows, n_in, 100 + rows)
        _check_bound(t, blocks, x, _product(k, t, blocks, x))


@pytest.mark.parametrize("march", ["native", "x86-64-v2"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_whatever_shares_its_call(t, march):
    k = _kernels(march)
    n_in = 512
    blocks = _random_blocks(t, 21, n_in, np.random.default_rng(7))
    x = _x(8, n_in, 7)
    alone = np.concatenate([_product(k, t, blocks, x[i: i + 1]) for i in range(8)])
    for rows in range(2, 9):  # groups of 4 rows share a decoded weight row, then the rest
        assert np.array_equal(_product(k, t, blocks, x[:rows]), alone[:rows]), rows
    assert np.array_equal(_product(k, t, blocks, x[3:8]), alone[3:8])


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_plain_c_and_simd_builds_agree_to_fp32_order(t):
    fast, plain = binding.kernels(), _kernels("x86-64-v2")
    n_in = 1024
    blocks = _random_blocks(t, 33, n_in, np.random.default_rng(3))
    x = _x(5, n_in, 3)
    a, b = _product(fast, t, blocks, x), _product(plain, t, blocks, x)
    w = dequantize(blocks, t).astype(np.float64)
    scale = np.linalg.norm(x.double().numpy(), axis=1)[:, None] * np.linalg.norm(w, axis=1)[None, :]
    # the same int8 activations and per-block integers: only the fp32 summation order differs
    assert (np.abs(a - b) <= 1e-5 * scale).all()


def test_shapes_that_are_not_whole_blocks_are_refused():
    k = binding.kernels()
    assert k.quant_row_bytes(int(T.Q4_1), 576) == 18 * 20
    assert k.quant_row_bytes(int(T.Q8_0), 576) == 18 * 34
    assert k.quant_row_bytes(int(T.Q4_K), 576) == 0  # K quants: 256-element super-blocks
    assert k.quant_row_bytes(int(T.Q6_K), 512) == 2 * 210
    assert k.quant_row_bytes(int(T.F16), 512) == 0
    x = _x(1, 40, 0)
    y = np.zeros(4, np.float32)
    blocks = np.zeros((4, 64), np.uint8)
    assert k.quant_gemv(int(T.Q8_0), blocks.ctypes.data, 4, 40, x.data_ptr(), 1, y.ctypes.data) == \
        binding.Status.UNSUPPORTED


def _cc_accepts(cc: str, flags: list[str]) -> bool:
    r = subprocess.run([cc, *flags, "-x", "c", "-c", "-o", "/dev/null", "-"], input="int x;", text=True,
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("flags", [["-march=x86-64-v3", "-mavxvnni"],
                                   ["-march=x86-64-v3", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni"],
                                   ["-march=sapphirerapids"], ["-march=cooperlake"]],
                         ids=["avx-vnni", "avx512-vnni", "sapphirerapids", "cooperlake"])
def test_the_library_builds_for_vnni_and_avx512_hosts(flags, tmp_path):
    """Code this CPU cannot run must at least compile (it is correct by construction: the
    VNNI dot product gives the same int32 lanes as maddubs + madd)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not _cc_accepts(cc, flags):
        pytest.skip(f"the compiler does not take {flags}")
    src = Path(binding.__file__).parent
    out = tmp_path / "lib.so"
    subprocess.run([cc, "-O2", *flags, "-fPIC", "-shared", "-pthread", "-o", str(out),
                    *map(str, sorted(src.glob("*.c"))), "-lm"], check=True, capture_output=True, timeout=300)
    assert out.stat().st_size > 0
