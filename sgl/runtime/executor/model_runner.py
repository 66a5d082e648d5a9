"""Model runner: one ForwardBatch through the model with the attention backend."""

from __future__ import annotations

import torch

from sgl.runtime.attention.base import AttentionBackend
from sgl.runtime.executor.forward_batch import ForwardBatch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn: AttentionBackend) -> None:
        self.model = model
        self.attn = attn

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.attn)  # the model calls attn.init_forward
