"""The host KV tier's memory: a second, larger KV store in RAM, and the copies between it
and the device pool (`KVPool`), run by the executor on every tensor-parallel rank.

Layout is page-major and compact: `buf[page]` is one contiguous block
`[num_layers, 2 (K, V), page_size, num_kv_heads, head_dim]`, so a page moves in one copy
and its bytes are exactly the blob the storage tier (L3) stores. Each rank holds its own
KV heads; host page numbers are handed out by rank 0 (sgl/runtime/memory/host_pages.py)
and are the same on every rank, like device slots.

Copies arrive as plain data in the step plan and run before the step's forward, in this
order: stores (device -> host), fills (bytes from storage -> host, rank 0), loads
(host -> device). A store may read a slot that the same plan's loads overwrite (it was
evicted and handed out again) and a load may read a page the same plan stored, so the
order matters; the forward then writes only fresh slots.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from sgl.runtime.memory.kv_pool import KVPool

Store = tuple[int, list[int]]  # (host page, device slots of its page_size tokens)
Load = tuple[int, int, list[int]]  # (host page, first token in the page, device slots)


class HostKVPool:
    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pin_memory: bool = False) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.buf = torch.zeros((num_pages, num_layers, 2, page_size, num_kv_heads, head_dim), dtype=dtype,
                               pin_memory=pin_memory)
        self.page_nbytes = self.buf[0].numel() * self.buf.element_size()
        self.use_native = True  # the C row copy where it applies (_native); False: torch's indexing

    @staticmethod
    def pages_for(num_bytes: float, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
        return int(num_bytes // (page_size * KVPool.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)))

    # -- copies -------------------------------------------------------------------------
    def store(self, pool: KVPool, stores: Sequence[Store]) -> None:
        """Device slots -> host pages, all layers of a page at once."""
        if not stores:
            return
        if self._native(pool):
            pages = [p for p, slots in stores for _ in slots]
            pos = [i for _, slots in stores for i in range(len(slots))]
            self._native_copy(pool, True, pages, pos, [s for _, slots in stores for s in slots])
            return
        dev = pool.k_buffers[0].device
        slots = torch.tensor([s for _, s in stores], dtype=torch.int64, device=dev)  # [n, page_size]
        pages = torch.tensor([p for p, _ in stores], dtype=torch.int64)
        staged = torch.stack([torch.stack((k[slots], v[slots])) for k, v in zip(pool.k_buffers, pool.v_buffers)])
        self.buf[pages] = staged.transpose(0, 2).transpose(1, 2).to("cpu", non_blocking=False)  # [n, L, 2, P, H, D]

    def load(self, pool: KVPool, loads: Sequence[Load]) -> None:
        """Host pages (or the tail of one, from a token offset) -> fresh device slots."""
        if not loads:
            return
        rows: list[int] = []
        pos: list[int] = []
        dst: list[int] = []
        for i, (_, first, slots) in enumerate(loads):
            rows.extend([i] * len(slots))
            pos.extend(range(first, first + len(slots)))
            dst.extend(slots)
        if self._native(pool):
            self._native_copy(pool, False, [loads[i][0] for i in rows], pos, dst)
            return
        dev = pool.k_buffers[0].device
        pages = torch.tensor([p for p, _, _ in loads], dtype=torch.int64)
        if dev.type == "cpu":  # same memory: gather straight from the host buffer, no staging copy
            data = self.buf
            r = pages[torch.tensor(rows, dtype=torch.int64)]
        else:  # one transfer of the whole pages, then gather on the device
            data = self.buf[pages].to(dev, non_blocking=True)  # [n, L, 2, P, H, D]
            r = torch.tensor(rows, dtype=torch.int64, device=dev)
        p = torch.tensor(pos, dtype=torch.int64, device=dev)
        d = torch.tensor(dst, dtype=torch.int64, device=dev)
        for layer, (k, v) in enumerate(zip(pool.k_buffers, pool.v_buffers)):
            k[d] = data[r, layer, 0, p]
            v[d] = data[r, layer, 1, p]

    def _native(self, pool: KVPool) -> bool:
        """Whether the C row copy (kernels/cpu/kv_copy.c) serves this pool: a CPU pool of
        contiguous tensors in the host tier's dtype and row shape, and a built library."""
        if not self.use_native or pool.k_buffers[0].device.type != "cpu" or pool.dtype != self.buf.dtype:
            return False
        if tuple(pool.k_buffers[0].shape[1:]) != tuple(self.buf.shape[4:]) or len(pool.k_buffers) != self.buf.shape[1]:
            return False
        if not all(t.is_contiguous() for t in (*pool.k_buffers, *pool.v_buffers)):
            return False
        from sgl.runtime.kernels.cpu.binding import kernels

        return kernels() is not None

    def _native_copy(self, pool: KVPool, to_host: bool, pages: list[int], pos: list[int], slots: list[int]) -> None:
        from sgl.runtime.kernels.cpu.binding import KVCopy, kernels

        idx = torch.tensor([pages, pos, slots], dtype=torch.int64)
        # The C side trusts its indices: a bad one must be an error here, not a stray write.
        lo, hi = idx.min(dim=1).values.tolist(), idx.max(dim=1).values.tolist()
        if min(lo) < 0 or hi[0] >= self.num_pages or hi[1] >= self.page_size or hi[2] >= pool.num_slots:
            raise IndexError(f"KV copy out of range: pages {lo[0]}..{hi[0]} of {self.num_pages}, "
                             f"positions {lo[1]}..{hi[1]} of {self.page_size}, slots {lo[2]}..{hi[2]} of "
                             f"{pool.num_slots}")
        k_ptrs = torch.tensor([t.data_ptr() for t in pool.k_buffers], dtype=torch.int64)
        v_ptrs = torch.tensor([t.data_ptr() for t in pool.v_buffers], dtype=torch.int64)
        row_bytes = pool.k_buffers[0][0].numel() * pool.k_buffers[0].element_size()
        ks = kernels()
        assert ks is not None
        ks.kv_copy(KVCopy(int(to_host), self.buf.data_ptr(), k_ptrs.data_ptr(), v_ptrs.data_ptr(), len(pool.k_buffers),
                          self.page_size, row_bytes, len(slots), idx[0].data_ptr(), idx[1].data_ptr(),
                          idx[2].data_ptr(), min(2, torch.get_num_threads())))

    def fill(self, page: int, blob: bytes | memoryview) -> None:
        """One page from its bytes (a storage hit), copied once."""
        src = np.frombuffer(blob, dtype=np.uint8)  # read-only views too, without a copy
        if src.nbytes != self.page_nbytes:
            raise ValueError(f"a host page holds {self.page_nbytes} bytes, got {src.nbytes}")
        ctypes.memmove(self.buf[page].data_ptr(), src.ctypes.data, src.nbytes)

    def read(self, page: int) -> bytes:
        """A copy of one page's bytes."""
        return self.view(page).tobytes()

    def view(self, page: int) -> memoryview:
        """One page's bytes in place (the storage tier frames them): valid until the page
        is written again."""
        return memoryview(self.buf[page].view(-1).view(torch.uint8).numpy())


def run_copies(host: HostKVPool | None, pool: KVPool, stores: Sequence[Store], loads: Sequence[Load],
               fills: Sequence[tuple[int, bytes]] = ()) -> None:
    """A plan's copies, in the order the module docstring explains."""
    if host is None:
        if stores or loads or fills:
            raise RuntimeError("a step carries KV tier copies but this rank has no host tier")
        return
    host.store(pool, stores)
    for page, blob in fills:
        host.fill(page, blob)
    host.load(pool, loads)
