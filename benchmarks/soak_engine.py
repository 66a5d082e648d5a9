"""Soak benchmark (issue #19): many fresh engines, each in its own process, beside CPU burners.

Each run is one child process that starts a fresh engine (default options, the
embedded model) and drives it through:
  - the crash recipe: a warm-up, then 64 prompts sharing a ~980-token few-shot prefix,
    16 greedy tokens each (ignore_eos); then the same on an engine with the radix cache off;
  - a mix of step shapes: decode batches of 1, 8, 9, 33, 64 and 256 rows (the C decode
    kernel's sizes and the packed-linear sizes past it), a long prefill, extends after a
    cached prefix, a fully cached prompt (one-token extend), n > 1 sampling, and regex /
    JSON-schema constrained requests.
The parent counts runs, crashes (the signal, and the faulting thread's stack that the
engine's faulthandler leaves on stderr), failures (a non-zero exit) and hangs (no exit
within --timeout), with and without competing load: --burners busy-looping processes
(--load burn; default one, as in the issue), the way other servers on the cores compete. With
--fast-paths-off it repeats the soak with each CPU fast path turned off in turn.

Run: .venv/bin/python benchmarks/soak_engine.py --runs 30 --load both [--fast-paths-off]
(a host without fast bf16 GEMMs needs a smaller recipe: --prompts 4 --shots 2 --max-rows 16)
Prints a table, writes benchmarks/results/soak_engine.json. Not a test.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Each fast path and the SGL_* setting that turns it off (EngineConfig fields or switches).
FAST_PATHS: dict[str, dict[str, str]] = {
    "all on": {},
    "no C decode kernel": {"SGL_DISABLE_CPU_DECODE_KERNEL": "1"},
    "no C attention": {"SGL_ATTENTION_BACKEND": "torch"},
    "no fused C ops": {"SGL_DISABLE_CPU_OPS": "1"},
    "no packed linears": {"SGL_DISABLE_PACKED_LINEARS": "1"},
    "decode kernel 1 thread": {"SGL_CPU_DECODE_THREADS": "1"},
}

ROWS = (1, 8, 9, 33, 64, 256)


def fewshot(shots: int) -> str:
    """A few-shot prefix of ~35 tokens per shot (28 shots: ~980 tokens, the recipe's)."""
    return "\n".join(
        f"Question: What is {a} times {b}? Think step by step and give the answer as a number.\nAnswer: {a * b}"
        for a, b in [(i * 7 % 31 + 2, i * 13 % 23 + 3) for i in range(shots)])


# ---- the child: one engine's workload ---------------------------------------------------
def _recipe(engine: Any, prompts: int, shots: int) -> None:
    engine.generate("warm up", {"max_new_tokens": 2})
    prefix = fewshot(shots)
    qs = [f"{prefix}\nQuestion: What is {i} times {i % 9 + 2}? Think step by step.\nAnswer:" for i in range(prompts)]
    outs = engine.generate(qs, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    assert all(len(o["output_ids"]) == 16 for o in outs)


def _mix(engine: Any, max_rows: int) -> None:
    short = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    for rows in (r for r in ROWS if r <= max_rows):  # decode steps of these batch sizes
        outs = engine.generate([f"Item {i} of {rows}:" for i in range(rows)], short)
        assert all(len(o["output_ids"]) == 4 for o in outs)
    long_prompt = " ".join(f"word{i}" for i in range(3 * max_rows))  # ~750 tokens at 256 rows
    engine.generate(long_prompt, short)  # a long prefill
    engine.generate([long_prompt + f" and then {i}" for i in range(12)], short)  # extends after a cached prefix
    engine.generate(long_prompt, short)  # fully cached: a one-token extend
    outs = engine.generate("Tell me a short joke.", {"n": 4, "temperature": 0.8, "max_new_tokens": 12})
    assert len(outs) == 4
    r = engine.generate("Three digits:", {"regex": "[0-9]{3}", "max_new_tokens": 8})
    assert len(r["text"]) == 3 and r["text"].isdigit(), r["text"]
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    r = engine.generate("JSON:", {"json_schema": schema, "max_new_tokens": 24, "temperature": 0})
    assert r["text"].startswith("{"), r["text"]


def child(args: argparse.Namespace) -> None:
    from sgl.runtime.engine import Engine

    for opts in ({}, {"disable_radix_cache": True}):
        engine = Engine(max_total_tokens=65536, **opts)
        try:
            _recipe(engine, args.prompts, args.shots)
            if not opts:
                _mix(engine, args.max_rows)
            engine.check_invariants()
        finally:
            engine.shutdown()
    print("child ok")


# ---- the parent: runs, load, classification ---------------------------------------------
def start_burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _stack(stderr: str) -> str:
    """The faulthandler report: from 'Fatal Python error' on, trimmed."""
    i = stderr.find("Fatal Python error")
    return (stderr[i:] if i >= 0 else stderr[-1500:])[:3000]


def one_run(env_extra: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    # PYTHONPATH: the child soaks this checkout's sgl, not whichever copy is installed.
    env = dict(os.environ, **env_extra, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--child", "--prompts", str(args.prompts), "--shots", str(args.shots),
           "--max-rows", str(args.max_rows)]
    p = subprocess.Popen(cmd, env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return {"outcome": "hang", "seconds": time.perf_counter() - t0, "detail": err[-1500:]}
    secs = time.perf_counter() - t0
    if p.returncode < 0:
        return {"outcome": "crash", "signal": signal.Signals(-p.returncode).name, "seconds": secs,
                "detail": _stack(err)}
    if p.returncode != 0 or "child ok" not in out:
        return {"outcome": "failure", "exit": p.returncode, "seconds": secs, "detail": err[-1500:]}
    return {"outcome": "ok", "seconds": secs}


def soak(name: str, env_extra: dict[str, str], load: str, args: argparse.Namespace) -> dict[str, Any]:
    burners = start_burners(args.burners) if load == "burn" else []
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        for i in range(args.runs):
            r = one_run(env_extra, args)
            runs.append(r)
            print(f"  [{name}, load {load}] run {i + 1}/{args.runs}: {r['outcome']} in {r['seconds']:.1f}s", flush=True)
            if r["outcome"] != "ok":
                print(r.get("detail", ""), flush=True)
    finally:
        stop(burners)
    count = {k: sum(r["outcome"] == k for r in runs) for k in ("ok", "crash", "failure", "hang")}
    return {"fast paths": name, "load": load, "runs": len(runs), **count,
            "wall s": time.perf_counter() - t0, "mean run s": sum(r["seconds"] for r in runs) / max(1, len(runs)),
            "problems": [r for r in runs if r["outcome"] != "ok"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30, help="fresh engine processes per configuration")
    ap.add_argument("--load", choices=["none", "burn", "both"], default="both",
                    help="competing load: none, --burners busy processes, or both in turn")
    ap.add_argument("--burners", type=int, default=1,
                    help="busy-looping processes competing for the cores under --load burn")
    ap.add_argument("--fast-paths-off", action="store_true", help="also soak with each fast path off in turn")
    ap.add_argument("--prompts", type=int, default=64, help="prompts sharing the few-shot prefix in the recipe")
    ap.add_argument("--shots", type=int, default=28, help="few-shot examples in the shared prefix (28: ~980 tokens)")
    ap.add_argument("--max-rows", type=int, default=256, help="largest decode batch of the shape mix")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before a run counts as hung")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    print(f"host: {cpu_model()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"burners under load: {args.burners}")
    loads = ["none", "burn"] if args.load == "both" else [args.load]
    variants = FAST_PATHS if args.fast_paths_off else {"all on": {}}
    results = [soak(name, env, load, args) for name, env in variants.items() for load in loads]
    print_table(f"soak: {args.runs} fresh engines per row ({args.prompts} prompts x {args.shots}-shot prefix, "
                f"decode batches up to {args.max_rows})",
                [{k: v for k, v in r.items() if k != "problems"} for r in results])
    for r in results:
        for p in r["problems"]:
            print(f"\n{r['fast paths']} / load {r['load']}: {p['outcome']} {p.get('signal', '')}\n{p.get('detail', '')}")
    write_json("soak_engine.json", {"runs": args.runs, "burners": args.burners, "prompts": args.prompts,
                                    "shots": args.shots, "max_rows": args.max_rows, "results": results})


if __name__ == "__main__":
    main()
