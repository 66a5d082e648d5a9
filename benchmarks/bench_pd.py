"""PD disaggregation benchmark (issue #15): colocated workers vs a prefill + decode pair.

Workload (the same arrival sequence for every setup): short chats that stream their answer
(`--chats` requests, Poisson at `--chat-rate`/s, `--chat-tokens` new tokens each, greedy,
/v1/chat/completions) while long-prompt requests arrive among them (`--long` requests of
~`--long-prompt-tokens` tokens, Poisson at `--long-rate`/s, `--long-new-tokens` new tokens,
streamed /generate). Every prompt is distinct, so nothing is served from a cache.

Setups (`--setups`, default all):
  colo1       1 colocated worker, no router
  colo2       2 colocated workers behind our router (`--policy cache_aware`)
  pd          1 prefill + 1 decode worker behind our router in PD mode
  pd-wait     the same with `--pd-wait-for-prefill` (sglang-router 0.3.2's behaviour: the
              decode's stream is held until the prefill's HTTP answer has ended), to show
              what passing the decode's stream on at once saves in time to first token

Each worker gets `--threads` torch threads (1 by default: on 2 cores two workers would
otherwise fight over them) and a `--pool`-token KV pool. Reported per setup: TTFT p50/p99
(chats, and long requests apart), inter-token latency p50/p99 of the streaming chats (gaps
between content chunks), throughput (output tokens/s and requests/s from the first arrival
to the last finish), errors, and for PD the KV transfer: GB/s (sum of bytes / sum of time)
and ms per 1k tokens, from the decode worker's `meta_info` fields `kv_copy_ms` (the
prefill's gather, the wire and the decode's scatter into its pool), `kv_transfer_bytes` and
`kv_transfer_tokens` on the long requests. (`kv_transfer_ms`, from the decode's pull to the
KV in its pool, also counts the prefill's queueing and compute.)

Run: .venv/bin/python benchmarks/bench_pd.py [--quick] [--setups colo1,pd]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
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
SETUPS = ("colo1", "colo2", "pd", "pd-wait")
_WORDS = ("river mountain paper window garden silver engine market winter yellow orange planet signal "
          "harbor castle forest bridge rocket letter camera spring shadow pocket button circle island "
          "ladder mirror needle pillow rabbit saddle temple tunnel valley violin wagon whistle basket "
          "candle dragon feather glove hammer jacket kettle lemon marble napkin parrot puzzle ribbon").split()
TOKENS_PER_WORD = 1.03  # measured: 1,165 of these words made 1,194 tokens with the embedded model's tokenizer


def long_prompt(i: int, tokens: int) -> str:
    rng = random.Random(7000 + i)
    words = [rng.choice(_WORDS) for _ in range(int(tokens / TOKENS_PER_WORD))]
    return f"Document {i}: " + " ".join(words) + "\nSummarize the document in one sentence:"


def workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    out: list[dict[str, Any]] = []
    t = 0.0
    for i in range(args.chats):
        t += rng.expovariate(args.chat_rate)
        out.append({"at": t, "kind": "chat", "i": i})
    t = args.long_start
    for i in range(args.long):
        t += rng.expovariate(args.long_rate)
        out.append({"at": t, "kind": "long", "i": i})
    return sorted(out, key=lambda r: r["at"])


# -- processes --------------------------------------------------------------------------


def worker(name: str, args: argparse.Namespace, *extra: str) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "sgl.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--max-total-tokens", str(args.pool), "--num-threads", str(args.threads), "--dtype", args.dtype,
           "--cpu-decode-threads", str(min(args.threads, 2)), "--no-access-log", "--log-level", "warning", *extra]
    p = Proc(name, cmd, f"http://127.0.0.1:{port}/health", cwd=REPO, env={"PYTHONPATH": str(REPO)})
    p.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return p


def router(name: str, *flags: str) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "sgl.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warn", *flags]
    p = Proc(name, cmd, f"http://127.0.0.1:{port}/health", cwd=REPO, env={"PYTHONPATH": str(REPO)},
             start_timeout=120)
    p.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return p


# -- one request ------------------------------------------------------------------------


async def chat(c: httpx.AsyncClient, base: str, i: int, max_tokens: int) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": f"Chat {i}: tell me a short story about a {_WORDS[i % 50]}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    try:
        async for chunk in sse_frames(c, f"{base}/v1/chat/completions", body):
            if any((ch.get("delta") or {}).get("content") for ch in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    except StreamFailed as e:
        return {"ok": False, "error": str(e)}
    if not stamps:
        return {"ok": False, "error": "no content"}
    return {"ok": True, "kind": "chat", "ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": len(stamps), "end": stamps[-1]}


async def long_request(c: httpx.AsyncClient, base: str, i: int, args: argparse.Namespace) -> dict[str, Any]:
    body = {"text": long_prompt(i, args.long_prompt_tokens), "stream": True,
            "sampling_params": {"max_new_tokens": args.long_new_tokens, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    first, last = None, None
    try:
        async for frame in sse_frames(c, f"{base}/generate", body):
            first = first or time.perf_counter()
            last = frame
    except StreamFailed as e:
        return {"ok": False, "error": str(e)}
    if first is None or last is None:
        return {"ok": False, "error": "no frames"}
    m = last.get("meta_info", {})
    return {"ok": True, "kind": "long", "ttft": first - t0, "tokens": m.get("completion_tokens", 0),
            "prompt_tokens": m.get("prompt_tokens", 0), "end": time.perf_counter(),
            "kv_ms": m.get("kv_copy_ms"), "kv_bytes": m.get("kv_transfer_bytes"),
            "kv_tokens": m.get("kv_transfer_tokens")}


async def run(base: str, reqs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0), trust_env=False) as c:
        await chat(c, base, 10_000, 2)  # warm up the path (and the server's first-call costs)
        t0 = time.perf_counter()

        async def one(r: dict[str, Any]) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, t0 + r["at"] - time.perf_counter()))
            try:
                if r["kind"] == "chat":
                    return await chat(c, base, r["i"], args.chat_tokens)
                return await long_request(c, base, r["i"], args)
            except httpx.HTTPError as e:
                return {"ok": False, "error": f"{type(e).__name__}: {e}"}

        outs = await asyncio.gather(*(one(r) for r in reqs))
    ok = [o for o in outs if o["ok"]]
    secs = max((o["end"] for o in ok), default=t0) - t0
    chats, longs = [o for o in ok if o["kind"] == "chat"], [o for o in ok if o["kind"] == "long"]
    itl = sorted(x for o in chats for x in o["itl"])
    res: dict[str, Any] = {
        "requests": len(outs), "errors": len(outs) - len(ok), "seconds": secs,
        "req_s": len(ok) / secs if secs > 0 else 0.0,
        "out_tok_s": sum(o["tokens"] for o in ok) / secs if secs > 0 else 0.0,
        "chat_ttft_p50": pct(sorted(o["ttft"] for o in chats), 0.5),
        "chat_ttft_p99": pct(sorted(o["ttft"] for o in chats), 0.99),
        "long_ttft_p50": pct(sorted(o["ttft"] for o in longs), 0.5),
        "long_ttft_p99": pct(sorted(o["ttft"] for o in longs), 0.99),
        "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99),
        "long_prompt_tokens_mean": (sum(o["prompt_tokens"] for o in longs) / len(longs)) if longs else 0,
        "error_samples": [o["error"] for o in outs if not o["ok"]][:3],
    }
    moved = [o for o in longs if o.get("kv_ms") is not None and o.get("kv_bytes")]
    if moved:
        ms, nbytes = sum(o["kv_ms"] for o in moved), sum(o["kv_bytes"] for o in moved)
        ntok = sum(o["kv_tokens"] or 0 for o in moved)
        res["kv_gb_s"] = nbytes / 1e9 / (ms / 1e3) if ms > 0 else float("nan")
        res["kv_ms_per_1k_tokens"] = ms / ntok * 1000 if ntok else float("nan")
        res["kv_transfers"] = len(moved)
    return res


def pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def flush(urls: list[str]) -> None:
    with httpx.Client(timeout=30.0, trust_env=False) as c:
        for u in urls:
            for _ in range(40):  # refused while requests still drain
                if c.post(f"{u}/flush_cache").status_code == 200:
                    break
                time.sleep(0.5)


# -- main -------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    p.add_argument("--chats", type=int, default=24)
    p.add_argument("--chat-rate", type=float, default=0.5, help="Poisson arrivals of chats, per second")
    p.add_argument("--chat-tokens", type=int, default=32)
    p.add_argument("--long", type=int, default=8)
    p.add_argument("--long-rate", type=float, default=0.2, help="Poisson arrivals of long prompts, per second")
    p.add_argument("--long-start", type=float, default=4.0, help="seconds before the first long prompt may arrive")
    p.add_argument("--long-prompt-tokens", type=int, default=1500)
    p.add_argument("--long-new-tokens", type=int, default=8)
    p.add_argument("--pool", type=int, default=16384, help="KV pool of each worker, in tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    p.add_argument("--dtype", default="auto", help="workers' --dtype (float32 prefills ~4x faster than bfloat16 on AVX2-only CPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-name", default=None, help="results file name (default bench_pd.json)")
    p.add_argument("--quick", action="store_true", help="smoke run: 6 chats, 2 ~1,000-token prompts, short answers "
                   "(about 9 minutes on 2 shared cores)")
    a = p.parse_args()
    if a.quick:
        a.chats, a.long, a.chat_tokens, a.long_new_tokens, a.long_start, a.long_rate = 6, 2, 8, 4, 1.0, 0.5
        a.chat_rate, a.pool, a.long_prompt_tokens = 1.0, 8192, 1000
    bad = set(a.setups.split(",")) - set(SETUPS)
    if bad:
        p.error(f"--setups: unknown {', '.join(sorted(bad))}; choose from {', '.join(SETUPS)}")
    return a


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_setup(name: str, base: str, workers: list[str], reqs: list[dict[str, Any]],
              args: argparse.Namespace, results: dict[str, Any]) -> None:
    flush(workers)
    res = asyncio.run(run(base, reqs, args))
    results[name] = res
    kv = f", KV {res['kv_gb_s']:.2f} GB/s, {res['kv_ms_per_1k_tokens']:.1f} ms/1k tok" if "kv_gb_s" in res else ""
    print(f"  {name}: chat TTFT p50 {res['chat_ttft_p50']:.3f} s p99 {res['chat_ttft_p99']:.3f} s, ITL p50 "
          f"{res['itl_p50'] * 1e3:.1f} ms p99 {res['itl_p99'] * 1e3:.1f} ms, long TTFT p50 "
          f"{res['long_ttft_p50']:.2f} s, {res['out_tok_s']:.1f} tok/s, errors {res['errors']}{kv}", flush=True)


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # unwind through the ExitStack: no process left behind
    setups = args.setups.split(",")
    cpu = cpu_model()
    print(f"cpu: {cpu}, {os.cpu_count()} logical cores; {args.threads} torch thread(s) per worker, "
          f"pool {args.pool} tokens", flush=True)
    reqs = workload(args)
    results: dict[str, Any] = {}
    try:
        if {"colo1", "colo2"} & set(setups):
            with ExitStack() as stack:
                n = 2 if "colo2" in setups else 1
                ws = [stack.enter_context(worker(f"colo{i}", args)) for i in range(n)]
                urls = [w.url for w in ws]  # type: ignore[attr-defined]
                if "colo1" in setups:
                    run_setup("colo1", urls[0], urls[:1], reqs, args, results)
                if "colo2" in setups:
                    with router("router-colo2", "--worker-urls", *urls, "--policy", "cache_aware") as r:
                        run_setup("colo2", r.url, urls, reqs, args, results)  # type: ignore[attr-defined]
        if {"pd", "pd-wait"} & set(setups):
            with ExitStack() as stack:
                bport = free_port()
                pd = ("--disaggregation-bootstrap-port", str(bport))
                p = stack.enter_context(worker("prefill", args, "--disaggregation-mode", "prefill", *pd))
                d = stack.enter_context(worker("decode", args, "--disaggregation-mode", "decode", *pd))
                urls = [p.url, d.url]  # type: ignore[attr-defined]
                for name in ("pd", "pd-wait"):
                    if name not in setups:
                        continue
                    extra = ["--pd-wait-for-prefill"] if name == "pd-wait" else []
                    with router(f"router-{name}", "--pd-disaggregation", "--prefill", urls[0], str(bport),
                                "--decode", urls[1], "--prefill-policy", "cache_aware", *extra) as r:
                        run_setup(name, r.url, urls, reqs, args, results)  # type: ignore[attr-defined]
    except ProcFailed as e:
        print(f"FAILED: {e}", flush=True)
        results["failed"] = str(e)[:2000]
    rows = []
    for name, r in results.items():
        if name == "failed":
            continue
        rows.append({"setup": name, "chat TTFT p50 s": r["chat_ttft_p50"], "chat TTFT p99 s": r["chat_ttft_p99"],
                     "long TTFT p50 s": r["long_ttft_p50"], "long TTFT p99 s": r["long_ttft_p99"],
                     "ITL p50 ms": r["itl_p50"] * 1e3, "ITL p99 ms": r["itl_p99"] * 1e3,
                     "out tok/s": r["out_tok_s"], "req/s": r["req_s"], "errors": r["errors"],
                     "KV GB/s": r.get("kv_gb_s", ""), "KV ms/1k tok": r.get("kv_ms_per_1k_tokens", "")})
    print_table(f"{args.chats} streaming chats ({args.chat_tokens} tokens, {args.chat_rate}/s) + {args.long} prompts "
                f"of ~{args.long_prompt_tokens} tokens ({args.long_rate}/s); {args.threads} thread(s) per worker "
                f"(host: {cpu})", rows)
    write_json(args.json_name or ("bench_pd.quick.json" if args.quick else "bench_pd.json"),
               {"args": vars(args), "rows": rows, "results": results})
    return 1 if "failed" in results else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
