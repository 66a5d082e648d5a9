"""sgl.runtime.lru.LRU against a brute-force model (a list in recency order)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl.runtime.lru import LRU

ops = st.lists(st.tuples(st.sampled_from(["get", "put", "create"]), st.integers(0, 6), st.integers(0, 99)),
               max_size=60)


@given(cap=st.integers(0, 4), ops=ops)
def test_matches_model(cap, ops):
    lru: LRU[int, int] = LRU(cap)
    model: list[tuple[int, int]] = []  # least recent first
    hits = misses = 0

    def touch(k: int) -> int | None:
        for i, (mk, mv) in enumerate(model):
            if mk == k:
                model.append(model.pop(i))
                return mv
        return None

    def store(k: int, v: int) -> None:
        touch(k)
        model[:] = [(mk, mv) for mk, mv in model if mk != k] + [(k, v)]
        del model[:max(0, len(model) - cap)]

    for op, k, v in ops:
        if op == "get":
            want = touch(k)
            hits, misses = hits + (want is not None), misses + (want is None)
            assert lru.get(k) == want
        elif op == "put":
            lru.put(k, v)
            store(k, v)
        else:
            want = touch(k)
            hits, misses = hits + (want is not None), misses + (want is None)
            if want is None:
                store(k, v)
                want = v
            assert lru.get_or_create(k, lambda v=v: v) == want
        assert len(lru) == len(model) <= cap
        assert all(mk in lru for mk, _ in model)
    assert (lru.hits, lru.misses) == (hits, misses)


def test_get_refreshes_recency():
    lru: LRU[str, int] = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1
    lru.put("c", 3)  # evicts b, the least recently used, not a
    assert lru.get("b") is None and lru.get("a") == 1 and lru.get("c") == 3


def test_factory_runs_once_per_missing_key():
    lru: LRU[int, str] = LRU(8)
    calls = []
    for _ in range(3):
        assert lru.get_or_create(5, lambda: calls.append(1) or "five") == "five"
    assert calls == [1]


def test_concurrent_puts_keep_the_bound():
    lru: LRU[int, int] = LRU(16)

    def work(base: int) -> None:
        for i in range(2000):
            lru.put(base + i % 50, i)
            lru.get(base + (i * 7) % 50)

    threads = [threading.Thread(target=work, args=(t * 100,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(lru) == 16


def test_negative_size_is_refused():
    with pytest.raises(ValueError, match="max_entries"):
        LRU(-1)
