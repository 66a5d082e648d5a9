"""store_kv: scatter the new tokens' K/V into one layer of the token KV pool.

Row t of `k`/`v` ([T, num_kv_heads, head_dim]) goes to pool slot `loc[t]`. One program
copies one token's K and V row (all heads at once); the store casts to the pool dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl.runtime.kernels.jit import next_pow2


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, loc_ptr, k_buf_ptr, v_buf_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bs, stride_bh,  # pool strides (slot, head), shared by the K and V buffers
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src_k = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot * stride_bs + offs_h[:, None] * stride_bh + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_buf_ptr + dst, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    tl.store(v_buf_ptr + dst, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor
) -> None:
    """k_buf[loc[t]] = k[t]; v_buf[loc[t]] = v[t] for every new token t."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "last dim of k/v must be contiguous"
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.shape == v_buf.shape
    _store_kv_kernel[(num_tokens,)](
        k, v, loc, k_buf, v_buf,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
    )
