"""Choose kv_aware's weight w by simulation: sweep w on a multi-tenant workload, side by side
with round robin and cache_aware, all scored by the real policy classes.

Not a test. The workers are simulated (a step-based continuous-batching server with a
page-granular prefix cache that evicts LRU leaves, like the radix tree) so the sweep is
fast and repeatable; their KV events go straight into `KvAwarePolicy` through
`attach_local_feed`, and their load (waiting + running tokens, as `/get_load` reports)
reaches `LoadMonitor.record` every `--poll` simulated seconds. Step time is

    step_s = step_overhead_s + prefill_s_per_token * prefill_tokens + decode_s_per_seq * running

whose defaults are *estimates* for the 135M embedded model on a CPU (not measured: a
calibration run on the shared 2-core host did not finish); pass measured values. What
the sweep is for is the ranking of w, which held at every arrival rate tried.
Prints a table and writes JSON: cache hit rate (sum cached / sum prompt tokens), TTFT
p50/p99 and throughput (requests / makespan) per policy and w.

    python benchmarks/kv_aware_weight.py --weights 0 0.5 1 2 4 8 16 --rates 3 5
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

from sgl.kv_events.hashing import page_hashes
from sgl.kv_events.wire import BlockRemoved, BlockStored, KVEventBatch
from sgl.router.policies import PolicyOptions, RouteRequest, WorkerState, make_policy
from sgl.router.policies.kv_aware import KvAwarePolicy


@dataclass
class Req:
    rid: int
    arrive: float
    tokens: list[int]
    out_len: int
    hashes: list[int] = field(default_factory=list)
    cached: int = 0
    generated: int = 0
    private_pages: int = 0
    first_token_at: float | None = None
    done_at: float | None = None


class PageCache:
    """Prefix pages keyed by chain hash; evicts least recently used unlocked leaf pages."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity = capacity_pages
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}
        self.locks: dict[int, int] = {}
        self.last: dict[int, float] = {}
        self.private = 0  # pages held by running requests outside the cache (tails, outputs)
        self._heap: list[tuple[float, int]] = []

    def used(self) -> int:
        return len(self.parent) + self.private

    def match(self, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.parent:
            n += 1
        return n

    def touch_lock(self, hashes: list[int], now: float, delta: int) -> None:
        for h in hashes:
            self.locks[h] += delta
            self.last[h] = now
            if self.locks[h] == 0 and self.children[h] == 0:
                heapq.heappush(self._heap, (now, h))

    def evict(self, need: int) -> list[int]:
        gone: list[int] = []
        while self.used() + need > self.capacity and self._heap:
            t, h = heapq.heappop(self._heap)
            if h not in self.parent or self.locks[h] or self.children[h] or self.last[h] != t:
                continue
            p = self.parent.pop(h)
            del self.children[h], self.locks[h], self.last[h]
            gone.append(h)
            if p is not None and p in self.parent:
                self.children[p] -= 1
                if self.children[p] == 0 and self.locks[p] == 0:
                    heapq.heappush(self._heap, (self.last[p], p))
        return gone

    def add(self, hashes: list[int], start: int, now: float) -> None:
        for i in range(start, len(hashes)):
            h, p = hashes[i], (hashes[i - 1] if i else None)
            self.parent[h] = p
            self.children[h], self.locks[h], self.last[h] = 0, 1, now
            if p is not None:
                self.children[p] += 1


class SimWorker:
    def __init__(self, url: str, args: argparse.Namespace, feed: object | None) -> None:
        self.url, self.args, self.feed = url, args, feed
        self.cache = PageCache(args.pool_tokens // args.page)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.busy_until = 0.0

    def load(self) -> int:
        return sum(len(r.tokens) for r in self.waiting) + sum(len(r.tokens) + r.generated for r in self.running)

    def _emit(self, events: list) -> None:
        if self.feed is not None and events:
            self.feed.push(KVEventBatch(ts=0.0, events=events))  # type: ignore[attr-defined]

    def step(self, now: float) -> float:
        """Run one batch step starting at `now`; return its duration (0: nothing to do)."""
        a, page = self.args, self.args.page
        prefill = 0
        events: list = []
        while self.waiting and prefill < a.chunk:
            r = self.waiting[0]
            hit = self.cache.match(r.hashes)
            new_pages = len(r.hashes) - hit
            tail = -(-(len(r.tokens) + r.out_len) // page) - len(r.hashes)
            self.cache.touch_lock(r.hashes[:hit], now, +1)  # before evicting: keep our hit
            gone = self.cache.evict(new_pages + tail)
            if gone:
                events.append(BlockRemoved(gone, "sim"))
            if self.cache.used() + new_pages + tail > self.cache.capacity:
                self.cache.touch_lock(r.hashes[:hit], now, -1)
                break  # no room: wait for running requests to finish
            self.waiting.popleft()
            self.cache.add(r.hashes, hit, now)
            if new_pages:
                parent = r.hashes[hit - 1] if hit else None
                events.append(BlockStored(r.hashes[hit:], parent, r.tokens[hit * page : len(r.hashes) * page], page, None, "sim"))
            self.cache.private += tail
            r.private_pages = tail
            r.cached = hit * page
            prefill += len(r.tokens) - r.cached
            self.running.append(r)
            r.generated = -1  # first token comes out of this step's prefill
        self._emit(events)
        if not self.running:
            return 0.0
        dt = a.step_overhead + a.prefill_per_token * prefill + a.decode_per_seq * len(self.running)
        end = now + dt
        still = []
        for r in self.running:
            r.generated += 1
            if r.generated == 0:
                r.first_token_at = end
            if r.generated + 1 >= r.out_len:
                r.done_at = end
                self.cache.private -= r.private_pages
                self.cache.touch_lock(r.hashes, end, -1)
            else:
                still.append(r)
        self.running = still
        return dt


def workload(args: argparse.Namespace, rate: float, seed: int) -> list[Req]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 49000) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(rate)
        sys_ = systems[rng.randrange(args.tenants)]
        question = [rng.randrange(100, 49000) for _ in range(rng.randint(args.question_tokens // 2, args.question_tokens * 3 // 2))]
        r = Req(i, t, sys_ + question, args.output_tokens)
        r.hashes = page_hashes(r.tokens, args.page)
        out.append(r)
    return out


def simulate(policy_name: str, weight: float, rate: float, args: argparse.Namespace) -> dict[str, float]:
    opts = PolicyOptions(kv_aware_prefill_weight=weight, kv_events_stale_secs=1e9, eviction_interval_secs=0, seed=0)
    policy = make_policy(policy_name, opts)
    states = [WorkerState(f"http://sim-{i}") for i in range(args.workers)]
    for s in states:
        policy.add_worker(s)
    feeds = {}
    if isinstance(policy, KvAwarePolicy):
        feeds = {s.url: policy.attach_local_feed(s.url, args.page, args.pool_tokens) for s in states}
    workers = {s.url: SimWorker(s.url, args, feeds.get(s.url)) for s in states}
    reqs = workload(args, rate, args.seed)
    owner: dict[int, WorkerState] = {}
    now, next_poll, i = 0.0, 0.0, 0
    while True:
        nxt_arrival = reqs[i].arrive if i < len(reqs) else float("inf")
        busy = [w.busy_until for w in workers.values() if w.running or w.waiting]
        nxt_step = min(busy) if busy else float("inf")
        now = min(nxt_arrival, nxt_step, next_poll if (busy or i < len(reqs)) else float("inf"))
        if now == float("inf"):
            break
        if now == next_poll:
            if isinstance(policy, KvAwarePolicy):
                for url, w in workers.items():
                    policy.monitor.record(url, w.load())
            next_poll += args.poll
            continue
        if now == nxt_arrival:
            r = reqs[i]
            i += 1
            rr = RouteRequest("/generate", "", r.tokens, str(r.rid))
            st = policy.select(rr, states)
            st.in_flight += 1
            owner[r.rid] = st
            w = workers[st.url]
            w.waiting.append(r)
            w.busy_until = max(w.busy_until, now)
            continue
        for w in workers.values():
            if (w.running or w.waiting) and w.busy_until == now:
                before = {r.rid for r in w.running}
                dt = w.step(now)
                w.busy_until = now + dt if dt else now + args.poll  # blocked on memory: retry later
                for rid in before - {r.rid for r in w.running}:
                    owner[rid].in_flight -= 1
    done = [r for r in reqs if r.done_at is not None]
    ttft = sorted(r.first_token_at - r.arrive for r in done)  # type: ignore[operator]
    prompt = sum(len(r.tokens) for r in done)
    return {
        "hit_rate": sum(r.cached for r in done) / prompt,
        "ttft_p50": ttft[len(ttft) // 2],
        "ttft_p99": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
        "ttft_mean": statistics.fmean(ttft),
        "throughput": len(done) / max(r.done_at for r in done),  # type: ignore[type-var]
        "completed": len(done),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=float, nargs="+", default=[0, 0.5, 1, 2, 4, 8, 16])
    ap.add_argument("--rates", type=float, nargs="+", default=[3.0, 5.0], help="arrivals per second")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--pool-tokens", type=int, default=4096)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048, help="most prefill tokens per step")
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--question-tokens", type=int, default=60)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--poll", type=float, default=0.1, help="load poll interval, simulated seconds")
    ap.add_argument("--step-overhead", type=float, default=0.012)
    ap.add_argument("--prefill-per-token", type=float, default=0.00025)
    ap.add_argument("--decode-per-seq", type=float, default=0.0015)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="kv_aware_weight.json")
    args = ap.parse_args()

    rows = []
    for rate in args.rates:
        runs = [("round_robin", 0.0), ("cache_aware", 0.0)] + [("kv_aware", w) for w in args.weights]
        for name, w in runs:
            res = simulate(name, w, rate, args)
            rows.append({"rate": rate, "policy": name, "w": w if name == "kv_aware" else None, **res})
    print(f"{'rate':>5} {'policy':<12} {'w':>5} {'hit':>6} {'ttft50':>8} {'ttft99':>8} {'mean':>8} {'req/s':>7}")
    for r in rows:
        w = "" if r["w"] is None else f"{r['w']:g}"
        print(f"{r['rate']:>5g} {r['policy']:<12} {w:>5} {r['hit_rate']:6.3f} {r['ttft_p50']:8.3f} "
              f"{r['ttft_p99']:8.3f} {r['ttft_mean']:8.3f} {r['throughput']:7.2f}")
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
