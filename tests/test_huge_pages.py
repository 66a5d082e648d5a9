"""The KV pool on huge pages (sgl/runtime/memory/huge_pages.py): same values and layout as
before, on 2 MB pages where the kernel's THP mode allows it, released with the pool."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from sgl.runtime.memory import huge_pages
from sgl.runtime.memory.kv_pool import KVPool

MAPS = Path("/proc/self/maps")


def _mapped(addr: int) -> bool:
    """Whether any mapping of this process holds `addr`."""
    for line in MAPS.read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= addr < hi:
            return True
    return False


def test_zeros_is_a_zeroed_aligned_writable_tensor():
    t = huge_pages.zeros((3, 1 << 20), torch.bfloat16)  # 6 MB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    if huge_pages._ADVICE is not None:
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t[1, 5] = 2.5
    assert float(t.sum()) == 2.5
    small = huge_pages.zeros((4, 4), torch.float32)  # under one huge page: an ordinary tensor
    assert small.shape == (4, 4) and not small.any()


@pytest.mark.skipif(huge_pages.thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off on this host")
def test_a_pool_lands_on_huge_pages_where_thp_is_on():
    pool = KVPool(65536, 4, 3, 64, torch.bfloat16)  # 192 MB
    assert huge_pages.huge_bytes(pool.k_buffers[0]) >= huge_pages.HUGE_PAGE
    # the escape hatch the benchmark's A/B uses: ordinary 4 KB pages (THP 'madvise' leaves them
    # so, unless torch's own allocator is told to advise them too)
    if huge_pages.thp_mode() == "madvise" and not os.environ.get("THP_MEM_ALLOC_ENABLE"):
        plain = KVPool(65536, 4, 3, 64, torch.bfloat16, huge_pages=False)
        assert huge_pages.huge_bytes(plain.k_buffers[0]) == 0


def test_pool_layers_are_separate_views_of_one_block():
    pool = KVPool(9000, 5, 3, 64, torch.bfloat16)
    bufs = pool.k_buffers + pool.v_buffers
    assert all(b.shape == (9000, 3, 64) and b.is_contiguous() and not b.any() for b in bufs)
    ptrs = sorted(b.data_ptr() for b in bufs)
    nbytes = bufs[0].numel() * bufs[0].element_size()
    assert all(hi - lo >= nbytes for lo, hi in zip(ptrs, ptrs[1:]))  # no two layers overlap
    loc = torch.tensor([1, 4000, 8999])
    k = torch.randn(3, 3, 64).to(torch.bfloat16)
    pool.set_kv(2, loc, k, -k)
    assert torch.equal(pool.k_buffers[2][loc], k) and torch.equal(pool.v_buffers[2][loc], -k)
    assert sum(int(b.count_nonzero()) for b in bufs) == 2 * int(k.count_nonzero())  # nothing else changed


def test_views_copy_each_spec_into_one_block_without_overlap():
    sources = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.empty(0, 4),
               torch.randint(0, 255, (100, 33), dtype=torch.uint8), torch.randn(6, 4).to(torch.bfloat16).t()]
    views = huge_pages.views([(tuple(t.shape), t.dtype) for t in sources])
    for v, t in zip(views, sources):
        assert v.shape == t.shape and v.dtype == t.dtype and v.is_contiguous() and not v.any()
        assert v.data_ptr() % 64 == 0
        v.copy_(t)
    assert all(torch.equal(v, t) for v, t in zip(views, sources))
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views if v.numel())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1


@pytest.mark.skipif(not MAPS.exists(), reason="no /proc/self/maps on this OS")
def test_a_layer_outlives_its_pool_object():
    k = KVPool(65536, 2, 3, 64, torch.bfloat16).k_buffers[1]
    gc.collect()
    assert _mapped(k.data_ptr())
    k.fill_(1)
    assert bool((k == 1).all())


@pytest.mark.skipif(not MAPS.exists(), reason="no /proc/self/maps on this OS")
def test_the_block_is_unmapped_with_the_pool():
    pool = KVPool(65536, 2, 3, 64, torch.bfloat16)
    addr = pool.k_buffers[0].data_ptr()
    assert _mapped(addr)
    del pool
    gc.collect()
    assert not _mapped(addr)
