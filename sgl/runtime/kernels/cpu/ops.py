"""Fused bf16 elementwise ops for the CPU forward (kernels/cpu/ops.c via binding.py), with torch fallbacks.

The torch path of a Llama layer spends its non-matmul time in ~15 small ops (RMSNorm's
float32 round trip, RoPE's flip and products, SiLU*up, residual adds), each a pass over
memory and a dispatch. These wrappers run each group as one C pass per row, with the
same bf16 rounding as the torch expressions (see ops.c), on one thread by default (two
on request, see DEFAULT_THREADS).

`applies(x)` says whether the C ops serve tensors like `x`: bf16 on the CPU, the library
built, and `SGL_DISABLE_CPU_OPS` unset (or 0). Each wrapper also computes the torch
expression itself where they do not, so callers may use them unconditionally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl.runtime.config import settings
from sgl.runtime.kernels.cpu import binding
from sgl.runtime.kernels.cpu.binding import Kernels, RopeParams, Status

_lib: Kernels | None | bool = False  # False: not looked up yet (tests put the portable build here)


def library() -> Kernels | None:
    """The bound kernel library these wrappers call, or None."""
    global _lib
    if _lib is False:
        _lib = binding.kernels()
    return _lib  # type: ignore[return-value]


def enabled() -> bool:
    return not settings().disable_cpu_ops


def _usable(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and library() is not None


def applies(x: torch.Tensor) -> bool:
    """Whether a forward over tensors like `x` should take the fused ops: the caller asks
    once per forward (the switch is a settings lookup); each op only checks `_usable`."""
    return _usable(x) and enabled()


# Threads per call. One by default: standalone, two threads halve an op's time (1,024
# rows: RoPE 190 -> 103 us, SiLU*up 700 -> 350 us), but inside the forward team.c's
# helper competes with torch's OpenMP threads of the GEMMs around each op. Measured in
# the model forward (2 cores, C attention backend), one vs two threads: the ops of a
# 1,024-token prefill take 60 vs 40 ms, yet the forward is no faster (822 vs 823 ms);
# a batch-64 decode step is equal (96 vs 97 ms). Before the helper rested after each op
# (team_rest), two made the forward slower (batch-64 step 94 -> 119 ms).
DEFAULT_THREADS = 1


def _c(t: torch.Tensor) -> int:
    return t.data_ptr()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int | None = None) -> torch.Tensor:
    """`weight * F.rms_norm(x.float(), eps).to(x.dtype)` over the last dim of 2-D `x`."""
    lib = library() if _usable(x) else None
    if lib is None:
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.rmsnorm(_c(x), _c(weight), _c(out), x.shape[0], x.shape[1], eps, threads or DEFAULT_THREADS)
    return out


def add_rmsnorm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
                threads: int | None = None) -> torch.Tensor:
    """`x += y` (in place; `x` must be contiguous), then `rmsnorm(x, weight, eps)`."""
    lib = library() if _usable(x) else None
    if lib is None or not x.is_contiguous():
        x.add_(y)
        return rmsnorm(x, weight, eps, threads)
    y = y.contiguous()
    out = torch.empty_like(x)
    lib.add_rmsnorm(_c(x), _c(y), _c(weight), _c(out), x.shape[0], x.shape[1], eps, threads or DEFAULT_THREADS)
    return out


def rope_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
          head_dim: int, threads: int | None = None) -> torch.Tensor:
    """Rotate-half RoPE in place on the first `heads` heads of each row of `qkv` [T, >=
    heads * head_dim] (row-contiguous), with `cos`/`sin` [max_pos, head_dim / 2] tables
    in qkv's dtype: per half, `(a, b) -> (a c - b s, b c + a s)`, each product rounded to
    the dtype as torch's `qk * cos + qk.flip(2) * sin` does. Returns qkv."""
    lib = library() if _usable(qkv) else None
    if lib is None or qkv.stride(1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        t = qkv.shape[0]
        qk = qkv[:, : heads * head_dim].view(t, heads, 2, head_dim // 2)
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        cs, sn = torch.stack((c, c), dim=2), torch.stack((-s, s), dim=2)
        qk.copy_(qk * cs + qk.flip(2) * sn)
        return qkv
    pos = positions.to(torch.int64).contiguous()
    rc = lib.rope(RopeParams(qkv=_c(qkv), stride=qkv.stride(0), rows=qkv.shape[0], nh=heads, d=head_dim,
                             cos_t=_c(cos), sin_t=_c(sin), positions=_c(pos), max_pos=cos.shape[0],
                             threads=threads or DEFAULT_THREADS))
    if rc != Status.OK:
        raise IndexError(f"{rc.message} ({cos.shape[0]} positions)")
    return qkv


def silu_mul(gate_up: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """`F.silu(gate) * up` where `gate, up = gate_up.chunk(2, dim=-1)` (2-D)."""
    lib = library() if _usable(gate_up) else None
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate_up = gate_up.contiguous()
    n = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], n, dtype=gate_up.dtype)
    lib.silu_mul(_c(gate_up), _c(out), gate_up.shape[0], n, threads or DEFAULT_THREADS)
    return out
