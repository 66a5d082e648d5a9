"""Cascade attention for batches that share a cached prefix (few-shot prompts, forks,
n>1, select): attend every query to the shared prefix ONCE, as one dense matmul over
its K/V, then to each request's own tokens, and merge the two partial softmaxes by
their log-sum-exp.

    keys of request i:  [ shared prefix: slots identical for all i | own tokens ]
                          0 ............ shared_len ................ seq_lens[i]

Without this, a padded gather copies the shared K/V once per request per layer, which
is what makes wide decode batches over long prompts memory-bound on the CPU.
"""

from __future__ import annotations

import torch

# Below this many shared tokens the plain path is as fast.
MIN_SHARED = 64


def common_prefix_len(rows: torch.Tensor, limit: int) -> int:
    """Longest column prefix on which every row of `rows` [B, L] equals row 0, capped at `limit`."""
    if rows.shape[0] < 2 or limit <= 0:
        return 0
    cols = rows[:, :limit]
    same = (cols == cols[0:1]).all(dim=0)
    if bool(same.all()):
        return int(cols.shape[1])
    return int(torch.argmin(same.to(torch.int8)).item())


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., M, D], k/v [..., S, D] (broadcastable batch dims), mask [..., M, S] bool.
    Returns float32 (out [..., M, D], lse [..., M]); fully masked rows get lse=-inf, out=0."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(-1e30))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.matmul(probs.to(v.dtype), v).float()
    return out, lse


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Combine two partial attentions over disjoint key sets (float32 in, float32 out)."""
    m = torch.maximum(lse1, lse2)
    w1 = torch.exp(lse1 - m).nan_to_num(0.0).unsqueeze(-1)
    w2 = torch.exp(lse2 - m).nan_to_num(0.0).unsqueeze(-1)
    return (o1 * w1 + o2 * w2) / (w1 + w2)


def gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf[slots] for a pool buffer [N, KV, D]; index_select is 4-7x faster than
    advanced indexing on the CPU."""
    return buf.index_select(0, slots.reshape(-1)).view(*slots.shape, *buf.shape[1:])


def shared_prefix_part(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, shared_slots: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, KV, G, D] against the shared prefix (all visible). Returns ([T, KV, G, D], [T, KV, G])."""
    t, kv, g, d = q.shape
    kp = gather(k_buf, shared_slots).transpose(0, 1)  # [KV, S, D]
    vp = gather(v_buf, shared_slots).transpose(0, 1)
    qk = q.permute(1, 0, 2, 3).reshape(kv, t * g, d)  # every query of a KV group in one matmul
    o, lse = attend_lse(qk, kp, vp, scale)
    return o.view(kv, t, g, d).permute(1, 0, 2, 3), lse.view(kv, t, g).permute(1, 0, 2)
