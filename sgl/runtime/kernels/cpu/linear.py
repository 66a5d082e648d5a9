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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def linear(x: torch.Tensor, w: torch.Tensor, packed: PackedWeight | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    if packed is not None and x.shape[0] <= packed.max_rows:
        return _packed_mm(x, packed.tensor, bias)
    return F.linear(x, w, bias)
