"""The offline Engine before and after the process split (issue #12), in one run.

`sgl.Engine()` used to run its scheduler in a thread of the caller's process; it now
starts a worker process. This runs the same workload in a fresh interpreter per tree
(`PYTHONPATH` picks the tree), alternating before/after for `--rounds` rounds:
(a) `--requests` shared-prefix requests in one `generate` call (bench_engine's few-shot
prompts, 16 new tokens), (b) `--streams` concurrent streams of `--stream-tokens` tokens
(threads over `generate(stream=True)`), and the engine's start-up time.

Run: .venv/bin/python benchmarks/bench_split_offline.py [--before /tmp/sgl-before-split]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, print_table, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# Runs inside the tree under test: prints one JSON line of figures.
CHILD = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[1] + "/benchmarks")
from bench_engine import shared_prefix_prompts
from sgl.runtime.engine import Engine
n, streams, k = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t0 = time.perf_counter()
eng = Engine(max_total_tokens=65536)
start = time.perf_counter() - t0
eng.generate("warm up", {"max_new_tokens": 2})
t0 = time.perf_counter()
eng.generate(shared_prefix_prompts(n), {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
shared = time.perf_counter() - t0
def stream(i):
    for _ in eng.generate(f"Story {i}:", {"temperature": 0, "max_new_tokens": k, "ignore_eos": True}, stream=True):
        pass
ts = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
t0 = time.perf_counter()
for t in ts: t.start()
for t in ts: t.join()
wall = time.perf_counter() - t0
eng.shutdown()
print(json.dumps({"start_s": start, "shared_req_s": n / shared, "stream_tok_s": streams * k / wall}))
"""


def run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(args.requests), str(args.streams),
                          str(args.stream_tokens)], cwd=tree, env=env, capture_output=True, text=True, timeout=7200)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="/tmp/sgl-before-split", help="pre-split tree (see bench_process_split.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=100)
    args = ap.parse_args()
    trees = {"before (in-thread)": Path(args.before), "after (worker process)": REPO}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):  # alternate, so drift falls on both alike
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            runs[name].append(run(trees[name], args))
            print(name, runs[name][-1], flush=True)
    rows = []
    for name, rs in runs.items():
        rows.append({"system": name, **{k: statistics.median(x[k] for x in rs) for k in rs[0]}})
    base = rows[0]
    for row in rows:
        row["shared x before"] = row["shared_req_s"] / base["shared_req_s"]
        row["stream x before"] = row["stream_tok_s"] / base["stream_tok_s"]
    print(f"cpu: {cpu_model()}")
    print_table(f"Offline Engine, median of {args.rounds}: {args.requests} shared-prefix requests x 16 tokens; "
                f"{args.streams} streams x {args.stream_tokens} tokens", rows)
    write_json("bench_split_offline.json", {"args": vars(args), "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
