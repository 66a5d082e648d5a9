"""Extend (prefill) attention over the token KV pool, one kernel for a ragged batch.

Request i has `prefix_lens[i]` cached tokens and `extend_lens[i]` new tokens:

    pool slots req_to_token[r, 0:prefix]      new rows extend_start[i] + 0:extend of q/k/v
    |---------- prefix (full) ----------|------------ extend (causal) ------------|

A program owns BLOCK_M new tokens of one request and one query head. It streams the
prefix K/V straight from the pool through the request's req_to_token row (no gather
into a contiguous buffer), then the new tokens' K/V from the step's own k/v tensors with
a causal mask, using one online softmax across both phases. Query head h reads KV head
h // (num_q_heads // num_kv_heads) (GQA).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sgl.runtime.kernels.jit import interpreting, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # new tokens: q/o [T, Hq, D], k/v [T, Hkv, D]
    k_buf_ptr, v_buf_ptr,  # pool of this layer [S, Hkv, D]
    req_to_token_ptr, req_pool_indices_ptr, prefix_lens_ptr, extend_lens_ptr, extend_start_ptr,
    sm_scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_bs, stride_bh, stride_req,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP

    extend_len = tl.load(extend_lens_ptr + i)
    if m_block * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + i)
    start = tl.load(extend_start_ptr + i)
    row = tl.load(req_pool_indices_ptr + i).to(tl.int64)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < extend_len
    mask_d = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + (start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Finite start so fully masked (padding) rows give 0/0 guarded below, never inf-inf.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Phase 1: the cached prefix, read from the pool through the request's table row.
    for n0 in range(0, prefix_len, BLOCK_N):
        cols = n0 + offs_n
        mask_n = cols < prefix_len
        slots = tl.load(req_to_token_ptr + row * stride_req + cols, mask=mask_n, other=0).to(tl.int64)
        kv_off = slots[:, None] * stride_bs + kv_head * stride_bh + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_buf_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_buf_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k)) * sm_scale_log2
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # Phase 2: the new tokens themselves, causal; blocks past this tile's last row are skipped.
    end = tl.minimum(extend_len, (m_block + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + offs_n
        mask_n = cols < extend_len
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + (start + cols)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (start + cols)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k)) * sm_scale_log2
        visible = mask_n[None, :] & (cols[None, :] <= offs_m[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + (start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float | None = None,
) -> None:
    """Write into `o` [T, Hq, D] the attention of each new token over prefix + new tokens."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    batch_size = int(req_pool_indices.shape[0])
    if num_tokens == 0 or batch_size == 0 or max_extend_len == 0:
        return
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    for t in (q, k, v, o):
        assert t.stride(-1) == 1, "last dim of q/k/v/o must be contiguous"
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and req_to_token.is_contiguous()
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    block_d = next_pow2(head_dim)
    block_m = 64 if block_d <= 64 else 32
    block_n = 64 if block_d <= 64 else 32
    interp = interpreting(_extend_attention_kernel)
    if interp:  # small tiles keep the CPU interpreter quick on tiny test shapes
        block_m = block_n = 16
    grid = (batch_size, num_q_heads, triton.cdiv(max_extend_len, block_m))
    _extend_attention_kernel[grid](
        q, k, v, o, k_buf, v_buf,
        req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1),
        k_buf.stride(0), k_buf.stride(1), req_to_token.stride(0),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, UPCAST=interp,
    )
