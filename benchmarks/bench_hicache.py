"""Hierarchical KV cache benchmark (issue #14): radix only vs + host tier vs + file vs + redis.

Workload: `--docs` documents of `--doc-tokens` token ids each (default 40 x 1,500: ~60k
tokens of reusable prefixes against a device pool of `--max-total-tokens`, default 4,096),
each asked `--questions` short questions (a few token ids appended), all requests in one
seeded random order, greedy, `--max-tokens` new tokens, streamed, `--concurrency` clients
in a closed loop. The same sequence is replayed against each configuration, each a fresh
`sgl.launch_server` process:

  radix     no hierarchical cache (today's radix tree: evicted KV is recomputed)
  host      + host tier big enough for the working set (`--host-ratio`, default 20x the pool)
  file      + a small host tier (2x) and the file storage tier in a temp directory
  redis     + a small host tier (2x) and a real redis-server (tests/redis_proc.py)

Reported per configuration: prompt-token hit rate (sum cached_tokens / sum prompt_tokens)
and its split by tier (cached_tokens_details), TTFT p50/p99 (first streamed chunk),
throughput (requests/s, first send to last finish), errors; and the ratio to radix only.
Then the cost of 1,024 tokens of KV from each tier vs recomputing them (ms): recompute =
latency of a fresh 1,024-token prompt minus that of the same prompt fully cached (radix
server, 1 new token); host = the host -> device copy (HostKVPool.load); file / redis =
read + verify + fill of the 64 pages from the backend, plus the host -> device copy. The
copies use the served model's KV layout and dtype.

`--rounds N` runs the configurations N times in turn (radix, host, ..., radix, host, ...),
each round's file and redis rows from an empty store; the table shows medians, and `x radix`
is the median of each round's ratio to that round's radix row: this host's speed drifts
~10% over minutes, which one round per configuration cannot tell from a change.

Run: .venv/bin/python benchmarks/bench_hicache.py [--quick] [--configs radix,host,file,redis] [--rounds N]
Writes benchmarks/results/bench_hicache[.quick].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, print_table, write_json  # noqa: E402
from procs import Proc, free_port  # noqa: E402
from sse import StreamFailed, sse_frames  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
PAGE = 16
LOAD_TOKENS = 1024


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    docs = [[rng.randrange(1000, 20000) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    reqs = [docs[d] + [rng.randrange(1000, 20000) for _ in range(rng.randrange(8, 24))]
            for d in range(args.docs) for _ in range(args.questions)]
    rng.shuffle(reqs)
    return reqs


def scratch_dir() -> tempfile.TemporaryDirectory[str]:
    """An empty folder for this run's stores, removed after it, in the cache folder: where a
    file store lives by default (`storage.file.default_path`). Not /tmp: on this project's
    hosts creating a file under /tmp measured 0.26-0.88 ms of CPU against 15-19 us in the
    cache folder on the same disk, and the file tier creates one file per page."""
    from sgl.runtime.config import cache_dir

    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix="bench-hicache-", dir=root)


def server_args(name: str, args: argparse.Namespace, tmp: str, redis_url: str | None) -> list[str]:
    base = ["--max-total-tokens", str(args.max_total_tokens), "--page-size", str(PAGE), "--dtype", args.dtype,
            "--no-access-log",
            "--log-level", "warning", *shlex.split(args.server_args)]
    if name == "radix":
        return base
    hi = base + ["--enable-hierarchical-cache", "--hicache-write-policy", args.write_policy]
    if name == "host":
        return hi + ["--hicache-ratio", str(args.host_ratio)]
    hi += ["--hicache-ratio", "2", "--hicache-storage-prefetch-policy", args.prefetch_policy]
    if name == "file":
        return hi + ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
                     json.dumps({"path": os.path.join(tmp, "file-store")})]
    assert name == "redis" and redis_url
    return hi + ["--hicache-storage-backend", "redis", "--hicache-storage-backend-extra-config",
                 json.dumps({"url": redis_url})]


def server_proc(name: str, args: argparse.Namespace, tmp: str, redis_url: str | None) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "sgl.launch_server", "--host", "127.0.0.1", "--port", str(port),
           *server_args(name, args, tmp, redis_url)]
    p = Proc(name, cmd, f"http://127.0.0.1:{port}/health", cwd=REPO)
    p.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return p


async def one(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    body = {"input_ids": ids, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}
    try:
        async for frame in sse_frames(client, url + "/generate", body):
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = frame
    except StreamFailed as e:
        return {"error": str(e)}
    meta = last.get("meta_info", {})
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "prompt": meta.get("prompt_tokens", len(ids)),
            "cached": meta.get("cached_tokens", 0), "details": meta.get("cached_tokens_details") or {}}


async def run_workload(url: str, reqs: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    queue = list(enumerate(reqs))
    results: list[dict[str, Any]] = [{} for _ in reqs]

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            i, ids = queue.pop(0)
            try:
                results[i] = await one(client, url, ids, args.max_tokens)
            except httpx.HTTPError as e:
                results[i] = {"error": repr(e)}

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    prompt = sum(r["prompt"] for r in ok)
    tiers = {t: sum(r["details"].get(t, 0) for r in ok) for t in ("device", "host", "storage")}
    if not any(tiers.values()):
        tiers["device"] = sum(r["cached"] for r in ok)  # no hierarchical cache: all hits are on the device
    return {"requests": len(reqs), "errors": len(reqs) - len(ok), "wall_s": wall, "req_s": len(ok) / wall,
            "hit_rate": sum(r["cached"] for r in ok) / max(prompt, 1),
            **{f"hit_{t}": n / max(prompt, 1) for t, n in tiers.items()},
            "ttft_p50": _pct(ttfts, 50), "ttft_p99": _pct(ttfts, 99)}


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def recompute_ms(url: str, reps: int, n: int) -> float:
    """Latency of a fresh n-token prompt minus the same prompt fully cached (1 new token), per 1k tokens."""
    rng = random.Random(7)
    diffs = []
    with httpx.Client(timeout=600, trust_env=False) as c:
        for _ in range(reps):
            ids = [rng.randrange(1000, 20000) for _ in range(n + 1)]
            body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
            t0 = time.perf_counter()
            c.post(url + "/generate", json=body).raise_for_status()
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            c.post(url + "/generate", json=body).raise_for_status()
            diffs.append(cold - (time.perf_counter() - t0))
    return statistics.median(diffs) * 1e3 * LOAD_TOKENS / n


def tier_load_ms(info: dict[str, Any], tmp: str, redis_url: str | None, reps: int) -> dict[str, float]:
    """ms to bring LOAD_TOKENS tokens of KV to the device pool from each tier (see the docstring),
    in the served model's layout (layers, KV heads of one rank, head size) and KV dtype."""
    import torch

    from sgl.runtime.memory.host_pool import HostKVPool
    from sgl.runtime.memory.kv_pool import KVPool
    from sgl.runtime.memory.storage import PageStore, make_backend, page_key
    from sgl.runtime.models.loader import read_model_config, resolve_model_dir

    dtype = getattr(torch, str(info.get("dtype", "bfloat16")).replace("torch.", ""))
    mc = read_model_config(resolve_model_dir(None)[0])  # the benchmark serves the default model
    layers, heads, dim = mc.num_layers, mc.num_kv_heads, mc.head_dim
    torch.set_num_threads(min(2, os.cpu_count() or 1))  # as a worker of this host runs its copies
    n_pages = LOAD_TOKENS // PAGE
    pool = KVPool(LOAD_TOKENS * 2, layers, heads, dim, dtype)
    host = HostKVPool(n_pages, PAGE, layers, heads, dim, dtype)
    for k in pool.k_buffers:
        k.normal_()
    host.store(pool, [(p, list(range(p * PAGE, (p + 1) * PAGE))) for p in range(n_pages)])
    loads = [(p, 0, list(range(LOAD_TOKENS + p * PAGE, LOAD_TOKENS + (p + 1) * PAGE))) for p in range(n_pages)]
    blobs = [host.read(p) for p in range(n_pages)]

    def best(fn: Any) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    out = {"host": best(lambda: host.load(pool, loads))}
    from sgl.runtime.memory.storage.heap import keep_page_buffers_in_heap

    keep_page_buffers_in_heap()  # as a worker with a storage tier runs (worker/build.py)
    stores: dict[str, Any] = {"file": ("file", {"path": os.path.join(tmp, "load-bench")})}
    if redis_url:
        stores["redis"] = ("redis", {"url": redis_url})
    for name, (kind, cfg) in stores.items():
        store = PageStore(make_backend(kind, cfg, "bench-load"))
        keys = [page_key("bench-load", p + 1) for p in range(n_pages)]
        store.set(keys, blobs)

        def fetch(store: PageStore = store, keys: list[str] = keys) -> None:
            got = store.get_prefix(keys)
            assert len(got) == n_pages
            for p, blob in enumerate(got):
                host.fill(p, blob)
            host.load(pool, loads)

        out[name] = best(fetch)
        store.clear()
        store.close()
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=40)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--questions", type=int, default=4, help="questions per document")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=4096, help="device KV pool")
    p.add_argument("--host-ratio", type=float, default=20.0, help="host tier of the 'host' config (x device)")
    p.add_argument("--dtype", default="auto", help="server --dtype (float32 prefills ~4x faster than bfloat16 on AVX2-only CPUs)")
    p.add_argument("--write-policy", default="write_through")
    p.add_argument("--prefetch-policy", default="timeout")
    p.add_argument("--configs", default="radix,host,file,redis")
    p.add_argument("--server-args", default="", help="extra sgl.launch_server flags for every configuration")
    p.add_argument("--reps", type=int, default=5, help="repetitions of the 1k-token cost measurements")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, in turn; the table shows medians")
    p.add_argument("--quick", action="store_true", help="smoke run: 6 docs x 400 tokens, 2 questions, 1 rep")
    a = p.parse_args()
    if a.quick:
        a.docs, a.doc_tokens, a.questions, a.reps, a.max_total_tokens = 6, 400, 2, 1, 1024
    return a


def summary_row(name: str, rs: list[dict[str, Any]], radix: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One config's table row: medians over the rounds; `x radix` is the median of each
    round's ratio to the radix row of the same round (the host's speed drifts between rounds)."""
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rs)
    ratios = [r["req_s"] / b["req_s"] for r, b in zip(rs, radix or []) if b["req_s"]]
    row = {"config": name, "hit rate": med("hit_rate"), "host hit": med("hit_host"),
           "storage hit": med("hit_storage"), "req/s": med("req_s"),
           "x radix": statistics.median(ratios) if ratios else "",
           "TTFT p50 s": med("ttft_p50"), "TTFT p99 s": med("ttft_p99"), "errors": sum(r["errors"] for r in rs)}
    if len(rs) > 1:
        row["x radix per round"] = " / ".join(f"{x:.2f}" for x in ratios)
    return row


def main() -> int:
    args = parse_args()
    from tests.redis_proc import start_redis

    configs = args.configs.split(",")
    reqs = workload(args)
    print(f"cpu: {cpu_model()}; {len(reqs)} requests over {args.docs} docs x {args.doc_tokens} tokens, "
          f"device pool {args.max_total_tokens} tokens", flush=True)
    results: dict[str, Any] = {}  # the last round's result per config
    rounds: dict[str, list[dict[str, Any]]] = {}
    costs: dict[str, float] = {}
    with ExitStack() as stack, scratch_dir() as tmp:
        redis = start_redis() if "redis" in configs else None
        if redis is not None:
            stack.callback(redis.stop)
        for rnd in range(args.rounds):
            for name in configs:
                if redis is not None and name == "redis" and rnd:
                    redis.restart()  # an empty store (no persistence), as the first round had
                with server_proc(name, args, tmp, redis.url if redis else None) as srv:
                    url = srv.url  # type: ignore[attr-defined]
                    r = asyncio.run(run_workload(url, reqs, args))
                    rounds.setdefault(name, []).append(r)
                    results[name] = r
                    print(f"  {name}: hit {r['hit_rate']:.3f} (device {r['hit_device']:.3f} host {r['hit_host']:.3f} "
                          f"storage {r['hit_storage']:.3f}), {r['req_s']:.2f} req/s, TTFT p50 {r['ttft_p50']:.3f} s "
                          f"p99 {r['ttft_p99']:.3f} s, errors {r['errors']}", flush=True)
                    if name == configs[0] and rnd == 0:
                        info = httpx.get(url + "/get_server_info", timeout=60).json()
                        costs["recompute"] = recompute_ms(url, args.reps, min(LOAD_TOKENS, args.max_total_tokens // 2))
                        costs.update(tier_load_ms(info, tmp, redis.url if redis else None, max(args.reps, 3)))
                if name == "file":  # the next round's file row starts from an empty directory too
                    shutil.rmtree(os.path.join(tmp, "file-store"), ignore_errors=True)
    rows = [summary_row(n, rs, rounds.get("radix")) for n, rs in rounds.items()]
    print_table(f"{len(reqs)} requests, {args.docs} docs x {args.doc_tokens} tokens x {args.questions} questions, "
                f"concurrency {args.concurrency}, device pool {args.max_total_tokens}", rows)
    cost_rows = [{"source": k, "ms per 1k tokens": v,
                  "x faster than recompute": costs["recompute"] / v if k != "recompute" and v > 0 else ""}
                 for k, v in costs.items()]
    print_table("bringing 1,024 tokens of KV to the device pool", cost_rows)
    write_json("bench_hicache.quick.json" if args.quick else "bench_hicache.json",
               {"args": vars(args), "rows": rows, "results": results, "rounds": rounds, "load_cost_ms": costs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
