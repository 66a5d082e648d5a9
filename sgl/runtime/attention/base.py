"""The attention-backend seam: how a model layer reads and writes the token KV pool.

A backend owns no weights. Per step the model runner calls `init_forward(batch)` once
(backends precompute index metadata there), then each layer calls `forward`, which must:
  1. write the new tokens' k/v into the pool at `batch.out_cache_loc`, and
  2. return attention of each new query token over its request's whole sequence
     (slots `req_to_token[req_pool_indices[i], :seq_lens[i]]`), causal within the
     new tokens and full over the cached prefix.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sgl.runtime.executor.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    def init_forward(self, batch: ForwardBatch) -> None:
        """Prepare per-step metadata (called once per model step, before layer 0)."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, num_q_heads, head_dim]
        """Store k/v for the new tokens, then attend (softmax scale 1/sqrt(head_dim))."""
