"""Torch attention backend: the CPU path and the reference the Triton kernels are tested
against.

Per layer it writes the new tokens' K/V into the pool, then gathers each request's
whole sequence back out of the pool through `req_to_token`. A pure decode batch (one new
token per request) runs as one padded, masked SDPA call over all requests, with the
query heads grouped under their KV head (GQA without copying K/V). Anything with a
multi-token extend runs request by request; for request i the mask is

    keys:    0 ........ prefix_lens[i] ........ seq_lens[i]
    query j: [ all visible (cached) ][ new keys <= j visible ]

When every request of the step starts with the same cached slots (a shared few-shot
prompt, forks, n>1), cascade.py runs the whole step instead: the shared part's K/V is
gathered once per layer and scored for all queries together, with each request's own
keys beside it in the same softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl.runtime.attention import cascade
from sgl.runtime.attention.cascade import CascadePlan, cascade_attention, common_prefix_len, gather, plan_cascade
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.memory.kv_pool import KVPool


class TorchAttentionBackend:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._decode_meta: tuple[torch.Tensor, torch.Tensor] | None = None
        # (start in T, extend_len, slots of the whole sequence, mask or None, is_causal)
        self._extend_meta: list[tuple[int, int, torch.Tensor, torch.Tensor | None, bool]] = []
        self._cascade: CascadePlan | None = None

    @property
    def _shared(self) -> torch.Tensor | None:
        """Slots of the shared prefix when this step runs cascade attention (tests read it)."""
        return None if self._cascade is None else self._cascade.shared

    def init_forward(self, batch: ForwardBatch) -> None:
        """Precompute the slot indices and masks shared by every layer of this step."""
        self._decode_meta = None
        self._extend_meta = []
        self._cascade = None
        max_len = max(batch.seq_lens_cpu, default=0)
        # Only the used columns: the table can be thousands of columns wide.
        rows = batch.req_to_token[batch.req_pool_indices, :max_len].long()  # [B, max_len]
        shared = common_prefix_len(rows, min(batch.prefix_lens_cpu, default=0))
        if shared >= cascade.MIN_SHARED:
            self._cascade = plan_cascade(rows, shared, batch.prefix_lens_cpu, batch.extend_lens_cpu,
                                         self.pool.num_kv_heads)
            return
        if batch.is_decode:
            valid = torch.arange(max_len, device=rows.device)[None, :] < batch.seq_lens[:, None]
            # Padding lanes read slot 0 (scratch) and are masked out.
            slots = torch.where(valid, rows, torch.zeros((), dtype=torch.long, device=rows.device))
            self._decode_meta = (slots, valid[:, None, None, :])  # mask [B, 1, 1, L]
            return
        start = 0
        for i, (p, e) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
            slots = rows[i, : p + e]
            mask = None
            # e == 1 sees everything; no prefix is plain causal (SDPA's fast path);
            # otherwise causal shifted right by the prefix, which is_causal cannot express.
            if e > 1 and p > 0:
                q_pos = torch.arange(p, p + e, device=rows.device)[:, None]
                mask = torch.arange(p + e, device=rows.device)[None, :] <= q_pos
            self._extend_meta.append((start, e, slots, mask, e > 1 and p == 0))
            start += e

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        pool = self.pool
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.k_buffers[layer_id], pool.v_buffers[layer_id]
        q = q.to(pool.dtype)
        if self._cascade is not None:
            return cascade_attention(q, k_buf, v_buf, self._cascade, q.shape[-1] ** -0.5)
        if self._decode_meta is not None:
            return self._decode(q, k_buf, v_buf, *self._decode_meta)
        out = torch.empty_like(q)
        for start, e, slots, mask, causal in self._extend_meta:
            qi = q[start : start + e].transpose(0, 1)  # [H, e, D]
            ki = gather(k_buf, slots).transpose(0, 1)  # [KV, S, D]
            vi = gather(v_buf, slots).transpose(0, 1)
            # 4-D inputs with K/V repeated per query head take the CPU flash kernel; 3-D or
            # enable_gqa fall back to the math path, ~5x slower on a 1k-token prefill.
            group = qi.shape[0] // ki.shape[0]
            ki, vi = ki.repeat_interleave(group, 0), vi.repeat_interleave(group, 0)
            oi = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask, is_causal=causal)[0]
            out[start : start + e] = oi.transpose(0, 1)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        b, h, d = q.shape
        kv = k_buf.shape[1]
        # One query per request: view its heads as [KV, group] so each group shares a K/V row.
        qg = q.view(b, kv, h // kv, d)
        k = gather(k_buf, slots).permute(0, 2, 1, 3)  # [B, KV, L, D]
        v = gather(v_buf, slots).permute(0, 2, 1, 3)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
        return o.reshape(b, h, d)
