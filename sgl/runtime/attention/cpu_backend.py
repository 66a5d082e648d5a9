"""CPU attention backend: the torch backend with attention itself in C (kernels/cpu/attention.c).

Per layer the new K/V go into the pool as in the torch backend; then one C call attends
every query of the step over the pool in place: prefill, extend after a cached prefix,
decode rows and mixes alike, with the slots shared by all requests (few-shot prompts,
forks) packed once per layer. It replaces a per-request gather + SDPA loop (prefill) and
the cascade matmuls (shared prefixes), which spend most of their time copying K/V and
materializing scores. The kernel needs bf16, head_dim 64 or 128 and AVX512-BF16; other
cases (and `SGL_DISABLE_CPU_ATTENTION=1`) keep the torch backend's code.
"""

from __future__ import annotations

import ctypes

import torch

from sgl.runtime.attention.cascade import common_prefix_len
from sgl.runtime.attention.torch_backend import TorchAttentionBackend
from sgl.runtime.config import settings
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.kernels import cpu as cpu_kernels
from sgl.runtime.memory.kv_pool import KVPool

# A shared prefix shorter than one softmax step of the kernel is not worth a segment.
MIN_SHARED = 32


def _library() -> ctypes.CDLL | None:
    lib = cpu_kernels.load()
    if lib is None or not hasattr(lib, "sgl_attn_forward"):
        return None
    p, i, f, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
    lib.sgl_attn_forward.restype = i
    lib.sgl_attn_forward.argtypes = [p, i64, p, p, p, p, i64, i, p, p, p, i, i, i, i, f, p, i]
    lib.sgl_attn_ws_bytes.restype = i64
    lib.sgl_attn_ws_bytes.argtypes = [i, p, p, i, i, i]
    lib.sgl_attn_simd.restype = i
    return lib if lib.sgl_attn_simd() else None


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
        self._args: tuple | None = None  # the step's ctypes arguments (kept alive with their tensors)

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
        need = self.lib.sgl_attn_ws_bytes(nreq, pre.data_ptr(), ext.data_ptr(), shared, pool.num_kv_heads,
                                          pool.head_dim)
        if self._ws.numel() < need:
            self._ws = torch.empty(int(need * 1.25) + 4096, dtype=torch.uint8)
        threads = 2 if torch.get_num_threads() >= 2 else 1
        self._args = (rows, qst, pre, ext, nreq, shared, threads)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        if self._args is None:
            return super().forward(q, k, v, layer_id, batch)
        pool = self.pool
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        rows, qst, pre, ext, nreq, shared, threads = self._args
        t, h, d = q.shape
        q = q.to(torch.bfloat16)
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        out = torch.empty((t, h, d), dtype=torch.bfloat16)
        rc = self.lib.sgl_attn_forward(
            q.data_ptr(), q.stride(0), out.data_ptr(), pool.k_buffers[layer_id].data_ptr(),
            pool.v_buffers[layer_id].data_ptr(), rows.data_ptr(), rows.stride(0), nreq, qst.data_ptr(),
            pre.data_ptr(), ext.data_ptr(), shared, h, pool.num_kv_heads, d, d ** -0.5, self._ws.data_ptr(), threads)
        if rc != 0:
            raise RuntimeError(f"CPU attention kernel failed (code {rc}); set SGL_DISABLE_CPU_ATTENTION=1 to use torch")
        return out
