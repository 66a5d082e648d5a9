"""Decode attention over the token KV pool with split-KV (flash-decoding).

Every request adds one query token and attends over its whole sequence
`req_to_token[r, 0:seq_len]` (its own new K/V are already in the pool). A single long
sequence would leave most of the GPU idle, so the sequence is cut into `num_splits`
ranges of cdiv(seq_len, num_splits) tokens:

    seq:    |--- split 0 ---|--- split 1 ---| ... |-- split S-1 --|
    stage 1: one program per (request, KV head, split) -> partial out + log-sum-exp
    stage 2: one program per (request, query head)     -> lse-weighted merge of splits

In stage 1 a program handles all GROUP query heads that share one KV head, so each K/V
row is loaded once per group (GQA); the group is padded to 16 rows for `tl.dot`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sgl.runtime.kernels.jit import interpreting, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_stage1_kernel(
    q_ptr, k_buf_ptr, v_buf_ptr, req_to_token_ptr, req_pool_indices_ptr, seq_lens_ptr,
    part_o_ptr, part_lse_ptr,  # [B, Hq, S, D] and [B, Hq, S], fp32
    sm_scale_log2,
    stride_qb, stride_qh, stride_bs, stride_bh, stride_req,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + i)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    row = tl.load(req_pool_indices_ptr + i).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM

    q = tl.load(q_ptr + i * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        mask_n = cols < hi
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

    # An empty split (seq shorter than NUM_SPLITS * split_len) records lse = -inf and
    # is ignored by stage 2.
    nonempty = hi > lo
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf"))  # base-2 lse of scaled logits
    tl.store(part_o_ptr + i * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
             out, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(part_lse_ptr + i * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _decode_stage2_kernel(
    part_o_ptr, part_lse_ptr, o_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(part_lse_ptr + i * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    valid = lse > float("-inf")
    m = tl.max(lse, 0)
    w = tl.where(valid, tl.exp2(lse - m), 0.0)
    part = tl.load(part_o_ptr + i * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=valid[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + i * stride_ob + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=mask_d)


def choose_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 0,
                      max_splits: int = 16, min_tokens_per_split: int = 64) -> int:
    """Enough splits to give every SM a couple of programs, but no split under ~64 tokens."""
    by_len = max(1, triton.cdiv(max_seq_len, min_tokens_per_split))
    if num_sms > 0:
        by_occupancy = max(1, triton.cdiv(2 * num_sms, max(1, batch_size * num_kv_heads)))
        return max(1, min(max_splits, by_len, by_occupancy))
    return max(1, min(max_splits, by_len))


def decode_attention(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int,
    part_o: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    sm_scale: float | None = None,
) -> None:
    """Write into `o` [B, Hq, D] the attention of each request's one query over its sequence.

    `part_o` [B, Hq, >=num_splits, D] and `part_lse` [B, Hq, >=num_splits] (fp32) are
    scratch; pass them to reuse a per-step allocation.
    """
    batch_size, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    if batch_size == 0:
        return
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == 1 and o.stride(-1) == 1, "last dim of q/o must be contiguous"
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and req_to_token.is_contiguous()
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if part_o is None or part_lse is None:
        part_o = torch.empty(batch_size, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch_size, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    assert part_o.stride(-1) == 1 and part_lse.stride(-1) == 1
    group = num_q_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    interp = interpreting(_decode_stage1_kernel)
    block_n = 16 if interp else (64 if block_d <= 64 else 32)
    _decode_stage1_kernel[(batch_size, num_kv_heads, num_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, part_o, part_lse,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), req_to_token.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_H=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=block_d, UPCAST=interp,
    )
    _decode_stage2_kernel[(batch_size, num_q_heads)](
        part_o, part_lse, o,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d,
    )
