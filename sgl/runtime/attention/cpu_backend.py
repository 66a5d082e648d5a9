"""CPU attention backend: the torch backend with attention itself in C (kernels/cpu/attention.c,
bound in kernels/cpu/binding.py).

Per layer the new K/V go into the pool as in the torch backend; then one C call attends
every query of the step over the pool in place: prefill, extend after a cached prefix,
decode rows and mixes alike, with the slots shared by all requests (few-shot prompts,
forks) packed once per layer. It replaces a per-request gather + SDPA loop (prefill) and
the cascade matmuls (shared prefixes), which spend most of their time copying K/V and
materializing scores. The kernel needs bf16, head_dim 64 or 128 and AVX512-BF16; other
cases (and `SGL_DISABLE_CPU_ATTENTION=1`) keep the torch backend's code.
"""

from __future__ import annotations

import torch

from sgl.runtime.attention.cascade import common_prefix_len
from sgl.runtime.attention.torch_backend import TorchAttentionBackend
from sgl.runtime.config import settings
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.kernels.cpu import binding
from sgl.runtime.kernels.cpu.binding import AttnParams, Kernels, Status
from sgl.runtime.memory.kv_pool import KVPool

# A shared prefix shorter than one softmax step of the kernel is not worth a segment.
MIN_SHARED = 32


def _library() -> Kernels | None:
    """The bound kernel library where its attention has SIMD (AVX512-BF16) code, or None."""
    kernels = binding.kernels()
    return kernels if kernels is not None and kernels.attn_simd() else None


def kernel_supported(pool: KVPool) -> bool:
    """Whether the C kernel can serve this pool on this machine."""
    if settings().disable_cpu_attention:
        return False
    if pool.dtype != torch.bfloat16 or pool.head_dim not in (64, 128) or not pool.k_buffers:
        return False
    return pool.k_buffers[0].device.type == "cpu" and _library() is not None


class CpuAttentionBackend(TorchAttentionBackend):
    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        self.lib = _library() if kernel_supported(pool) else None
        self._ws = torch.empty(0, dtype=torch.uint8)
        self._args: tuple | None = None  # the step's parameters and the tensors they point into

    def init_forward(self, batch: ForwardBatch) -> None:
        if self.lib is None:
            super().init_forward(batch)
            return
        self._args = None
        nreq = len(batch.seq_lens_cpu)
        max_len = max(batch.seq_lens_cpu, default=0)
        rows = batch.req_to_token[batch.req_pool_indices, :max_len].long().contiguous()
        shared = common_prefix_len(rows, min(batch.prefix_lens_cpu, default=0))
        if shared < MIN_SHARED:
            shared = 0
        pre = torch.tensor(batch.prefix_lens_cpu, dtype=torch.int32)
        ext = torch.tensor(batch.extend_lens_cpu, dtype=torch.int32)
        qst = torch.zeros(nreq, dtype=torch.int32)
        if nreq > 1:
            qst[1:] = torch.cumsum(ext[:-1], 0)
        pool = self.pool
        d = pool.head_dim
        params = AttnParams(rows=rows.data_ptr(), row_stride=rows.stride(0), nreq=nreq, q_start=qst.data_ptr(),
                            prefix=pre.data_ptr(), extend=ext.data_ptr(), shared=shared, nkv=pool.num_kv_heads,
                            d=d, scale=d ** -0.5, threads=2 if torch.get_num_threads() >= 2 else 1)
        need = self.lib.attn_ws_bytes(params)
        if self._ws.numel() < need:
            self._ws = torch.empty(int(need * 1.25) + 4096, dtype=torch.uint8)
        params.ws = self._ws.data_ptr()
        self._args = (params, rows, qst, pre, ext)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        if self._args is None:
            return super().forward(q, k, v, layer_id, batch)
        pool = self.pool
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        params = self._args[0]
        t, h, d = q.shape
        q = q.to(torch.bfloat16)
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        out = torch.empty((t, h, d), dtype=torch.bfloat16)
        params.q, params.q_stride, params.out, params.nh = q.data_ptr(), q.stride(0), out.data_ptr(), h
        params.k_pool, params.v_pool = pool.k_buffers[layer_id].data_ptr(), pool.v_buffers[layer_id].data_ptr()
        rc = self.lib.attn_forward(params)
        if rc != Status.OK:
            raise RuntimeError(f"CPU attention kernel failed ({rc.message}); set SGL_DISABLE_CPU_ATTENTION=1 "
                               "to use torch")
        return out
