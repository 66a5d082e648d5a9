"""Plain torch references for the Triton kernels: the ground truth their tests compare to.

Written for clarity, not speed: per request, gather the sequence's K/V from the pool
through req_to_token, then compute fp32 softmax attention with the causal offset of the
new tokens. Same arguments as the kernels, returning the result instead of writing it.
"""

from __future__ import annotations

import math

import torch


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor,
                 k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
    k_buf[loc] = k.to(k_buf.dtype)
    v_buf[loc] = v.to(v_buf.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, sm_scale: float) -> torch.Tensor:
    """q [E, Hq, D] over k/v [P+E, Hkv, D]; query j sees keys 0 .. P+j. Returns fp32 [E, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("ehd,shd->hes", q.float(), kf) * sm_scale
    e, s = q.shape[0], k.shape[0]
    visible = torch.arange(s)[None, :] <= (prefix_len + torch.arange(e))[:, None]
    scores = scores.masked_fill(~visible.to(scores.device)[None], float("-inf"))
    return torch.einsum("hes,shd->ehd", scores.softmax(-1), vf)


def extend_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor, sm_scale: float | None = None,
) -> torch.Tensor:
    """[T, Hq, D] fp32: prefix K/V from the pool, new K/V from `k`/`v` (the pool may be stale)."""
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i in range(req_pool_indices.shape[0]):
        p, e, s = int(prefix_lens[i]), int(extend_lens[i]), int(extend_start_loc[i])
        if e == 0:
            continue
        slots = req_to_token[int(req_pool_indices[i]), :p].long()
        keys = torch.cat([k_buf[slots], k[s:s + e].to(k_buf.dtype)])
        vals = torch.cat([v_buf[slots], v[s:s + e].to(v_buf.dtype)])
        out[s:s + e] = _attend(q[s:s + e], keys, vals, p, sm_scale)
    return out


def decode_attention_ref(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float | None = None,
) -> torch.Tensor:
    """[B, Hq, D] fp32: query b over the pool slots req_to_token[r_b, :seq_lens[b]]."""
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), :n].long()
        out[b:b + 1] = _attend(q[b:b + 1], k_buf[slots], v_buf[slots], n - 1, sm_scale)
    return out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, new residual): HF Llama RMSNorm, fp32 statistics, weight applied in x.dtype."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, residual


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] in fp32 (not in place)."""
    half = x.shape[-1] // 2
    c, s = cos[positions].float()[:, None], sin[positions].float()[:, None]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
