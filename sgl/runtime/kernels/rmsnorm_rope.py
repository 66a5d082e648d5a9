"""Fused RMSNorm (with optional residual add) and in-place rotary embedding kernels.

Elementwise/row-reduction ops that torch runs as several passes over memory: RMSNorm
reads the row once, optionally adds the residual (writing the sum back for the next
layer), normalizes in fp32 and scales by the weight in the model dtype, as HF Llama
does. RoPE rotates q/k heads in place with the rotate-half layout

    x = [x1 | x2]  (halves of head_dim)  ->  [x1*cos - x2*sin | x2*cos + x1*sin]

reading cos/sin rows [max_pos, head_dim/2] at each token's position. One program
handles one token row (all heads for RoPE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl.runtime.kernels.jit import next_pow2


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Add in fp32 and round once, as torch does for bf16 (the interpreter can't add bf16).
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [T, N] (of x + residual, stored back into `residual`, when given)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1 and residual.dtype == x.dtype
    res = residual if residual is not None else x
    _rmsnorm_kernel[(x.shape[0],)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), eps,
        N=x.shape[1], BLOCK=next_pow2(x.shape[1]), HAS_RESIDUAL=residual is not None,
    )
    return out


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_c,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_c + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_c + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    mask = (offs_h[:, None] < NUM_HEADS) & mask_d[None, :]
    p1 = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * c[None, :] - x2 * s[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


def apply_rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place; cos/sin are [max_pos, D/2] tables. Returns x."""
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(-1) == 1 and head_dim % 2 == 0
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride() and cos.shape[-1] == head_dim // 2
    if num_tokens == 0:
        return x
    _rope_kernel[(num_tokens,)](
        x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
        NUM_HEADS=num_heads, HALF=head_dim // 2, BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim // 2),
    )
    return x
