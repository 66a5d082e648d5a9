"""Process split benchmark (issue #12): HTTP throughput before and after the engine moved
its scheduler and model out of the API process into worker processes, in one run.

Three real servers (`python -m sgl.launch_server`), one at a time, each measured over
HTTP: `before` (the last pre-split tree, commit 283ed7c, tp 1), `after` (this tree, tp 1)
and `after-tp2` (this tree, `--tp-size 2`). Workloads:

(a) shared prefix: 64 concurrent POST /generate, the few-shot prompts of bench_engine.py
    (one long prefix, a distinct question each), 16 new tokens, cache flushed before each
    repetition so every repetition starts cold; req/s.
(b) streams: 8 concurrent streaming POST /generate of 1,500 tokens each (ignore_eos);
    aggregate tokens/s and the mean time to the first chunk.

The systems run in order, then again in reverse order, so slow drift of a shared machine
(another tenant, thermal state) falls on every system alike; the table shows the median
over all repetitions of both passes, with ratios to `before`. The issue's bar: tp 1
`after` within 5% of `before` on both workloads.

On a 2-core machine tp 2 runs two ranks of one torch thread each beside the API process,
and pays a collective per layer, so it is expected to be slower than tp 1: its row shows
that tensor parallelism works end to end and what it costs here, not a speedup.

Run: .venv/bin/python benchmarks/bench_process_split.py [--before DIR] [--no-tp2] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import shared_prefix_prompts  # noqa: E402
from common import cpu_model, print_table, write_json  # noqa: E402
from procs import Proc, ProcFailed, free_port  # noqa: E402

ServerFailed = ProcFailed

import torch  # noqa: E402  (already loaded by common; here only for thread info)

REPO = Path(__file__).resolve().parent.parent
BEFORE_COMMIT = "283ed7c"  # the last commit before the process split
DEFAULT_BEFORE = Path("/tmp/sgl-before-split")
WITHIN = 0.05  # the bar: tp 1 after may be at most 5% slower than before


@dataclass
class System:
    name: str
    tree: Path
    extra_args: list[str] = field(default_factory=list)
    required: bool = True  # a failing required system ends the run; tp2 only marks its row


# -- servers ---------------------------------------------------------------------------


def ensure_before_tree(arg: str | None) -> Path:
    """The pre-split source tree: the one given, or a detached worktree made once in /tmp."""
    path = Path(arg) if arg else DEFAULT_BEFORE
    if not (path / "sgl" / "launch_server.py").exists():
        if arg:
            sys.exit(f"--before {path}: not an sgl source tree (no sgl/launch_server.py)")
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), BEFORE_COMMIT],
                       check=True)
    rev = subprocess.run(["git", "-C", str(path), "log", "-1", "--format=%h %s"],
                         capture_output=True, text=True).stdout.strip()
    print(f"before tree: {path} ({rev or 'not a git checkout'})")
    return path


def server_proc(system: System, start_timeout: float) -> Proc:
    """One launch_server subprocess of `system`'s tree, in its own process group."""
    port = free_port()
    cmd = [sys.executable, "-m", "sgl.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--max-total-tokens", "65536", "--no-access-log", "--log-level", "warning", *system.extra_args]
    # The venv's editable install points at /work/main; PYTHONPATH picks this system's tree.
    proc = Proc(system.name, cmd, f"http://127.0.0.1:{port}/health", cwd=system.tree,
                env={"PYTHONPATH": str(system.tree)}, start_timeout=start_timeout)
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc


# -- workloads -------------------------------------------------------------------------


async def _post_ok(client: httpx.AsyncClient, url: str, **kw: Any) -> httpx.Response:
    r = await client.post(url, **kw)
    if r.status_code != 200:
        raise ServerFailed(f"POST {url}: HTTP {r.status_code}: {r.text[:500]}")
    return r


async def flush(client: httpx.AsyncClient, base: str) -> None:
    # The server refuses while requests run; the previous workload's aborts may still drain.
    for _ in range(20):
        if (await client.post(f"{base}/flush_cache")).status_code == 200:
            return
        await asyncio.sleep(0.5)
    raise ServerFailed(f"{base}/flush_cache kept refusing (requests still running?)")


async def run_shared(client: httpx.AsyncClient, base: str, prompts: list[str], new_tokens: int) -> dict[str, Any]:
    sp = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    await flush(client, base)
    t0 = time.perf_counter()
    rs = await asyncio.gather(*(_post_ok(client, f"{base}/generate", json={"text": p, "sampling_params": sp})
                                for p in prompts))
    secs = time.perf_counter() - t0
    metas = [r.json()["meta_info"] for r in rs]
    return {"seconds": secs, "req_s": len(prompts) / secs,
            "prompt_tokens": sum(m["prompt_tokens"] for m in metas),
            "cached_tokens": sum(m.get("cached_tokens", 0) for m in metas),
            "completion_tokens": sum(m["completion_tokens"] for m in metas)}


async def _one_stream(client: httpx.AsyncClient, base: str, prompt: str, tokens: int, t0: float) -> tuple[float, int]:
    """Read one SSE stream (`data: {json}` frames, then `data: [DONE]`); (first-chunk s, tokens)."""
    body = {"text": prompt, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}}
    first, last = None, None
    async with client.stream("POST", f"{base}/generate", json=body) as r:
        if r.status_code != 200:
            raise ServerFailed(f"stream: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerFailed(f"stream error frame: {data[:500]}")
            first = time.perf_counter() - t0 if first is None else first
            last = chunk
    if first is None or last is None:
        raise ServerFailed("stream ended without a data frame")
    return first, int(last["meta_info"]["completion_tokens"])


async def run_streams(client: httpx.AsyncClient, base: str, n: int, tokens: int) -> dict[str, Any]:
    prompts = [f"Story {i}: a traveller reached the village of {chr(65 + i % 26)}, where" for i in range(n)]
    await flush(client, base)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(_one_stream(client, base, p, tokens, t0) for p in prompts))
    secs = time.perf_counter() - t0
    total = sum(k for _, k in outs)
    return {"seconds": secs, "tok_s": total / secs, "ttft_s": statistics.fmean(f for f, _ in outs),
            "completion_tokens": total, "expected_tokens": n * tokens}


async def measure(system: System, server: Proc, args: argparse.Namespace, pass_no: int) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=max(args.requests, args.streams) + 4, max_keepalive_connections=None)
    prompts = shared_prefix_prompts(args.requests)
    reps: list[dict[str, Any]] = []
    # trust_env off: a proxy from the environment must not sit between us and localhost.
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30.0), trust_env=False) as c:
        await _post_ok(c, f"{server.url}/generate",  # warm-up: first-call costs stay out of the figures
                       json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        info = (await c.get(f"{server.url}/get_server_info")).json()
        for r in range(args.repeats):
            shared = await run_shared(c, server.url, prompts, args.new_tokens)
            streams = await run_streams(c, server.url, args.streams, args.stream_tokens)
            reps.append({"pass": pass_no, "rep": r, "shared": shared, "streams": streams})
            print(f"  {system.name} pass {pass_no} rep {r}: shared {shared['req_s']:.2f} req/s "
                  f"({shared['seconds']:.2f} s, cached {shared['cached_tokens']}/{shared['prompt_tokens']} tok); "
                  f"streams {streams['tok_s']:.1f} tok/s, first chunk {streams['ttft_s']:.2f} s", flush=True)
            if streams["completion_tokens"] != streams["expected_tokens"]:
                print(f"  note: streams produced {streams['completion_tokens']} tokens,"
                      f" expected {streams['expected_tokens']}")
    reps[0]["server_info"] = {k: info.get(k) for k in ("tp_size", "worker_pids", "num_threads", "device", "dtype")}
    return reps


# -- the run and its report ------------------------------------------------------------


def run_system(system: System, args: argparse.Namespace, pass_no: int) -> list[dict[str, Any]]:
    print(f"\n{system.name}: starting ({system.tree}{' ' + ' '.join(system.extra_args) if system.extra_args else ''})",
          flush=True)
    t0 = time.perf_counter()
    with server_proc(system, args.start_timeout) as server:
        print(f"  up in {time.perf_counter() - t0:.1f} s on {server.url}", flush=True)
        try:
            return asyncio.run(measure(system, server, args, pass_no))
        except (ServerFailed, httpx.HTTPError, KeyError, ValueError) as e:
            raise ServerFailed(f"{system.name}: {type(e).__name__}: {e}\n{server.tail()}") from None


def median(reps: list[dict[str, Any]], workload: str, key: str) -> float:
    return statistics.median(r[workload][key] for r in reps)


def summary_rows(systems: list[System], results: dict[str, list[dict[str, Any]]],
                 failures: dict[str, str]) -> list[dict[str, Any]]:
    base = results.get("before")
    rows = []
    for s in systems:
        reps = results.get(s.name)
        row: dict[str, Any] = {"system": s.name, "runs": len(reps or [])}
        if reps:
            req_s, tok_s = median(reps, "shared", "req_s"), median(reps, "streams", "tok_s")
            row |= {"shared req/s": req_s, "shared s": median(reps, "shared", "seconds"),
                    "shared x before": req_s / median(base, "shared", "req_s") if base else "",
                    "stream tok/s": tok_s, "first chunk s": median(reps, "streams", "ttft_s"),
                    "stream x before": tok_s / median(base, "streams", "tok_s") if base else "",
                    "status": "ok" if s.name not in failures else "PARTIAL: a later pass failed"}
        else:
            row |= {k: "" for k in ("shared req/s", "shared s", "shared x before", "stream tok/s",
                                    "first chunk s", "stream x before")}
            row["status"] = "FAILED: " + failures.get(s.name, "not run").splitlines()[0][:80]
        rows.append(row)
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    after = next((r for r in rows if r["system"] == "after"), None)
    if not after or after["status"] != "ok" or after["shared x before"] == "":
        return ["tp1 after vs before: not measured (a system failed)"]
    out = []
    for label, key in (("shared prefix", "shared x before"), ("streams", "stream x before")):
        ratio = after[key]
        ok = ratio >= 1 - WITHIN
        how = f"{'faster' if ratio >= 1 else 'slower'} by {abs(ratio - 1):.1%}"
        out.append(f"tp1 after vs before, {label}: {ratio:.3f}x -> {'within' if ok else 'NOT within'} 5% ({how})")
    tp2 = next((r for r in rows if r["system"] == "after-tp2"), None)
    if tp2 and tp2["shared req/s"] != "":
        shared, stream = tp2["shared req/s"] / after["shared req/s"], tp2["stream tok/s"] / after["stream tok/s"]
        out.append(f"tp2 vs tp1 (after): shared prefix {shared:.3f}x, streams {stream:.3f}x "
                   f"(expected below 1 on {os.cpu_count()} cores: two 1-thread ranks + an all-reduce per layer)")
    return out


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=None, help=f"pre-split source tree (default: {DEFAULT_BEFORE}, "
                    f"made with git worktree add at {BEFORE_COMMIT} if missing)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions per system per pass (two passes)")
    ap.add_argument("--requests", type=int, default=64, help="concurrent shared-prefix requests")
    ap.add_argument("--new-tokens", type=int, default=16, help="new tokens per shared-prefix request")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams")
    ap.add_argument("--stream-tokens", type=int, default=1500, help="tokens per stream")
    ap.add_argument("--no-tp2", action="store_true", help="skip the after --tp-size 2 system")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server gets to become healthy")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 requests, 4 streams of 32 tokens, 1 repeat, both passes")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.streams, args.stream_tokens, args.repeats = 4, 4, 32, 1
    return args


def main() -> int:
    args = parse_args()
    # SIGTERM to this script: unwind through the finally blocks so no server is left behind.
    signal.signal(signal.SIGTERM, _interrupt)
    before = ensure_before_tree(args.before)
    systems = [System("before", before), System("after", REPO)]
    if not args.no_tp2:
        systems.append(System("after-tp2", REPO, ["--tp-size", "2"], required=False))
    print(f"cpu: {cpu_model()}, {os.cpu_count()} logical cores; this client: torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print("servers: default threads (before: one engine on all cores; after: cores / tp_size per rank)")
    print("note: on 2 cores tp 2 is two 1-thread ranks beside the API process: expected slower than tp 1")
    results: dict[str, list[dict[str, Any]]] = {}
    failures: dict[str, str] = {}
    for pass_no, order in enumerate((systems, systems[::-1])):
        for s in order:
            if s.name in failures:
                continue
            try:
                results.setdefault(s.name, []).extend(run_system(s, args, pass_no))
            except ServerFailed as e:
                failures[s.name] = str(e)
                print(f"\n{s.name} FAILED:\n{e}", flush=True)
                if s.required:
                    return 1
    rows = summary_rows(systems, results, failures)
    print_table(f"HTTP, median of {args.repeats} x 2 passes: (a) {args.requests} concurrent /generate, shared"
                f" few-shot prefix, {args.new_tokens} new tokens; (b) {args.streams} streams x"
                f" {args.stream_tokens} tokens (x before = throughput / before's)", rows)
    per_pass = [{"system": s, "pass": p, "shared req/s": median(rs, "shared", "req_s"),
                 "stream tok/s": median(rs, "streams", "tok_s")}
                for s, reps in results.items() for p in (0, 1) if (rs := [r for r in reps if r["pass"] == p])]
    print_table("per pass (drift check: pass 1 runs the systems in reverse order)", per_pass)
    lines = verdicts(rows)
    print("\n" + "\n".join(lines))
    if "after-tp2" in failures:
        print("after-tp2 did not run to the end: see its log tail above")
    if args.quick:
        print("(--quick: smoke figures, not a measurement)")
    write_json("bench_process_split.quick.json" if args.quick else "bench_process_split.json",
               {"args": vars(args), "before_tree": str(before), "rows": rows, "verdicts": lines,
                "failures": failures, "runs": results})
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
