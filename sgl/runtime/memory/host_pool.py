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

from collections.abc import Sequence

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

    @staticmethod
    def pages_for(num_bytes: float, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
        return int(num_bytes // (page_size * KVPool.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)))

    # -- copies -------------------------------------------------------------------------
    def store(self, pool: KVPool, stores: Sequence[Store]) -> None:
        """Device slots -> host pages, all layers of a page at once."""
        if not stores:
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
        dev = pool.k_buffers[0].device
        pages = torch.tensor([p for p, _, _ in loads], dtype=torch.int64)
        rows: list[int] = []
        pos: list[int] = []
        dst: list[int] = []
        for i, (_, first, slots) in enumerate(loads):
            rows.extend([i] * len(slots))
            pos.extend(range(first, first + len(slots)))
            dst.extend(slots)
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

    def fill(self, page: int, blob: bytes) -> None:
        """One page from its bytes (a storage hit); the size is checked by the caller's codec."""
        src = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        self.buf[page].view(-1).view(torch.uint8).copy_(src)

    def read(self, page: int) -> bytes:
        """One page's bytes (for the storage tier)."""
        return self.buf[page].contiguous().view(-1).view(torch.uint8).numpy().tobytes()


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
