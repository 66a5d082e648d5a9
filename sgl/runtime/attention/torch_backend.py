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
prompt, forks, n>1), the shared part is attended once for all queries (cascade.py) and
only each request's own tokens go through the per-request path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl.runtime.attention import cascade
from sgl.runtime.attention.cascade import attend_lse, gather, common_prefix_len, merge, shared_prefix_part
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.memory.kv_pool import KVPool


class TorchAttentionBackend:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._decode_meta: tuple[torch.Tensor, torch.Tensor] | None = None
        # (start in T, extend_len, slots of the whole sequence, mask or None, is_causal)
        self._extend_meta: list[tuple[int, int, torch.Tensor, torch.Tensor | None, bool]] = []

    def init_forward(self, batch: ForwardBatch) -> None:
        """Precompute the slot indices and masks shared by every layer of this step."""
        self._decode_meta = None
        self._extend_meta = []
        self._shared: torch.Tensor | None = None
        self._cascade_meta: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self._cascade_decode: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cascade_padded: tuple[torch.Tensor, ...] | None = None
        max_len = max(batch.seq_lens_cpu, default=0)
        # Only the used columns: the table can be thousands of columns wide.
        rows = batch.req_to_token[batch.req_pool_indices, :max_len].long()  # [B, max_len]
        shared = common_prefix_len(rows, min(batch.prefix_lens_cpu, default=0))
        if shared >= cascade.MIN_SHARED:
            self._init_cascade(batch, rows, shared)
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

    def _init_cascade(self, batch: ForwardBatch, rows: torch.Tensor, shared: int) -> None:
        """Per request: (start in T, extend_len, own slots after the shared prefix, mask)."""
        self._shared = rows[0, :shared]
        if batch.is_decode:  # one query each: pad the own parts and do all requests at once
            own_lens = batch.seq_lens[:, None] - shared
            own = rows[:, shared:]
            valid = torch.arange(own.shape[1], device=rows.device)[None, :] < own_lens
            self._cascade_decode = (torch.where(valid, own, torch.zeros_like(own)), valid[:, None, None, :])
            return
        if self._init_cascade_padded(batch, rows, shared):
            return
        start = 0
        for i, (p, e) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
            own = rows[i, shared : p + e]
            n_own_cached = p - shared
            # query j sees own keys < n_own_cached + j + 1 (its cached tail, then causal)
            q_pos = torch.arange(e, device=rows.device)[:, None] + n_own_cached
            mask = torch.arange(own.shape[0], device=rows.device)[None, :] <= q_pos  # [e, own]
            self._cascade_meta.append((start, e, own, mask))
            start += e

    def _init_cascade_padded(self, batch: ForwardBatch, rows: torch.Tensor, shared: int) -> bool:
        """All requests' own parts in one padded batch, when padding wastes little
        (similar extend lengths); saves a Python loop of B x layers small attentions."""
        ext, pre = batch.extend_lens_cpu, batch.prefix_lens_cpu
        own_lens = [p + e - shared for p, e in zip(pre, ext)]
        e_max, l_max = max(ext), max(own_lens)
        if len(ext) * e_max * l_max > 4 * sum(e * n for e, n in zip(ext, own_lens)):
            return False
        dev = rows.device
        j = torch.arange(e_max, device=dev)
        starts = batch.extend_start_loc[:, None]
        e_t = batch.extend_lens[:, None]
        q_valid = j[None, :] < e_t  # [B, E]
        q_index = torch.where(q_valid, starts + j[None, :], torch.zeros((), dtype=torch.long, device=dev))
        c = torch.arange(l_max, device=dev)
        own_len_t = torch.tensor(own_lens, device=dev)[:, None]
        own = rows[:, shared : shared + l_max]
        own = torch.where(c[None, :] < own_len_t, own, torch.zeros_like(own))
        n_cached = (batch.prefix_lens - shared)[:, None, None]
        # query j of request i sees own keys c <= n_cached_i + j (its cached tail, then causal)
        mask = (c[None, None, :] <= n_cached + j[None, :, None]) & q_valid[:, :, None]
        self._cascade_padded = (q_index, q_valid, own, mask[:, None, None])  # mask [B, 1, 1, E, L]
        return True

    def _cascade(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
        t, h, d = q.shape
        kv = k_buf.shape[1]
        g = h // kv
        scale = d ** -0.5
        assert self._shared is not None
        qg = q.view(t, kv, g, d)
        o_p, lse_p = shared_prefix_part(qg, k_buf, v_buf, self._shared, scale)  # [T, KV, G, D], [T, KV, G]
        if self._cascade_decode is not None:
            own, mask = self._cascade_decode  # [B, L], [B, 1, 1, L]
            ko = gather(k_buf, own).permute(0, 2, 1, 3)  # [B, KV, L, D]
            vo = gather(v_buf, own).permute(0, 2, 1, 3)
            o_s, lse_s = attend_lse(qg, ko, vo, scale, mask)  # [B, KV, G, D], [B, KV, G]
            return merge(o_p, lse_p, o_s, lse_s).reshape(t, h, d).to(q.dtype)
        if self._cascade_padded is not None:
            q_index, q_valid, own, mask = self._cascade_padded
            qi = qg[q_index].permute(0, 2, 3, 1, 4)  # [B, KV, G, E, D]
            ko = gather(k_buf, own).permute(0, 2, 1, 3).unsqueeze(2)  # [B, KV, 1, L, D]
            vo = gather(v_buf, own).permute(0, 2, 1, 3).unsqueeze(2)
            o_s, lse_s = attend_lse(qi, ko, vo, scale, mask)  # [B, KV, G, E, D], [B, KV, G, E]
            o_s = o_s.permute(0, 3, 1, 2, 4)[q_valid]  # [T, KV, G, D] in T order
            lse_s = lse_s.permute(0, 3, 1, 2)[q_valid]
            return merge(o_p, lse_p, o_s, lse_s).reshape(t, h, d).to(q.dtype)
        out = torch.empty((t, kv, g, d), dtype=torch.float32, device=q.device)
        for start, e, own, mask in self._cascade_meta:
            qi = qg[start : start + e].permute(1, 2, 0, 3)  # [KV, G, e, D]
            ki = gather(k_buf, own).permute(1, 0, 2).unsqueeze(1)  # [KV, 1, own, D]
            vi = gather(v_buf, own).permute(1, 0, 2).unsqueeze(1)
            o_s, lse_s = attend_lse(qi, ki, vi, scale, mask)  # [KV, G, e, D], [KV, G, e]
            out[start : start + e] = merge(o_p[start : start + e], lse_p[start : start + e],
                                           o_s.permute(2, 0, 1, 3), lse_s.permute(2, 0, 1))
        return out.view(t, h, d).to(q.dtype)

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
        if self._shared is not None:
            return self._cascade(q, k_buf, v_buf)
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
