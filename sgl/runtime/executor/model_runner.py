"""Model runner: one ForwardBatch through the model with the attention backend.

It owns the choice of how a step runs, so the model's forward is only the model: a small
bf16 decode batch on the CPU goes through the C decode step (kernels/cpu/decode.py),
everything else through `model.forward`. The CPU thread count is not touched here: the
worker sets it once, before its first step (oneDNN sizes a primitive's per-thread
scratch when it creates the primitive and caches it; changing torch's thread count
between steps on the scheduler thread could run a cached primitive with more threads
than it was built for, one of the suspects of issue #19).
"""

from __future__ import annotations

from typing import Any

import torch

from sgl.runtime.attention.base import AttentionBackend
from sgl.runtime.attention.torch_backend import TorchAttentionBackend
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.kernels.cpu.decode import MAX_ROWS, CpuDecoder


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, use_cpu_decode_kernel: bool = True,
                 cpu_decode_threads: int | None = None, cpu_decode_max_rows: int = MAX_ROWS,
                 paths: Any = None) -> None:
        self.model = model
        self.attn = attn
        # The C step reads the pool in the torch backend's layout (the cpu backend's too).
        use = use_cpu_decode_kernel and isinstance(attn, TorchAttentionBackend)
        self.cpu_decoder = CpuDecoder.create(model, cpu_decode_threads, cpu_decode_max_rows) if use else None
        if self.cpu_decoder is not None:
            self.cpu_decoder.split = bool(paths is not None and paths.decode_split)
        self.paths = paths  # tuning/choice.PathChoice this runner was built from (server info), or None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits `[len(batch.logits_indices), vocab]`."""
        pool = getattr(self.attn, "pool", None)
        if self.cpu_decoder is not None and self.cpu_decoder.supports(batch, pool):
            return self.cpu_decoder.forward(batch, pool)
        return self.model.forward(batch, self.attn)  # the model calls attn.init_forward
