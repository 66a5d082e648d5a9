"""Triton attention backend: the GPU path, reading and writing the token KV pool in place.

Per step `init_forward` takes the host-side lengths (no device sync) and picks the
decode split count; per layer `forward` scatters the new K/V into the pool
(`store_kv`), then runs the split-KV decode kernel for a pure decode batch and the
extend kernel for anything else (prefill, prefix-hit extend, or mixed). The decode
scratch (partial outputs and log-sum-exps) is allocated once per step and shared by
every layer. On the CPU it runs only under TRITON_INTERPRET=1, for correctness tests.
"""

from __future__ import annotations

import torch

from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.kernels.decode_attention import choose_num_splits, decode_attention
from sgl.runtime.kernels.extend_attention import extend_attention
from sgl.runtime.kernels.store_kv import store_kv
from sgl.runtime.memory.kv_pool import KVPool


class TritonAttentionBackend:
    def __init__(self, pool: KVPool, max_splits: int = 16) -> None:
        self.pool = pool
        self.max_splits = max_splits
        device = pool.k_buffers[0].device if pool.k_buffers else torch.device("cpu")
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        )
        self._is_decode = False
        self._max_extend_len = 0
        self._num_splits = 1
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def init_forward(self, batch: ForwardBatch) -> None:
        """Per-step metadata from the host copies of the lengths; drops last step's scratch."""
        self._is_decode = batch.is_decode
        self._max_extend_len = max(batch.extend_lens_cpu, default=0)
        self._num_splits = 1
        self._scratch = None
        if self._is_decode:
            self._num_splits = choose_num_splits(
                batch.batch_size, self.pool.num_kv_heads, max(batch.seq_lens_cpu, default=1),
                num_sms=self.num_sms, max_splits=self.max_splits,
            )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        pool = self.pool
        k_buf, v_buf = pool.k_buffers[layer_id], pool.v_buffers[layer_id]
        # One dtype inside the kernels: tl.dot wants matching operand types.
        q, k, v = q.to(pool.dtype), k.to(pool.dtype), v.to(pool.dtype)
        store_kv(k, v, batch.out_cache_loc, k_buf, v_buf)
        out = torch.empty(q.shape, dtype=pool.dtype, device=q.device)
        if self._is_decode:
            decode_attention(
                q, out, k_buf, v_buf, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                self._num_splits, *self._decode_scratch(q),
            )
        else:
            extend_attention(
                q, k, v, out, k_buf, v_buf, batch.req_to_token, batch.req_pool_indices,
                batch.prefix_lens, batch.extend_lens, batch.extend_start_loc, self._max_extend_len,
            )
        return out

    def _decode_scratch(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, d = q.shape
        if self._scratch is None or self._scratch[0].shape != (b, h, self._num_splits, d):
            self._scratch = (
                torch.empty(b, h, self._num_splits, d, dtype=torch.float32, device=q.device),
                torch.empty(b, h, self._num_splits, dtype=torch.float32, device=q.device),
            )
        return self._scratch
