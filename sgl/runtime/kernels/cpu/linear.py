"""Prepacked CPU linears for small batches, used only where verified on this host.

oneDNN's blocked weight layout (prepacked once at load) makes bf16 matmuls with a few
rows (decode steps past the C decode kernel's batch sizes) about 2x faster than
`F.linear` on the plain row-major weight on AVX512-BF16 hosts. Whether the packed
product gives the plain product's exact bits depends on the host: on Zen 4 it does up
to 256 rows; on an AMX host it first differs at 33 rows (by one bf16 ulp, another
summation order). A step's rows must not round differently from the same rows in a
larger batch, so at pack time each weight shape is checked against `F.linear` at
CHECK_ROWS row counts (with its bias) and the packed path serves only up to the last
count that matched bit for bit; past it, and where packing fails, `F.linear` runs.

The fp32 path (`Fp32Weight`, chosen by measurement in runtime/tuning) serves hosts where
bf16 GEMMs have no hardware (AVX2: oneDNN's bf16 matmul runs 5-17 GFLOP/s, fp32 ~76): a
float32 copy of the bf16 weight is made once, the bf16 activations are upcast, and the
product is rounded back to bf16, so the model (KV, C decode step) stays bf16. MKL's
sgemm picks another kernel for a few rows (its gemv path sums in another order), so at
build time each shape is checked: the rows of an M-row product must equal the same rows
of a large product, and products of fewer rows than the smallest M that matched (with
every larger checked M, and at least FP32_MIN_ROWS) are zero-padded up to it, so a row's
bits do not depend on how many rows share its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl.runtime.kernels.cpu.binding import Kernels, Status, kernels

# Row counts checked at pack time, up to the largest that may take the packed path:
# above 256 rows the plain GEMM is as fast as the packed one (measured with AVX512-BF16).
CHECK_ROWS = (1, 2, 8, 16, 32, 33, 64, 128, 256)


@dataclass(frozen=True)
class PackedWeight:
    tensor: torch.Tensor  # oneDNN's blocked copy of the [out, in] weight
    max_rows: int  # largest row count verified to give F.linear's exact bits here


def _reorder(w: torch.Tensor) -> torch.Tensor:
    # The batch-size hint picks oneDNN's blocked layout; products at other row counts are
    # checked against F.linear by _verified_rows before any is used.
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)


def _packed_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _verified_rows(w: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> int:
    g = torch.Generator().manual_seed(0)
    ok = 0
    for rows in CHECK_ROWS:
        x = torch.randn(rows, w.shape[1], generator=g).to(w.dtype)
        if not torch.equal(_packed_mm(x, packed, bias), F.linear(x, w, bias)):
            break
        ok = rows
    return ok


def pack_weight(w: torch.Tensor, bias: torch.Tensor | None = None,
                verified: dict[tuple, int] | None = None) -> PackedWeight | None:
    """The packed copy of a [out, in] weight, or None where packing does not apply or no
    row count matched. `verified` memoizes the check per (shape, has bias) across the
    weights of one model: the kernel oneDNN picks depends on the shapes, not the values."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = _reorder(w)
        key = (tuple(w.shape), bias is not None)
        rows = verified.get(key) if verified is not None else None
        if rows is None:
            rows = _verified_rows(w, packed, bias)
            if verified is not None:
                verified[key] = rows
    except (RuntimeError, AttributeError):  # an older or differently built torch, or a CPU without bf16 GEMMs
        return None
    return PackedWeight(packed, rows) if rows > 0 else None


# Products of fewer rows are always padded to FP32_MIN_ROWS: below it MKL's choice of
# kernel varies with the row count itself (measured on Zen 3: rows 1-3, 6, 7 and 11 differ
# for SmolLM2's shapes, none from 12 to 600). Row counts checked from there, against the
# same rows of a larger product: 1024 rows (a prefill chunk), or 256 for a big LM head.
FP32_MIN_ROWS = 32
FP32_CHECK_ROWS = (32, 33, 47, 64, 100, 128, 255, 256, 512)
BIG_WEIGHT = 1 << 22  # elements


@dataclass(frozen=True)
class Fp32Weight:
    weight: torch.Tensor  # float32 copy of the [out, in] bf16 weight
    bias: torch.Tensor | None  # float32 copy of the bias
    min_rows: int  # products of fewer rows are zero-padded to this many (see the module docstring)


def _fp32_min_rows(w32: torch.Tensor, b32: torch.Tensor | None) -> int:
    """The smallest checked row count from which every checked count gives the large
    product's bits (also at an offset into the batch), or 0 where none does."""
    g = torch.Generator().manual_seed(0)
    ref_rows = 256 if w32.numel() > BIG_WEIGHT else 1024
    x = torch.randn(ref_rows, w32.shape[1], generator=g).to(torch.bfloat16).float()
    ref = F.linear(x, w32, b32).to(torch.bfloat16)
    good = 0
    for rows in reversed([r for r in FP32_CHECK_ROWS if r + 5 <= ref_rows]):
        same = torch.equal(F.linear(x[:rows], w32, b32).to(torch.bfloat16), ref[:rows])
        off = 5  # the same rows at another place in the batch
        same = same and torch.equal(F.linear(x[off:off + rows], w32, b32).to(torch.bfloat16), ref[off:off + rows])
        if not same:
            break
        good = rows
    return max(good, FP32_MIN_ROWS) if good else 0


def fp32_weight(w: torch.Tensor, bias: torch.Tensor | None = None,
                verified: dict[tuple, int] | None = None) -> Fp32Weight | None:
    """The fp32 form of a bf16 [out, in] CPU weight, or None where no row count checked
    out (then the caller keeps the bf16 path for this weight). `verified` memoizes the
    check per (shape, has bias): MKL picks its kernel by shape, not by values."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16:
        return None
    w32 = w.detach().float().contiguous()
    b32 = bias.detach().float() if bias is not None else None
    key = ("fp32", tuple(w.shape), bias is not None)
    rows = verified.get(key) if verified is not None else None
    if rows is None:
        rows = _fp32_min_rows(w32, b32)
        if verified is not None:
            verified[key] = rows
    return Fp32Weight(w32, b32, rows) if rows > 0 else None


def fp32_mm(x: torch.Tensor, fw: Fp32Weight) -> torch.Tensor:
    """bf16(x @ W.T + b) computed in float32, padded to `fw.min_rows` rows."""
    n = x.shape[0]
    xf = x.float()
    if n < fw.min_rows:
        xf = torch.cat((xf, xf.new_zeros(fw.min_rows - n, xf.shape[1])))
    y = F.linear(xf, fw.weight, fw.bias).to(x.dtype)
    return y[:n] if n < fw.min_rows else y


@dataclass(frozen=True)
class TileWeight:
    """A GGUF-block matrix in qgemm.c's tile form: products with int8-quantized activation
    rows in integer dot products (the `gguf` linear path, chosen by measurement where the
    build has AVX512-VNNI). A row's result does not depend on the rows beside it."""

    kernels: Kernels  # the library that packed the tiles (bound once, not looked up per product)
    tiles: torch.Tensor  # uint8, sgl_qgemm_packed_bytes
    wtype: int  # binding.WeightType
    out: int
    n_in: int
    bias: torch.Tensor | None  # bf16 [out]
    threads: int  # 1, or 2: the decode step's team of two threads


def tile_weight(block: torch.Tensor, wtype: int, shape: tuple[int, int], bias: torch.Tensor | None,
                threads: int) -> TileWeight | None:
    """The tile form of one matrix of GGUF blocks (uint8 [out, row bytes]), or None where
    the type has none (Q6_K) or the kernels are not built here."""
    k = kernels()
    out, n_in = shape
    size = k.qgemm_packed_bytes(wtype, out, n_in) if k is not None else 0
    if not size or tuple(block.shape) != (out, k.quant_row_bytes(wtype, n_in)):
        return None
    tiles = torch.empty(size, dtype=torch.uint8)
    src = block.contiguous()  # held through the call: a temporary copy would be freed under it
    if k.qgemm_pack(wtype, src.data_ptr(), out, n_in, tiles.data_ptr()) != Status.OK:
        return None
    b = bias.detach().to(torch.bfloat16).contiguous() if bias is not None else None
    return TileWeight(k, tiles, wtype, out, n_in, b, threads)


def tile_mm(x: torch.Tensor, tw: TileWeight) -> torch.Tensor:
    """bf16(x @ W.T + b) over the tile form (qgemm.c); x is [rows, n_in]."""
    if x.dim() != 2 or x.shape[1] != tw.n_in:
        raise ValueError(f"tile product of a [{tw.out}, {tw.n_in}] weight needs x of shape [rows, {tw.n_in}]; "
                         f"got {list(x.shape)}")
    x = x.to(torch.bfloat16).contiguous()
    y = torch.empty(x.shape[0], tw.out, dtype=torch.bfloat16)
    if x.shape[0]:
        st = tw.kernels.qgemm(tw.tiles.data_ptr(), tw.wtype, tw.out, tw.n_in, x.data_ptr(), x.shape[0],
                             tw.bias.data_ptr() if tw.bias is not None else None, y.data_ptr(), tw.threads)
        if st != Status.OK:
            raise RuntimeError(f"tiled GGUF product failed: {st.message}")
    return y


def linear(x: torch.Tensor, w: torch.Tensor, packed: PackedWeight | Fp32Weight | TileWeight | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) on the weight's fast form where it has one (`packed`)."""
    if isinstance(packed, TileWeight):
        return tile_mm(x, packed)
    if isinstance(packed, Fp32Weight):
        return fp32_mm(x, packed)
    if packed is not None and x.shape[0] <= packed.max_rows:
        return _packed_mm(x, packed.tensor, bias)
    return F.linear(x, w, bias)
