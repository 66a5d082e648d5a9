"""Routing policies on plain `WorkerState` lists, and load polling against a real HTTP server.

No router, no workers: each policy is driven through its `Policy` protocol, the way the
router's request path calls it (`select` then the registry bumps `in_flight`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping

import pytest

from sgl.router.load_monitor import LoadMonitor, parse_load
from sgl.router.policies import POLICY_NAMES, PolicyOptions, RouteRequest, WorkerState, make_policy
from sgl.router.policies.cache_aware import CacheAwarePolicy, is_imbalanced
from sgl.router.policies.prefix_trees import PrefixTrees
from tests.json_http import JsonServer


def workers(n: int) -> list[WorkerState]:
    return [WorkerState(f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def req(text: str, ids: list[int] | None = None) -> RouteRequest:
    return RouteRequest("/generate", text, ids)


def test_make_policy_names_and_unknown() -> None:
    assert set(POLICY_NAMES) >= {"round_robin", "random", "power_of_two", "cache_aware", "kv_aware"}
    for name in POLICY_NAMES:
        assert make_policy(name, PolicyOptions()).name == name
    with pytest.raises(ValueError, match="unknown policy 'nope'.*round_robin"):
        make_policy("nope", PolicyOptions())
    with pytest.raises(ValueError, match="cache_threshold"):
        PolicyOptions(cache_threshold=1.5)


def test_round_robin_order() -> None:
    ws = workers(3)
    p = make_policy("round_robin", PolicyOptions())
    got = [p.select(req("x"), ws).url for _ in range(7)]
    assert got == [ws[i % 3].url for i in range(7)]


def test_random_covers_all() -> None:
    ws = workers(4)
    p = make_policy("random", PolicyOptions(seed=7))
    assert {p.select(req("x"), ws).url for _ in range(200)} == {w.url for w in ws}


def test_power_of_two_without_load_prefers_fewer_in_flight() -> None:
    ws = workers(2)
    ws[0].in_flight = 5
    p = make_policy("power_of_two", PolicyOptions(seed=1))
    assert all(p.select(req("x"), ws) is ws[1] for _ in range(20))


# ------------------------------------------------------------------ cache_aware
def test_cache_aware_shared_prefix_goes_to_same_worker() -> None:
    ws = workers(3)
    p = make_policy("cache_aware", PolicyOptions())
    systems = [f"You are assistant number {k}. " * 8 for k in range(3)]
    first = {k: p.select(req(systems[k] + "hi"), ws) for k in range(3)}
    # Three new prefixes spread over three workers (smallest tree first).
    assert len({w.url for w in first.values()}) == 3
    for user in range(10):
        for k in range(3):
            assert p.select(req(systems[k] + f"question {user}?"), ws) is first[k]
    s = p.stats()
    assert s["cache_hits"] == 30 and s["cache_misses"] == 3
    assert s["tree_size"] > 0


def test_cache_aware_uses_token_ids_when_given() -> None:
    ws = workers(2)
    p = make_policy("cache_aware", PolicyOptions())
    a = p.select(req("", list(range(100))), ws)
    # Different text, same ids: ids win.
    assert p.select(req("zzz", list(range(90)) + [7] * 10), ws) is a
    b = p.select(req("", [5000 + i for i in range(100)]), ws)
    assert b is not a


def test_cache_aware_below_threshold_goes_to_smallest_tree() -> None:
    ws = workers(2)
    p = make_policy("cache_aware", PolicyOptions(cache_threshold=0.5))
    a = p.select(req("A" * 100), ws)
    b = p.select(req("B" * 10), ws)
    assert b is not a
    # 30% match with a's tree, below 0.5: goes to the smaller tree (b's).
    assert p.select(req("A" * 30 + "C" * 70), ws) is b


def test_imbalance_rule_matches_sglang_router() -> None:
    assert not is_imbalanced([100, 50], 64, 1.5)  # abs gap 50 <= 64
    assert is_imbalanced([200, 130], 64, 1.5)  # gap 70 > 64 and 200 > 195
    assert not is_imbalanced([200, 140], 64, 1.5)  # gap 60
    assert is_imbalanced([200, 100], 64, 1.5)
    assert not is_imbalanced([7], 0, 1.0)
    assert not is_imbalanced([1000, 900], 64, 1.5)  # big gap, small ratio


def test_cache_aware_balances_when_thresholds_trip() -> None:
    ws = workers(2)
    p = make_policy("cache_aware", PolicyOptions(balance_abs_threshold=4, balance_rel_threshold=1.5))
    home = p.select(req("shared prefix " * 10 + "0"), ws)
    other = ws[1] if home is ws[0] else ws[0]
    home.in_flight = 4  # gap 4, not > 4: locality wins
    assert p.select(req("shared prefix " * 10 + "1"), ws) is home
    assert p.stats()["balanced"] == 0
    home.in_flight = 5  # gap 5 > 4 and 5 > 0 * 1.5
    assert p.select(req("shared prefix " * 10 + "2"), ws) is other
    assert p.stats()["balanced"] == 1


def test_eviction_bounds_tree_size() -> None:
    ws = workers(2)
    p = CacheAwarePolicy(PolicyOptions(max_tree_size=500, eviction_interval_secs=0))
    for w in ws:
        p.add_worker(w)
    for i in range(200):
        p.select(req(f"{i:04d}" + "x" * 40), ws)
    assert 500 < p.trees.size(ws[0].url) <= 1000  # trimmed at insert past twice the cap
    before = p.stats()["evicted"]
    freed = p.evict_now()
    assert freed > 0
    for w in ws:
        assert p.trees.size(w.url) <= 500
        p.trees.tree(w.url).check_invariants()
    assert p.stats()["evicted"] == before + freed


def test_eviction_runs_on_its_interval() -> None:
    async def main() -> int:
        ws = workers(1)
        p = CacheAwarePolicy(PolicyOptions(max_tree_size=10, eviction_interval_secs=0.01))
        p.add_worker(ws[0])
        await p.start()
        try:
            p.select(req("y" * 100), ws)
            for _ in range(500):
                if p.trees.size(ws[0].url) <= 10:
                    break
                await asyncio.sleep(0.01)
            return p.trees.size(ws[0].url)
        finally:
            await p.stop()

    assert asyncio.run(main()) <= 10


def test_eviction_is_lru() -> None:
    t = PrefixTrees()
    t.insert("w", [1] * 10)
    t.insert("w", [2] * 10)
    t.insert("w", [1] * 10)  # refresh [1]*10
    t.evict_to(10)
    assert t.tree("w").prefix_len([1] * 10) == 10
    assert t.tree("w").prefix_len([2] * 10) == 0


def test_a_tree_past_twice_its_cap_is_trimmed_at_insert() -> None:
    t = PrefixTrees(max_size=100)
    for k in range(25):  # 25 distinct 10-token prompts: 250 keys, no eviction tick in between
        t.insert("w", [k + 1] * 10)
        assert t.size("w") <= 200
    assert t.evicted > 0
    assert t.match("w", [25] * 10) == 10  # the most recent stays
    assert t.match("w", [1] * 10) == 0  # the oldest went
    unbounded = PrefixTrees()
    for k in range(20):
        unbounded.insert("w", [k + 1] * 10)
    assert unbounded.size("w") == 200


def test_prefix_len_does_not_modify() -> None:
    t = PrefixTrees()
    t.insert("w", [1, 2, 3, 4])
    tree = t.tree("w")
    before = (len(tree.root.children), tree._clock)
    assert t.match("w", [1, 2, 9]) == 2
    assert t.match("w", [1, 2, 3, 4, 5]) == 4
    assert t.match("w", [7]) == 0
    assert (len(tree.root.children), tree._clock) == before
    assert len(next(iter(tree.root.children.values())).key) == 4  # not split


# ------------------------------------------------------------------ load polling
class _LoadServer(JsonServer):
    """A real HTTP server answering /get_load with whatever `body` holds."""

    def __init__(self) -> None:
        self.body: object = {"num_waiting_tokens": 0, "num_running_tokens": 0}
        self.hits = 0
        self.key: str | None = None  # when set, answer 401 without 'Authorization: Bearer <key>'
        super().__init__(self._answer)

    def _answer(self, path: str, headers: Mapping[str, str]) -> tuple[int, object] | None:
        if path != "/get_load":
            return None
        if self.key is not None and headers.get("authorization") != f"Bearer {self.key}":
            return 401, {"error": "unauthorized"}
        self.hits += 1
        return 200, self.body


@pytest.fixture
def load_servers() -> Iterator[list[_LoadServer]]:
    servers = [_LoadServer() for _ in range(2)]
    yield servers
    for s in servers:
        s.close()


def test_parse_load_shapes() -> None:
    assert parse_load({"num_waiting_tokens": 3, "num_running_tokens": 4}) == 7
    assert parse_load([{"num_waiting_tokens": 3, "num_running_tokens": 4}, {"num_running_tokens": 10}]) == 17
    assert parse_load([{"dp_rank": 0, "num_tokens": 12}]) == 12
    assert parse_load({"load": 5}) == 5
    # sgl workers: queued prefill net of cache hits + a few tokens per running request
    assert parse_load({"num_pending_prefill_tokens": 30, "num_running_reqs": 2, "num_waiting_tokens": 600}) == 46
    assert parse_load({"something": "else"}) is None
    assert parse_load("nope") is None


def test_load_monitor_polls_real_server(load_servers: list[_LoadServer]) -> None:
    async def main() -> None:
        a, b = load_servers
        a.body = [{"num_waiting_tokens": 100, "num_running_tokens": 20}, {"num_waiting_tokens": 1, "num_running_tokens": 2}]
        mon = LoadMonitor(interval=0.02, timeout=2.0)
        mon.add_worker(a.url)
        mon.add_worker("http://127.0.0.1:9")  # nothing listens there
        assert await mon.poll_once(a.url)
        assert mon.load(a.url) == 123
        assert not await mon.poll_once("http://127.0.0.1:9")
        assert mon.load("http://127.0.0.1:9") is None
        mon.note_routed(a.url, 50)
        assert mon.load(a.url) == 173  # routed since the poll counts until the next one
        assert await mon.poll_once(a.url)
        assert mon.load(a.url) == 123
        # The background loop keeps polling and picks up changes.
        await mon.start()
        mon.add_worker(b.url)
        b.body = {"num_waiting_tokens": 7, "num_running_tokens": 0}
        for _ in range(500):
            if mon.load(b.url) == 7 and a.hits > 5:
                break
            await asyncio.sleep(0.01)
        await mon.stop()
        assert mon.load(b.url) == 7
        assert mon.stats()["load_polls_ok"] >= 3

    asyncio.run(main())


def test_policy_load_polls_send_the_workers_key(load_servers: list[_LoadServer]) -> None:
    async def main() -> None:
        a, _ = load_servers
        a.key = "k1"
        a.body = {"num_waiting_tokens": 9, "num_running_tokens": 0}
        for name in ("power_of_two", "kv_aware"):
            keyed = make_policy(name, PolicyOptions(worker_headers=(("authorization", "Bearer k1"),)))
            keyed.add_worker(WorkerState(a.url))
            assert await keyed.monitor.poll_once(a.url)  # type: ignore[attr-defined]
            assert keyed.monitor.load(a.url) == 9  # type: ignore[attr-defined]
        bare = LoadMonitor()
        bare.add_worker(a.url)
        assert not await bare.poll_once(a.url)  # 401 without the key: load unknown
        assert bare.stats()["load_polls_failed"] == 1

    asyncio.run(main())


def test_power_of_two_prefers_reported_less_loaded(load_servers: list[_LoadServer]) -> None:
    async def main() -> None:
        a, b = load_servers
        a.body = {"num_waiting_tokens": 5000, "num_running_tokens": 100}
        b.body = {"num_waiting_tokens": 0, "num_running_tokens": 100}
        ws = [WorkerState(a.url), WorkerState(b.url)]
        ws[1].in_flight = 3  # the router's own count would say otherwise
        p = make_policy("power_of_two", PolicyOptions(seed=3, load_poll_interval_secs=0.02))
        for w in ws:
            p.add_worker(w)
        await p.start()
        try:
            mon = p.monitor  # type: ignore[attr-defined]
            for _ in range(500):
                if mon.load(a.url) is not None and mon.load(b.url) is not None:
                    break
                await asyncio.sleep(0.01)
            picks = [p.select(req("x" * 40), ws) for _ in range(10)]
        finally:
            await p.stop()
        assert all(w is ws[1] for w in picks)

    asyncio.run(main())
