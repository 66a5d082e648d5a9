"""Prepacked CPU linears for small batches.

oneDNN's blocked weight layout (prepacked once at load) makes bf16 matmuls with a few
rows (decode steps) about 2x faster than `F.linear` on the plain row-major weight, with
bit-identical results. Large-row matmuls (prefill) gain nothing, so they keep the plain
weight. Anything but bf16 on a CPU with oneDNN keeps the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Above this many rows the plain GEMM is as fast as the packed one (measured with AVX512-BF16).
PACKED_MAX_ROWS = 256


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a [out, in] weight, or None where packing does not apply."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
    except (RuntimeError, AttributeError):  # an older or differently built torch
        return None


def linear(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    if packed is not None and x.shape[0] <= PACKED_MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, w, bias)
