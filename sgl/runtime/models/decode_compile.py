"""Opt-in torch.compile (Inductor, CPU) of the single-token decode step's dense parts.

Enabled with `SGL_TORCH_COMPILE=1`; used only for steps with exactly one token on a CPU
model in bf16. A batch-1 decode step is bound by streaming the weights through
matrix-vector products and by the per-op overhead of the ~20 small ops around them per
layer. Here the two blocks around attention (norm + qkv + RoPE, and o-proj + residual +
norm + gate/up + SiLU + down + residual) are each one compiled graph, with the products
written as multiply-and-sum so that Inductor generates a vectorized streaming reduction
(faster than oneDNN's GEMV at one row here) and fuses the elementwise ops around it.
Weights are passed as arguments, so all layers share one compiled graph. The results
match the eager path to bf16 rounding (same fp32 accumulation, a different order).
The first compiled step pays the compile: ~14 s on 2 cores with an empty Inductor cache,
~4 s with a warm one. Batch-1 decode of SmolLM2-135M: ~33 -> ~23 ms per step.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F


def enabled() -> bool:
    return os.environ.get("SGL_TORCH_COMPILE", "0") not in ("", "0")


def _matvec(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [1, in] @ w[out, in].T in fp32 accumulation, rounded to the weight dtype."""
    return (x.float() * w.float()).sum(-1, keepdim=True).to(w.dtype).view(1, -1)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _pre_attention(x: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv_w: torch.Tensor,
                   qkv_b: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                   h: int, kv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv = _matvec(_norm(x, norm_w, eps), qkv_w)
    if qkv_b is not None:
        qkv = qkv + qkv_b
    qk = qkv[:, : (h + kv) * d].view(1, h + kv, 2, d // 2)
    qk = (qk * cos + qk.flip(2) * sin).view(1, h + kv, d)
    return qk[:, :h], qk[:, h:], qkv[:, (h + kv) * d :].view(1, kv, d)


def _post_attention(x: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                    norm_w: torch.Tensor, eps: float, gate_up_w: torch.Tensor,
                    down_w: torch.Tensor) -> torch.Tensor:
    a = _matvec(o.reshape(1, -1), o_w)
    if o_b is not None:
        a = a + o_b
    x = x + a
    gate, up = _matvec(_norm(x, norm_w, eps), gate_up_w).chunk(2, dim=-1)
    return x + _matvec(F.silu(gate) * up, down_w)


def _head(x: torch.Tensor, norm_w: torch.Tensor, eps: float, head_w: torch.Tensor) -> torch.Tensor:
    return _matvec(_norm(x, norm_w, eps), head_w).float()


_compiled: dict[str, Callable[..., torch.Tensor]] = {}
# Materialize every intermediate: by default Inductor inlines the norm (and SiLU * up)
# into the reduction that consumes it, recomputing it for every output row of the
# matvec (head 6.0 -> 3.5 ms, post-attention block 0.52 -> 0.36 ms per layer). Casts
# round as in eager (bf16 between ops), so results stay close to the eager path.
_OPTS = {"realize_cpu_opcount_threshold": 1, "emulate_precision_casts": True}


def get(name: str) -> Callable:
    """The compiled 'pre_attention', 'post_attention' or 'head' (compiled lazily, once)."""
    if not _compiled:
        for fn in (_pre_attention, _post_attention, _head):
            _compiled[fn.__name__.lstrip("_")] = torch.compile(fn, dynamic=False, options=_OPTS)
    return _compiled[name]
