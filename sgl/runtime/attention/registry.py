"""Pick an attention backend by name, importing only the one chosen.

"auto" (or None) means "triton" when the pool lives on a CUDA device and "cpu" otherwise,
so the CPU path never imports Triton. "cpu" is the C attention kernel where it serves the
pool (bf16, head_dim 64/128, AVX512-BF16, a C compiler) and the torch backend elsewhere
(with a warning only when "cpu" was asked for by name). Naming "triton" without a GPU is
allowed only under TRITON_INTERPRET=1 (the kernels' CPU correctness mode).
"""

from __future__ import annotations

import logging

import torch

from sgl.runtime.attention.base import AttentionBackend
from sgl.runtime.config import settings
from sgl.runtime.memory.kv_pool import KVPool

log = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "cpu", "torch", "triton")


def resolve_backend_name(name: str | None, device: torch.device | str | None = None) -> str:
    """'cpu', 'torch' or 'triton' for a requested name ('auto'/None decides by the device)."""
    if name is None or name == "auto":
        if device is None:
            return "triton" if torch.cuda.is_available() else "cpu"
        return "triton" if torch.device(device).type == "cuda" else "cpu"
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    return name


def create_attention_backend(
    name: str | None, pool: KVPool, device: torch.device | str | None = None
) -> AttentionBackend:
    """Build the backend for `pool`; `device` defaults to where the pool's buffers live."""
    if device is None and pool.k_buffers:
        device = pool.k_buffers[0].device
    resolved = resolve_backend_name(name, device)
    if resolved == "cpu":
        from sgl.runtime.attention import cpu_backend

        if cpu_backend.kernel_supported(pool):
            return cpu_backend.CpuAttentionBackend(pool)
        if name == "cpu":
            log.warning("the C attention kernel does not serve this pool (needs bf16, head_dim 64/128, "
                        "AVX512-BF16 and a C compiler): using the torch backend")
        resolved = "torch"
    if resolved == "torch":
        from sgl.runtime.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(pool)
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if not on_cuda and not settings().triton_interpret:
        raise ValueError(
            "the triton attention backend needs the KV pool on a CUDA GPU; use 'cpu' or 'torch' on the CPU "
            "(or set TRITON_INTERPRET=1 to run the kernels in Triton's slow CPU interpreter)"
        )
    from sgl.runtime.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(pool)
