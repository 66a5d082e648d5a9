"""KV cache events: what publishing costs the engine, side by side in one run.

(a) the same engine workload (requests sharing prefixes under a small pool, so pages are
    stored and evicted all along) with `--kv-events-config` off and on, one run each, a
    subscriber draining the stream: tok/s and the ratio;
(b) the page tracker alone on a bare radix tree (the work added to the scheduler thread):
    microseconds per inserted page, against the engine's mean step time from (a).

Run: .venv/bin/python benchmarks/bench_kv_events.py [--requests 48] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, timed, write_json  # noqa: E402

import zmq  # noqa: E402

from sgl.radix import RadixTree  # noqa: E402
from sgl.runtime.engine import Engine  # noqa: E402
from sgl.runtime.kv_events.pages import PageTracker  # noqa: E402


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 40000) for _ in range(rng.randrange(150, 300))] for _ in range(6)]
    return [rng.choice(systems) + [rng.randrange(100, 40000) for _ in range(rng.randrange(20, 80))] for _ in range(n)]


def drain(endpoint: str, stop: threading.Event, counts: dict[str, int]) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    while not stop.is_set():
        if sub.poll(100):
            counts["batches"] += 1
            counts["bytes"] += len(sub.recv_multipart()[2])
    ctx.destroy(linger=0)


def run_engine(prompts: list[list[int]], new_tokens: int, events: bool, pool: int) -> dict:
    kw: dict = {"max_total_tokens": pool}
    counts = {"batches": 0, "bytes": 0}
    stop = threading.Event()
    if events:
        port = 45557
        kw["kv_events_config"] = json.dumps({"endpoint": f"tcp://*:{port}"})
        t = threading.Thread(target=drain, args=(f"tcp://127.0.0.1:{port}", stop, counts), daemon=True)
        t.start()
    eng = Engine(**kw)
    try:
        sp = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
        eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})  # warm-up
        eng.flush_cache()
        secs, outs = timed(lambda: eng.generate(input_ids=prompts, sampling_params=sp))
        info = eng.get_server_info()
    finally:
        eng.shutdown()
        stop.set()
    tokens = sum(o["meta_info"]["prompt_tokens"] - o["meta_info"]["cached_tokens"] + o["meta_info"]["completion_tokens"]
                 for o in outs)
    gen = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"events": events, "seconds": secs, "gen_tok_s": gen / secs, "computed_tok_s": tokens / secs,
            "forward_passes": info["num_forward_passes"], "step_ms": 1000 * secs / max(1, info["num_forward_passes"]),
            "event_batches": counts["batches"], "event_bytes": counts["bytes"]}


def tracker_cost(prompts: list[list[int]], page_size: int = 16, reps: int = 5) -> dict:
    """Insert the workload into a bare tree with and without the tracker (min of reps)."""
    def once(observe: bool) -> float:
        tree = RadixTree()
        if observe:
            tree.observer = PageTracker(page_size)
        slot = 0
        t0 = time.perf_counter()
        for p in prompts:
            tree.match_prefix(p[: len(p) // 2])  # splits, as admission does
            tree.insert(p, list(range(slot, slot + len(p))))
            slot += len(p)
            if tree.observer is not None:
                tree.observer.take_events()
        return time.perf_counter() - t0
    plain = min(once(False) for _ in range(reps))
    tracked = min(once(True) for _ in range(reps))
    tree = RadixTree()
    tracker = PageTracker(page_size)
    tree.observer = tracker
    for i, p in enumerate(prompts):
        tree.insert(p, list(range(i * 10_000, i * 10_000 + len(p))))
    pages = len(tracker.held_hashes())
    return {"plain_ms": plain * 1e3, "tracked_ms": tracked * 1e3, "pages": pages,
            "us_per_page": (tracked - plain) * 1e6 / max(1, pages)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--pool", type=int, default=4096)
    args = ap.parse_args()
    prompts = workload(args.requests)
    off = run_engine(prompts, args.new_tokens, False, args.pool)
    on = run_engine(prompts, args.new_tokens, True, args.pool)
    micro = tracker_cost(workload(2000, seed=1))
    ratio = on["gen_tok_s"] / off["gen_tok_s"]
    print_table("engine, kv events off vs on (one run each)", [
        {"kv events": "on" if r["events"] else "off", "s": r["seconds"], "gen tok/s": r["gen_tok_s"],
         "computed tok/s": r["computed_tok_s"], "steps": r["forward_passes"], "ms/step": r["step_ms"],
         "batches": r["event_batches"], "bytes": r["event_bytes"]} for r in (off, on)])
    per_step_us = micro["us_per_page"] * (sum(len(p) for p in prompts) / 16) / max(1, on["forward_passes"])
    print(f"on/off throughput: {ratio:.3f}; tracker {micro['us_per_page']:.1f} us/page "
          f"(~{per_step_us:.0f} us/step here = {100 * per_step_us / 1000 / on['step_ms']:.3f}% of a step)")
    write_json("bench_kv_events.json", {"off": off, "on": on, "ratio": ratio, "tracker": micro,
                             "tracker_us_per_step": per_step_us})


if __name__ == "__main__":
    main()
