"""Router benchmark (issue #13): routing policies over the same 3 workers, in one run.

Workload: a multi-tenant chat service. `--tenants` system prompts of ~600 tokens each,
many users per tenant asking short questions (`--requests` in all), Poisson arrivals at
`--rate` req/s, the tenant of each request drawn uniformly, short answers (`--max-tokens`),
greedy, streamed (`stream_options.include_usage`, so the last chunk has the usage).
The same arrival sequence is replayed for every router.

Workers: 3 real `sgl.launch_server` processes with small KV pools (`--max-total-tokens`,
default 4096: about 6 of the 16 system prompts fit on one worker, all 16 fit on three
only if each worker keeps its own tenants) and 1 torch thread each (3 workers share the
machine's cores), KV events on (the `kv_aware` policy reads them). Each worker's cache is
flushed before every router's run, and each router starts fresh.

Routers: ours (`python -m sgl.launch_router`) with `kv_aware`, `cache_aware` and
`round_robin`; SGLang's `sglang-router` 0.3.2 from PyPI with `cache_aware` (installed
into a temp folder on first use). Reported per router: aggregate cache hit rate
(sum cached_tokens / sum prompt_tokens over all requests, from the workers' own usage
figures), throughput (requests / seconds from the first arrival to the last finish), TTFT
p50/p99 (first content chunk), and errors. Then router overhead: sequential pairs of the
same tiny cached request sent directly to a worker and through the router, interleaved;
overhead = p50 of the per-pair differences (see `overhead`).

Run: .venv/bin/python benchmarks/bench_router.py [--quick] [--requests N] [--rate R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, print_table, write_json  # noqa: E402
from procs import Proc, ProcFailed, free_port  # noqa: E402
from sse import StreamFailed, sse_frames  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SGLANG_ROUTER = "sglang-router==0.3.2"
SGLANG_ROUTER_DEPS = ["setproctitle", "orjson", "aiohttp"]

_WORDS = ("account billing invoice refund policy customer order shipping delivery warranty product service "
          "support ticket escalation priority region contract renewal discount payment card bank transfer "
          "subscription plan upgrade downgrade cancel notice period data privacy security password login "
          "device mobile desktop browser network outage status incident report manager team schedule hours "
          "weekend holiday language tone polite concise apology compensation voucher credit limit fee tax "
          "receipt address change verify identity document upload form deadline reminder email phone chat").split()


def system_prompt(tenant: int, words: int) -> str:
    rng = random.Random(1000 + tenant)
    rules = []
    while sum(len(r.split()) for r in rules) < words:
        rules.append(f"Rule {len(rules) + 1}: " + " ".join(rng.choice(_WORDS) for _ in range(12)) + ".")
    return (f"You are the assistant of company number {tenant} ({rng.choice(_WORDS)} division). "
            "Answer in at most one short sentence. " + " ".join(rules))


def workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The arrival sequence: (time offset, tenant, question), the same for every router."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        tenant = rng.randrange(args.tenants)
        q = f"User {i}: what does rule {rng.randint(1, 20)} say about {rng.choice(_WORDS)}?"
        out.append({"at": t, "tenant": tenant, "question": q})
    return out


# -- processes --------------------------------------------------------------------------


def worker_proc(i: int, args: argparse.Namespace) -> Proc:
    port, events = free_port(), free_port()
    kv = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}", "topic": "kv-events",
          "enable_kv_cache_events": True}
    cmd = [sys.executable, "-m", "sgl.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--max-total-tokens", str(args.max_total_tokens), "--num-threads", "1", "--cpu-decode-threads", "1",
           "--kv-events-config", json.dumps(kv), "--no-access-log", "--log-level", "warning"]
    p = Proc(f"worker{i}", cmd, f"http://127.0.0.1:{port}/health", cwd=REPO, env={"PYTHONPATH": str(REPO)})
    p.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return p


def sglang_router_path() -> Path:
    target = Path(tempfile.gettempdir()) / "sgl-bench-sglang-router-0.3.2"
    if not (target / "sglang_router").exists():
        print(f"installing {SGLANG_ROUTER} into {target}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target), SGLANG_ROUTER,
                        *SGLANG_ROUTER_DEPS], check=True)
    return target


def router_proc(kind: str, policy: str, workers: list[str]) -> Proc:
    port, prom = free_port(), free_port()
    common = ["--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
              "--prometheus-port", str(prom), "--prometheus-host", "127.0.0.1", "--log-level", "warn"]
    if kind == "sgl":
        cmd, env = [sys.executable, "-m", "sgl.launch_router", *common], {"PYTHONPATH": str(REPO)}
    else:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", *common]
        env = {"PYTHONPATH": str(sglang_router_path())}
    p = Proc(f"{kind}-{policy}", cmd, f"http://127.0.0.1:{port}/health", cwd=REPO, env=env, start_timeout=120)
    p.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return p


# -- one request, one run ---------------------------------------------------------------


async def chat(client: httpx.AsyncClient, base: str, system: str, question: str, max_tokens: int) -> dict[str, Any]:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage = None, None
    try:
        async for chunk in sse_frames(client, f"{base}/v1/chat/completions", body):
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    except StreamFailed as e:
        return {"ok": False, "error": str(e)}
    if usage is None:
        return {"ok": False, "error": "no usage chunk"}
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return {"ok": True, "ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "e2e": time.perf_counter() - t0, "prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached}


async def run_workload(base: str, reqs: list[dict[str, Any]], systems: list[str], max_tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0, connect=30.0), trust_env=False) as c:
        t0 = time.perf_counter()

        async def one(r: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, t0 + r["at"] - time.perf_counter()))
            try:
                return await chat(c, base, systems[r["tenant"]], r["question"], max_tokens)
            except httpx.HTTPError as e:
                return {"ok": False, "error": f"{type(e).__name__}: {e}"}

        outs = await asyncio.gather(*(one(r) for r in reqs))
        secs = time.perf_counter() - t0
    ok = [o for o in outs if o["ok"]]
    prompt, cached = sum(o["prompt_tokens"] for o in ok), sum(o["cached_tokens"] for o in ok)
    ttfts = sorted(o["ttft"] for o in ok)
    return {"requests": len(outs), "errors": len(outs) - len(ok), "seconds": secs,
            "req_s": len(ok) / secs, "hit_rate": cached / prompt if prompt else 0.0,
            "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
            "error_samples": [o["error"] for o in outs if not o["ok"]][:3]}


def pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


async def flush_all(workers: list[str]) -> None:
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as c:
        for w in workers:
            for _ in range(40):  # refused while requests still drain
                if (await c.post(f"{w}/flush_cache")).status_code == 200:
                    break
                await asyncio.sleep(0.5)
            else:
                raise ProcFailed(f"{w}/flush_cache kept refusing")


async def overhead(direct: str, routed: str, pairs: int) -> dict[str, float]:
    """Router overhead: the same call sent directly to a worker and through the router,
    alternating, `pairs` times; the p50 of the per-pair differences. Two calls: a tiny
    cached /generate (routing + proxy + the worker's own variance) and GET /get_model_info
    (the proxy path alone, a few ms of worker time, so the difference is not drowned)."""
    body = {"text": "Say hi.", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as c:
        for label, method, path, kw in (("generate", "POST", "/generate", {"json": body}),
                                        ("model_info", "GET", "/get_model_info", {})):
            for base in (direct, routed):  # warm both paths (and the prompt's cache)
                for _ in range(3):
                    (await c.request(method, f"{base}{path}", **kw)).raise_for_status()
            diffs, d_all, r_all = [], [], []
            for _ in range(pairs):
                t = []
                for base in (direct, routed):
                    t0 = time.perf_counter()
                    (await c.request(method, f"{base}{path}", **kw)).raise_for_status()
                    t.append(time.perf_counter() - t0)
                d_all.append(t[0])
                r_all.append(t[1])
                diffs.append(t[1] - t[0])
            out[f"{label}_direct_p50_ms"] = statistics.median(d_all) * 1e3
            out[f"{label}_router_p50_ms"] = statistics.median(r_all) * 1e3
            out[f"{label}_overhead_p50_ms"] = statistics.median(diffs) * 1e3
    return out


def router_stats(base: str) -> dict[str, float]:
    """Our router's policy numbers (`sgl_router_<stat>{policy=...}` gauges) from /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=10.0, trust_env=False).text
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("sgl_router_") and "{policy=" in name:
            out[name.split("{")[0][len("sgl_router_"):]] = float(value)
    return out


# -- main -------------------------------------------------------------------------------


ROUTERS = [("sgl", "kv_aware"), ("sgl", "cache_aware"), ("sglang-router", "cache_aware"), ("sgl", "round_robin")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--system-words", type=int, default=430, help="~600 tokens with this model's tokenizer")
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--rate", type=float, default=0.4, help="Poisson arrival rate, requests/s (3 workers on 2 cores:"
                   " a cold ~600-token prefill takes seconds here)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool of each worker")
    p.add_argument("--overhead-pairs", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routers", default=",".join(f"{k}:{pol}" for k, pol in ROUTERS),
                   help="comma-separated kind:policy (kind sgl or sglang-router)")
    p.add_argument("--json-name", default=None, help="results file name (default bench_router.json)")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 tenants, 24 requests")
    a = p.parse_args()
    if a.quick:
        a.tenants, a.requests, a.overhead_pairs = 4, 24, 10
    return a


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # unwind through the ExitStack: no process left behind
    cpu = cpu_model()
    print(f"cpu: {cpu}, {os.cpu_count()} logical cores; 3 workers x 1 thread, pool {args.max_total_tokens} tokens")
    systems = [system_prompt(t, args.system_words) for t in range(args.tenants)]
    reqs = workload(args)
    routers = [tuple(x.split(":", 1)) for x in args.routers.split(",")]
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        workers = [stack.enter_context(worker_proc(i, args)) for i in range(3)]
        urls = [w.url for w in workers]  # type: ignore[attr-defined]
        print("workers up: " + " ".join(urls), flush=True)
        for kind, policy in routers:
            name = f"{kind} {policy}"
            asyncio.run(flush_all(urls))
            try:
                with router_proc(kind, policy, urls) as router:
                    res = asyncio.run(run_workload(router.url, reqs, systems, args.max_tokens))  # type: ignore[attr-defined]
                    res["policy_stats"] = router_stats(router.url) if kind == "sgl" else {}  # type: ignore[attr-defined]
                    res["overhead"] = asyncio.run(overhead(urls[0], router.url, args.overhead_pairs))  # type: ignore[attr-defined]
            except ProcFailed as e:
                print(f"{name} FAILED: {e}", flush=True)
                results[name] = {"failed": str(e)[:2000]}
                continue
            results[name] = res
            print(f"  {name}: hit {res['hit_rate']:.3f}, {res['req_s']:.2f} req/s, TTFT p50 {res['ttft_p50']:.3f} s"
                  f" p99 {res['ttft_p99']:.3f} s, errors {res['errors']}, overhead p50"
                  f" {res['overhead']['generate_overhead_p50_ms']:.2f} ms (/generate),"
                  f" {res['overhead']['model_info_overhead_p50_ms']:.2f} ms (proxy only)", flush=True)
            if res["policy_stats"]:
                print("    policy: " + ", ".join(f"{k}={v:g}" for k, v in sorted(res["policy_stats"].items())))
    rows = []
    rr = results.get("sgl round_robin", {})
    for name, r in results.items():
        if "failed" in r:
            rows.append({"router": name, "hit rate": "FAILED"})
            continue
        rows.append({"router": name, "hit rate": r["hit_rate"],
                     "hit x rr": r["hit_rate"] / rr["hit_rate"] if rr.get("hit_rate") else "",
                     "req/s": r["req_s"], "req/s x rr": r["req_s"] / rr["req_s"] if rr.get("req_s") else "",
                     "TTFT p50 s": r["ttft_p50"], "TTFT p99 s": r["ttft_p99"], "errors": r["errors"],
                     "overhead p50 ms /generate": r["overhead"]["generate_overhead_p50_ms"],
                     "overhead p50 ms proxy": r["overhead"]["model_info_overhead_p50_ms"]})
    print_table(f"{args.requests} chat requests, {args.tenants} tenants x ~600-token system prompt, Poisson "
                f"{args.rate}/s, {args.max_tokens} new tokens; 3 workers, {args.max_total_tokens}-token pools "
                f"(host: {cpu})", rows)
    write_json(args.json_name or ("bench_router.quick.json" if args.quick else "bench_router.json"),
               {"args": vars(args), "rows": rows, "results": results})
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
