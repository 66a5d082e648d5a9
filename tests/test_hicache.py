"""Hierarchical KV cache, scheduler level: device pages demote to the host tier when the
small device pool evicts them and are loaded back for later requests. The fake executor
tracks fake KV (token tuples) through the plan's copies, so a wrong load shows up as a
wrong context; outputs, per-tier counts and the ownership invariants are checked after
every step."""

from __future__ import annotations

import json
from typing import Any
import random

import pytest
import torch

from sgl.radix import RadixTree
from sgl.runtime.memory.allocator import ReqToTokenPool, SlotAllocator
from sgl.runtime.memory.host_pages import HostPages
from sgl.runtime.memory.host_pool import HostKVPool, run_copies
from sgl.runtime.memory.kv_pool import KVPool
from sgl.runtime.sampling_params import SamplingParams
from sgl.runtime.scheduler.hicache import HiCache
from sgl.runtime.scheduler.kv_cache import KVCache
from sgl.runtime.scheduler.req import Req, ReqOutput
from sgl.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.fakes import EOS, CharTokenizer, FakeExecutor, expected_output

PAGE = 4


def make(num_slots: int, host_pages: int | None, policy: str = "write_through") -> tuple[Scheduler, FakeExecutor]:
    hc = HiCache(PAGE, host_pages, policy) if host_pages else None
    kv = KVCache(RadixTree(), SlotAllocator(num_slots), ReqToTokenPool(16 + Scheduler.REQ_TABLE_SLACK, 512), hc)
    cfg = SchedulerConfig(chunked_prefill_size=64, max_prefill_tokens=64, max_running_requests=4,
                          check_invariants_when_idle=True)
    fake = FakeExecutor(kv.req_to_token.table, track_kv=True)
    return Scheduler(cfg, None, kv, CharTokenizer(), {EOS}, executor=fake), fake


def file_tier(tmp_path: Any, nbytes: int, read_page: Any = None) -> tuple[Any, Any]:
    """A real file-backed storage tier (wait_complete) under tmp_path: (its PageStore, the tier)."""
    from sgl.runtime.memory.storage import PageStore, make_backend
    from sgl.runtime.scheduler.storage_tier import StorageTier

    store = PageStore(make_backend("file", {"path": str(tmp_path)}, "ns"))
    tier = StorageTier(store, "ns", nbytes, read_page=read_page or (lambda page: bytes(nbytes)),
                       prefetch_policy="wait_complete")
    return store, tier


def wait_until(done: Any, limit_s: float = 10.0) -> None:
    """Poll `done()` (a background thread's progress) until it holds or limit_s passes."""
    import time

    deadline = time.monotonic() + limit_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def paged_req(uid: int, pages: int) -> Req:
    """A one-token request (uid set, as at admission) whose prompt is `pages` full pages + 1 token."""
    req = Req(rid=str(uid), input_ids=list(range(3, 3 + pages * PAGE + 1)),
              params=SamplingParams.from_dict({"max_new_tokens": 1}), on_output=lambda o: None)
    req.uid = uid
    return req


def run_one(s: Scheduler, rid: str, prompt: list[int], max_new: int = 6) -> tuple[Req, ReqOutput]:
    results: dict[str, ReqOutput] = {}
    p = SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0})
    req = Req(rid=rid, input_ids=prompt, params=p, on_output=lambda o: results.__setitem__(o.rid, o))
    s.submit(req)
    for _ in range(1000):
        s.step()
        s.check_invariants()
        if not s.has_work() and s.inbox.empty():
            break
    return req, results[rid]


def workload(seed: int = 0) -> list[list[int]]:
    """Documents longer than half the device pool, each asked twice with a different
    question, in an order that evicts a document before it comes back."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 60) for _ in range(70)] for _ in range(4)]
    order = [0, 1, 2, 3, 0, 2, 1, 3, 0]
    return [docs[d] + [rng.randrange(3, 60) for _ in range(rng.randrange(1, 9))] for d in order]


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_demote_and_promote_keep_outputs_exact(policy: str) -> None:
    s, fake = make(num_slots=160, host_pages=64, policy=policy)
    base, base_fake = make(num_slots=160, host_pages=None)
    host_hits = 0
    for i, prompt in enumerate(workload()):
        req, out = run_one(s, f"r{i}", prompt)
        _, ref = run_one(base, f"r{i}", prompt)
        assert out.output_ids == ref.output_ids == expected_output(prompt, 6)
        # the context the last sampled token attended to is exactly prompt + outputs so far
        assert fake.attended[req.uid] == tuple(prompt + out.output_ids[:-1])
        d = out.meta_info["cached_tokens_details"]
        assert d["device"] + d["host"] + d["storage"] == out.meta_info["cached_tokens"]
        assert d["storage"] == 0
        host_hits += d["host"]
    snap = s.snapshot()
    if policy == "write_through_selective":
        # no page was hit twice on the device before its eviction: nothing was kept
        assert snap["hicache_host_hit_tokens"] == host_hits
    else:
        assert host_hits > 0 and snap["hicache_host_hit_tokens"] == host_hits
        assert fake.tokens_computed < base_fake.tokens_computed
    assert snap["hicache_host_pages_used"] <= 64
    assert s.kv.flush() and s.snapshot()["hicache_host_pages_used"] == 0
    s.check_invariants()


def test_a_failed_step_leaves_no_uncomputed_kv_in_the_tree_or_the_host_tier() -> None:
    """The step that carries a request's first host stores fails: the request is aborted,
    and neither its slots of that step nor the host pages named for the copies that never
    ran may serve a later prompt (the fake KV proves what every row attended to)."""
    import threading

    s, fake = make(num_slots=160, host_pages=64)
    real_execute, failed = fake.execute, []

    def execute(plan):  # noqa: ANN001, ANN202
        if plan.rows and plan.kv_stores and not failed:
            failed.append(plan)
            raise RuntimeError("injected step failure")
        return real_execute(plan)

    fake.execute = execute
    results: dict[str, ReqOutput] = {}
    stop = threading.Event()
    loop = threading.Thread(target=s.run_forever, args=(stop,), daemon=True)
    loop.start()

    def run(rid: str, prompt: list[int]) -> ReqOutput:
        p = SamplingParams.from_dict({"max_new_tokens": 6, "temperature": 0})
        s.submit(Req(rid=rid, input_ids=prompt, params=p, on_output=lambda o: results.__setitem__(o.rid, o)))
        wait_until(lambda: rid in results and results[rid].finished)
        return results[rid]

    try:
        docs = workload()
        first = run("a", docs[0])
        assert failed and first.meta_info["finish_reason"]["status_code"] == 500
        for i, prompt in enumerate(docs):  # evicts the device copies: host hits follow
            out = run(f"r{i}", prompt)
            assert out.output_ids == expected_output(prompt, 6), out.meta_info
        assert s.snapshot()["hicache_host_hit_tokens"] > 0
    finally:
        stop.set()
        loop.join(timeout=10)
    s.check_invariants()


def test_write_through_copies_at_insert_and_host_lru_drops() -> None:
    s, fake = make(num_slots=160, host_pages=20)
    prompts = workload(1)
    for i, p in enumerate(prompts):
        req, out = run_one(s, f"r{i}", p)
        assert fake.attended[req.uid] == tuple(p + out.output_ids[:-1])
    assert s.kv.hicache.has_copies()  # the last release's write-through waits for the next iteration
    s.step()  # idle: runs them in a copies-only plan
    assert not s.kv.hicache.has_copies()
    snap = s.snapshot()
    assert snap["hicache_host_pages_used"] == 20  # full: older pages were dropped
    assert snap["hicache_host_pages_dropped"] > 0
    assert fake.num_stores == snap["hicache_pages_stored"]
    assert fake.num_loads == snap["hicache_pages_loaded"]


def test_selective_keeps_pages_hit_on_device() -> None:
    s, fake = make(num_slots=200, host_pages=64, policy="write_through_selective")
    rng = random.Random(3)
    doc = [rng.randrange(3, 60) for _ in range(60)]
    for i in range(3):  # three device hits on doc's pages: over the threshold, stored
        run_one(s, f"a{i}", doc + [5 + i])
    assert s.snapshot()["hicache_pages_stored"] >= 60 // PAGE - 1
    other = [rng.randrange(3, 60) for _ in range(150)]
    run_one(s, "evict", other)  # pushes doc out of the device pool
    req, out = run_one(s, "back", doc + [9])
    assert out.meta_info["cached_tokens_details"]["host"] > 0
    assert fake.attended[req.uid] == tuple(doc + [9] + out.output_ids[:-1])


def test_host_pages_lru_pins_and_invariants() -> None:
    h = HostPages(3)
    pages = [h.put(x) for x in (10, 11, 12)]
    assert sorted(pages) == [0, 1, 2] and h.put(10) is None
    assert h.lookup([10, 11, 99, 12]) == [pages[0], pages[1]]  # stops at the first miss
    h.pin([pages[2]])  # 12 is the LRU but pinned: 10 goes? no, LRU order is 12, 10, 11
    p = h.put(13)
    assert p == pages[0] and 10 not in h and 12 in h
    h.pin([pages[1], p])
    assert h.put(14) is None  # everything pinned
    h.unpin_all()
    assert h.put(14) is not None
    h.check_invariants()
    h.clear()
    assert h.num_used == 0
    h.check_invariants()


@pytest.mark.parametrize("native", [True, False], ids=["c-copy", "torch"])
def test_host_pool_copies_roundtrip(native: bool) -> None:
    pool = KVPool(64, 3, 2, 4, torch.bfloat16)
    for layer in range(3):
        pool.k_buffers[layer].copy_(torch.randn(64, 2, 4))
        pool.v_buffers[layer].copy_(torch.randn(64, 2, 4))
    host = HostKVPool(5, 4, 3, 2, 4, torch.bfloat16)
    host.use_native = native
    run_copies(host, pool, [(2, [5, 9, 11, 3]), (0, [1, 2, 7, 8])], [])
    ref_k = [k.clone() for k in pool.k_buffers]
    ref_v = [v.clone() for v in pool.v_buffers]
    run_copies(host, pool, [], [(2, 1, [20, 21, 22]), (0, 0, [30, 31, 32, 33])])
    for layer in range(3):
        assert torch.equal(pool.k_buffers[layer][[20, 21, 22]], ref_k[layer][[9, 11, 3]])
        assert torch.equal(pool.v_buffers[layer][[30, 31, 32, 33]], ref_v[layer][[1, 2, 7, 8]])
    blob = host.read(2)
    assert len(blob) == host.page_nbytes
    host.fill(4, memoryview(blob))
    assert torch.equal(host.buf[4], host.buf[2])
    with pytest.raises(ValueError, match="holds"):
        host.fill(1, blob[:-2])


def test_c_row_copy_matches_torch_indexing() -> None:
    """The C copy (kernels/cpu/kv_copy.c) against torch's indexing path, byte for byte:
    scattered and consecutive slots (merged into runs), partial pages, a store and a load
    in one plan reading the same slots, and float32 rows of another width."""
    from sgl.runtime.kernels.cpu.binding import kernels

    if kernels() is None:
        pytest.skip("no C compiler: the torch path is the only one")
    rng = random.Random(3)
    for dtype, heads, dim in ((torch.bfloat16, 3, 64), (torch.float32, 1, 12)):
        pools, hosts = [], []
        for native in (True, False):
            torch.manual_seed(0)
            pool = KVPool(200, 4, heads, dim, dtype)
            for t in (*pool.k_buffers, *pool.v_buffers):
                t.copy_(torch.randn(t.shape))
            host = HostKVPool(12, 8, 4, heads, dim, dtype)
            host.use_native = native
            pools.append(pool)
            hosts.append(host)
        free = list(range(1, 200))
        rng.shuffle(free)
        stores = [(0, free[:8]), (3, list(range(40, 48))), (7, free[8:16])]
        loads = [(3, 2, free[20:26]), (0, 0, list(range(100, 108))), (7, 5, [150, 151, 9])]
        for host, pool in zip(hosts, pools, strict=True):
            run_copies(host, pool, stores, loads)
        assert torch.equal(hosts[0].buf, hosts[1].buf)
        for a, b in zip(pools[0].k_buffers + pools[0].v_buffers, pools[1].k_buffers + pools[1].v_buffers,
                        strict=True):
            assert torch.equal(a, b)
        # the copied rows are the stored ones: page 3 position 2.. came from slots 42..47
        assert torch.equal(pools[0].v_buffers[2][free[20:26]], pools[1].v_buffers[2][list(range(42, 48))])
        with pytest.raises(IndexError, match="out of range"):
            hosts[0].load(pools[0], [(12, 0, [1])])
        with pytest.raises(IndexError, match="out of range"):
            hosts[0].store(pools[0], [(0, [200])])


def test_kv_events_follow_the_device_tree_through_demotion_and_promotion() -> None:
    """With KV events and the hierarchical cache both on, a subscriber replaying the
    events holds exactly the full pages of the device tree after every request: demotion
    is announced as the eviction it is, a promoted prefix as a new insert, host pages never."""
    from sgl.kv_events.wire import BlockStored
    from sgl.runtime.kv_events.pages import PageTracker
    from tests.test_kv_event_pages import Subscriber, full_pages

    s, fake = make(num_slots=160, host_pages=64)
    tracker = PageTracker(PAGE)
    s.kv.tree.observer = tracker
    sub = Subscriber(PAGE)
    stored_again = 0
    announced: set[int] = set()
    for i, prompt in enumerate(workload()):
        _, out = run_one(s, f"r{i}", prompt)
        assert out.output_ids == expected_output(prompt, 6)
        events = tracker.take_events()
        for ev in events:
            if isinstance(ev, BlockStored):
                stored_again += len(announced & set(ev.block_hashes))
                announced |= set(ev.block_hashes)
        sub.apply(events)
        assert sub.held == full_pages(s.kv.tree, PAGE) == tracker.held_hashes()
    snap = s.snapshot()
    assert snap["hicache_pages_demoted"] + snap["hicache_pages_stored"] > 0 and snap["hicache_host_hit_tokens"] > 0
    assert stored_again > 0  # pages evicted to host and loaded back were announced again


def test_storage_hits_stay_storage_when_admission_waits(tmp_path) -> None:
    """A request whose pages came up from storage but that waits for pool room finds them
    in the host tier on its next try: they are still reported as storage hits."""
    nbytes = 32
    store, tier = file_tier(tmp_path, nbytes)
    hc = HiCache(PAGE, 16, storage=tier)
    try:
        p = SamplingParams.from_dict({"max_new_tokens": 1})
        req = Req(rid="r", input_ids=list(range(3, 3 + 4 * PAGE + 1)), params=p, on_output=lambda o: None)
        req.uid = 7
        hashes = hc.hashes(req, 4 * PAGE)
        store.set([tier.key(h) for h in hashes], [bytes([k]) * nbytes for k in range(4)])
        hc.on_arrival(req)
        wait_until(lambda: not hc.storage_pending(req))
        first = hc.match(req, 0, 4 * PAGE)
        assert (first.host_tokens, first.storage_tokens) == (0, 4 * PAGE)
        _, _, fills, _ = hc.take_copies()  # not admitted; the plan still runs the fills
        assert [blob[0] for _, blob in fills] == [0, 1, 2, 3]
        again = hc.match(req, 0, 4 * PAGE)
        assert (again.host_tokens, again.storage_tokens) == (0, 4 * PAGE)
        assert [page for page, _, _ in again.loads] == [page for page, _, _ in first.loads]
        hc.on_finish(req)
        other = Req(rid="o", input_ids=list(req.input_ids), params=p, on_output=lambda o: None)
        other.uid = 8
        hit = hc.match(other, 0, 4 * PAGE)  # another request: a plain host hit
        assert (hit.host_tokens, hit.storage_tokens) == (4 * PAGE, 0)
    finally:
        tier.close()


def test_storage_fills_never_evict_the_pages_the_same_request_loads(tmp_path) -> None:
    """A host tier smaller than a prompt's hits: 2 pages are host hits, 4 more come up from
    storage, and the tier holds 4. Fills may evict only pages no pending load reads, so the
    hit stops at 4 pages, each in its own host page with its own bytes."""
    nbytes = 32
    store, tier = file_tier(tmp_path, nbytes)
    hc = HiCache(PAGE, 4, storage=tier)
    try:
        req = paged_req(9, 6)
        hashes = hc.hashes(req, 6 * PAGE)
        for h in hashes[:2]:
            assert hc.host.put(h) is not None
        store.set([tier.key(h) for h in hashes[2:]], [bytes([k]) * nbytes for k in range(2, 6)])
        hc.on_arrival(req)
        wait_until(lambda: not hc.storage_pending(req))
        hit = hc.match(req, 0, 6 * PAGE)
        pages = [page for page, _, _ in hit.loads]
        assert len(pages) == len(set(pages)) == 4
        assert (hit.host_tokens, hit.storage_tokens) == (2 * PAGE, 2 * PAGE)
        _, _, fills, _ = hc.take_copies()
        assert [blob[0] for _, blob in fills] == [2, 3]
        assert [page for page, _ in fills] == pages[2:]
        hc.host.check_invariants()
        assert all(h in hc.host for h in hashes[:4])
    finally:
        tier.close()


def test_a_page_missing_from_storage_is_written_again(tmp_path) -> None:
    """A page this process stored and the store then lost (evicted, deleted as corrupt) is
    no longer skipped as written: the lookup that finds the hole makes the next store of
    that page write it again, so the chain is whole for later requests."""
    nbytes = 32
    store, tier = file_tier(tmp_path, nbytes, read_page=lambda page: bytes([page]) * nbytes)

    def written(n: int) -> None:
        wait_until(lambda: tier.snapshot()["storage_pages_written"] >= n)
        assert tier.snapshot()["storage_pages_written"] == n

    try:
        hashes = [11, 12, 13]
        tier.write_through(list(zip(range(3), hashes)))
        written(3)
        tier.write_through(list(zip(range(3), hashes)))  # known: not written twice
        store.delete([tier.key(12)])
        tier.start_prefetch(1, hashes, 0)
        wait_until(lambda: not tier.must_wait(1))
        assert [bytes(b)[0] for b in tier.take(1, 0)] == [0]  # the chain stops at the hole
        tier.write_through(list(zip(range(3), hashes)))
        written(4)
        assert store.exists([tier.key(h) for h in hashes]) == 3
    finally:
        tier.close()


def test_clear_runs_in_order_with_the_writes_and_off_the_scheduler_thread(tmp_path) -> None:
    """Writes queued before a clear are cleared; those after it survive, and are written
    (the written set forgot the cleared pages). The caller gets a future, not a wait."""
    import threading

    nbytes = 32
    store, tier = file_tier(tmp_path, nbytes, read_page=lambda page: bytes([page]) * nbytes)
    cleared_on: list[str] = []
    real_clear = store.clear
    store.clear = lambda: (cleared_on.append(threading.current_thread().name), real_clear())[1]
    try:
        tier.write_through([(0, 21), (1, 22)])
        done = tier.clear()
        tier.write_through([(2, 23)])
        assert done.result(timeout=10) is True
        tier.write_through([(0, 21)])  # cleared, so written again
        wait_until(lambda: tier.snapshot()["storage_pages_written"] >= 4)
        assert cleared_on == ["sgl-hicache-writer"]
        assert tier.snapshot()["storage_pages_written"] == 4
        assert [store.exists([tier.key(h)]) for h in (21, 22, 23)] == [1, 0, 1]
    finally:
        tier.close()


def test_prefetched_pages_are_bounded_and_freed_when_not_needed(tmp_path, monkeypatch) -> None:
    """Pages fetched for waiting requests stay under MAX_PREFETCHED_BYTES (a request past it
    recomputes the rest), and a match that needs nothing from storage (the device holds the
    whole prompt) frees its request's pages at once; wait_complete is capped too."""
    from sgl.runtime.scheduler import storage_tier

    nbytes = 32
    monkeypatch.setattr(storage_tier, "GET_BATCH", 1)
    monkeypatch.setattr(storage_tier, "MAX_PREFETCHED_BYTES", 5 * nbytes)
    store, tier = file_tier(tmp_path, nbytes)
    hc = HiCache(PAGE, 64, storage=tier)
    try:
        p = SamplingParams.from_dict({"max_new_tokens": 1})
        reqs = []
        for uid in (1, 2):
            req = Req(rid=str(uid), input_ids=[uid] + list(range(3, 3 + 4 * PAGE)), params=p, on_output=lambda o: None)
            req.uid = uid
            hashes = hc.hashes(req, 4 * PAGE)
            store.set([tier.key(h) for h in hashes], [bytes([k]) * nbytes for k in range(4)])
            reqs.append(req)
        for req in reqs:
            hc.on_arrival(req)
        wait_until(lambda: not any(hc.storage_pending(r) for r in reqs))
        assert tier.snapshot()["storage_prefetch_bytes_held"] == 5 * nbytes  # 4 + 1, then the budget
        second = hc.match(reqs[1], 0, 4 * PAGE)
        assert second.storage_tokens == 1 * PAGE
        assert tier.snapshot()["storage_prefetch_bytes_held"] == 4 * nbytes
        assert hc.match(reqs[0], 4 * PAGE, 4 * PAGE).num_tokens == 0  # all on the device
        assert tier.snapshot()["storage_prefetch_bytes_held"] == 0
        monkeypatch.setattr(storage_tier, "WAIT_COMPLETE_LIMIT_S", 0.0)
        tier._prefetches[3] = storage_tier.Prefetch(0, ["ns/x"], [0])  # a lookup that never ends
        assert not tier.must_wait(3)
    finally:
        tier.close()


def test_a_finished_storage_lookup_wakes_the_scheduler(tmp_path) -> None:
    """The reader thread calls `on_prefetch_done` once a request's lookup ends, found or
    not, with the lookup already marked done (the woken loop must see it finished); the
    worker build wires it to the scheduler's wake."""
    import threading

    nbytes = 32
    store, tier = file_tier(tmp_path, nbytes)
    hc = HiCache(PAGE, 16, storage=tier)
    woken: list[bool] = []
    event = threading.Event()

    def wake() -> None:
        woken.append(hc.storage_pending(req))  # must already be False when we are woken
        event.set()

    tier.on_prefetch_done = wake
    try:
        p = SamplingParams.from_dict({"max_new_tokens": 1})
        for uid, stored in ((7, True), (8, False)):  # a hit, then a miss
            req = Req(rid=str(uid), input_ids=list(range(uid, uid + 2 * PAGE + 1)), params=p, on_output=lambda o: None)
            req.uid = uid
            if stored:
                hashes = hc.hashes(req, 2 * PAGE)
                store.set([tier.key(h) for h in hashes], [bytes([k]) * nbytes for k in range(2)])
            event.clear()
            hc.on_arrival(req)
            assert event.wait(30), "the lookup never reported that it ended"
            assert woken[-1] is False
            assert hc.match(req, 0, 2 * PAGE).storage_tokens == (2 * PAGE if stored else 0)
            hc.on_finish(req)
        assert len(woken) == 2
    finally:
        tier.close()


def test_lookups_of_requests_that_arrived_together_wake_the_scheduler_once(tmp_path) -> None:
    """Two requests arrive while the reader is busy: it wakes the scheduler once, after
    the second lookup too is done, so both are admitted in one step (a wake after the
    first would admit it alone and leave the other for a step of its own)."""
    import threading
    import time

    from sgl.runtime.memory.storage import PageStore, make_backend
    from sgl.runtime.scheduler.storage_tier import StorageTier

    nbytes = 32
    store = PageStore(make_backend("file", {"path": str(tmp_path)}, "ns"))
    gate = threading.Event()
    exists = store.exists

    def held_exists(keys):  # the reader's first lookup waits until both requests arrived
        gate.wait(30)
        return exists(keys)

    store.exists = held_exists
    tier = StorageTier(store, "ns", nbytes, read_page=lambda page: bytes(nbytes), prefetch_policy="wait_complete")
    hc = HiCache(PAGE, 16, storage=tier)
    p = SamplingParams.from_dict({"max_new_tokens": 1})
    reqs = []
    for uid in (7, 8):
        req = Req(rid=str(uid), input_ids=list(range(uid * 100, uid * 100 + 2 * PAGE + 1)), params=p,
                  on_output=lambda o: None)
        req.uid = uid
        hashes = hc.hashes(req, 2 * PAGE)
        store.set([tier.key(h) for h in hashes], [bytes([k]) * nbytes for k in range(2)])
        reqs.append(req)
    woken: list[list[bool]] = []
    event = threading.Event()

    def wake() -> None:
        woken.append([hc.storage_pending(r) for r in reqs])
        event.set()

    tier.on_prefetch_done = wake
    try:
        for req in reqs:
            hc.on_arrival(req)
        gate.set()
        assert event.wait(30), "the lookups never reported that they ended"
        time.sleep(0.2)  # a second wake would come now
        assert woken == [[False, False]]
        assert all(hc.match(r, 0, 2 * PAGE).storage_tokens == 2 * PAGE for r in reqs)
    finally:
        tier.close()


@pytest.mark.model
def test_worker_build_wires_storage_lookups_to_the_scheduler_wake(tmp_path) -> None:
    from sgl.runtime.config import EngineConfig
    from sgl.runtime.distributed.parallel import TPInfo
    from sgl.runtime.models.loader import resolve_model_dir
    from sgl.runtime.worker.build import build_rank, build_scheduler

    cfg = EngineConfig.from_kwargs(max_total_tokens=256, enable_hierarchical_cache=True,
                                   hicache_storage_backend="file",
                                   hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path)}))
    hf_dir, _ = resolve_model_dir(cfg.model_path, cfg.cache_dir)
    sched = build_scheduler(cfg, build_rank(cfg, str(hf_dir), TPInfo()))
    try:
        tier = sched.kv.hicache.storage
        assert tier.on_prefetch_done == sched.wake
        tier.on_prefetch_done()
        assert sched.inbox.get_nowait() == ("wake",)
    finally:
        sched.close()
