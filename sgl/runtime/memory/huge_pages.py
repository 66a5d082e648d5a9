"""Zeroed CPU tensors on transparent huge pages (2 MB) where Linux offers them: the KV
pool (kv_pool.py) and the GGUF weight blocks the C decode step streams (gguf_blocks.py).

The decode step reads each cached token's K and V rows through the slot table: after a
while of serving, a request's slots are scattered over the pool, so with 4 KB pages
nearly every row read is a TLB miss and a page walk (a 65,536-slot pool of SmolLM2-135M
is 1.5 GB). On 2 MB pages the C step at 1,500 scattered tokens of context in such a pool
was 1.04-1.22x faster (1-8 rows; AMD EPYC Zen 4; `bench_decode_step.py --pages
small,huge`, README "Huge pages"); with slots in order it is the same. A one-row step,
bound by streaming ~92 MB of Q4_1 weights, was ~5% faster with the weights on huge pages.

The memory is an anonymous mapping advised MADV_HUGEPAGE before it is touched, so this
works with THP mode `madvise` (many distributions' default) and needs no privileges or
reserved pages. It is then zeroed (touched) at once, as torch.zeros would: a server's
memory use and first steps look the same as before. Where there is no MADV_HUGEPAGE
(not Linux) or the mapping fails, the tensor is an ordinary torch.zeros; where THP is
off, the advice does nothing and the pages stay 4 KB. Either way the values are the same.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor of `shape`, on huge pages where the OS gives them."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if _ADVICE is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    try:
        # one huge page of slack: the mapping starts 4 KB-aligned, the tensor at the next 2 MB boundary
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(_ADVICE)
    except (OSError, ValueError):
        return torch.zeros(shape, dtype=dtype)
    offset = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    # frombuffer holds a reference to `region`: the mapping lives as long as any view of `out`
    out = torch.frombuffer(region, dtype=dtype, count=count, offset=offset).view(shape)
    out.zero_()  # fault the pages in now (the mapping reads as zeros already)
    return out


def views(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Zeroed contiguous tensors of the given (shape, dtype)s, views into one block from
    `zeros`, each at a 64-byte boundary: the caller copies weights that every decode step
    streams into them, one at a time, so each source can be freed as soon as it is copied."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offsets: list[int] = []
    end = 0
    for n in sizes:
        offsets.append(end)
        end += (n + 63) // 64 * 64
    block = zeros((max(end, 1),), torch.uint8)
    return [block[off:off + n].view(dtype).view(shape) for (shape, dtype), off, n in zip(specs, offsets, sizes)]


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ('always', 'madvise', 'never'), or None where
    it cannot be read (not Linux)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes on huge pages in the mappings that hold `t`'s memory (/proc/self/smaps; 0 where
    unknown). For a view into a block from `zeros`, that is the whole block's."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    total, inside = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < hi and end > lo
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
