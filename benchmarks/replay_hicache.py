"""Where bench_hicache's time goes: its workload replayed in this process, without HTTP.

bench_hicache.py measures the configurations over HTTP, one server each. This replays the
same request sequence (same flags: `bench_hicache.server_args`, read by the server's own
parser) against the scheduler in this process (`inproc_engine.py`), with bench_hicache's
closed-loop clients, and splits each configuration's wall time and CPU time:

  prefill steps  how many prefill steps ran one request, how many several (4 clients
                 whose requests finish together send the next ones together; once one
                 request is admitted alone the clients stay out of step)
  fwd s          model forward time of prefill / decode steps
  sched s        the scheduler thread's time in steps outside the forwards: planning, and
                 the host tier's copies (stores, storage fills, loads) and write-through framing
  cpu s          CPU seconds (user + system) of the whole process, the scheduler thread, the
                 storage tier's reader and writer threads, and redis-server: on a 2-core
                 host every CPU second of the storage path is taken from the forwards

Run: .venv/bin/python benchmarks/replay_hicache.py [--configs radix,host,file,redis] [bench_hicache options]
Writes benchmarks/results/replay_hicache.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hicache  # noqa: E402
from common import cpu_model, print_table, write_json  # noqa: E402
from inproc_engine import InProcessEngine  # noqa: E402
from profile_engine import StepTimer  # noqa: E402

from sgl.launch_server import build_parser  # noqa: E402
from sgl.runtime.config import EngineConfig, given  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(stat_path: str) -> float:
    """utime + stime of a /proc stat file (a process or one of this process's threads)."""
    try:
        fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def engine_kwargs(name: str, args: argparse.Namespace, tmp: str, redis_url: str | None) -> dict[str, Any]:
    """The EngineConfig of bench_hicache's server for `name` (its flags, parsed as the server does)."""
    flags = bench_hicache.server_args(name, args, tmp, redis_url)
    return given(build_parser().parse_args(flags), EngineConfig)


def drive(eng: InProcessEngine, reqs: list[list[int]], concurrency: int, max_tokens: int) -> float:
    """bench_hicache's closed loop: `concurrency` clients, each sending its next request
    when the last one finished; wall seconds from the first send to the last finish."""
    todo = list(reqs)
    lock = threading.Lock()
    sp = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                ids = todo.pop(0)
            eng.generate(input_ids=ids, sampling_params=sp)

    t0 = time.perf_counter()
    clients = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    return time.perf_counter() - t0


def replay(name: str, args: argparse.Namespace, reqs: list[list[int]], tmp: str, redis: Any) -> dict[str, Any]:
    older = set(threading.enumerate())
    eng = InProcessEngine(**engine_kwargs(name, args, tmp, redis.url if redis is not None else None))
    hc = eng.scheduler.kv.hicache
    try:
        eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})  # warm-up, not timed
        timer = StepTimer(eng)
        threads = {"scheduler": eng._thread.native_id}
        named = {"sgl-hicache-reader": "reader", "sgl-hicache-writer": "writer"}  # storage_tier.py's threads
        threads.update({named[t.name]: t.native_id for t in set(threading.enumerate()) - older if t.name in named})
        before = {k: cpu_seconds(f"/proc/self/task/{tid}/stat") for k, tid in threads.items()}
        redis_before = cpu_seconds(f"/proc/{redis.proc.pid}/stat") if name == "redis" else 0.0
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        wall = drive(eng, reqs, args.concurrency, args.max_tokens)
        timer.idle()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = {k: cpu_seconds(f"/proc/self/task/{tid}/stat") - before[k] for k, tid in threads.items()}
        stats = dict(hc.stats) if hc is not None else {}
    finally:
        eng.shutdown()  # closes its storage tier before the next configuration
    steps = timer.steps
    prefill = [s for s in steps if s[3].startswith("prefill")]
    decode = [s for s in steps if s[3].startswith("decode")]
    return {
        "config": name, "wall_s": wall, "req_s": len(reqs) / wall,
        "prefill_steps_single": sum(1 for s in prefill if s[3] == "prefill"),
        "prefill_steps_batched": sum(1 for s in prefill if s[3] != "prefill"),
        "decode_steps": len(decode),
        "prefill_fwd_s": sum(s[1] for s in prefill), "decode_fwd_s": sum(s[1] for s in decode),
        "sched_outside_fwd_s": sum(s[0] - s[1] for s in steps),
        "cpu_process_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime),
        "cpu_scheduler_s": cpu["scheduler"], "cpu_reader_s": cpu.get("reader", 0.0),
        "cpu_writer_s": cpu.get("writer", 0.0),
        "cpu_redis_s": cpu_seconds(f"/proc/{redis.proc.pid}/stat") - redis_before if name == "redis" else 0.0,
        "hit_tokens": {t: int(stats.get(f"hicache_{t}_hit_tokens", 0)) for t in ("device", "host", "storage")},
    }


def table_row(r: dict[str, Any], radix: dict[str, Any] | None) -> dict[str, Any]:
    return {"config": r["config"], "req/s": r["req_s"], "x radix": r["req_s"] / radix["req_s"] if radix else "",
            "wall s": r["wall_s"], "prefill steps 1 / several": f"{r['prefill_steps_single']} / "
            f"{r['prefill_steps_batched']}", "prefill fwd s": r["prefill_fwd_s"], "decode fwd s": r["decode_fwd_s"],
            "sched s": r["sched_outside_fwd_s"], "cpu s": r["cpu_process_s"], "reader cpu s": r["cpu_reader_s"],
            "writer cpu s": r["cpu_writer_s"], "redis cpu s": r["cpu_redis_s"]}


def main() -> int:
    args = bench_hicache.parse_args()
    from tests.redis_proc import start_redis

    configs = args.configs.split(",")
    reqs = bench_hicache.workload(args)
    print(f"cpu: {cpu_model()}; {len(reqs)} requests, in-process replay", flush=True)
    results: dict[str, dict[str, Any]] = {}
    redis = start_redis() if "redis" in configs else None
    try:
        for name in configs:
            with bench_hicache.scratch_dir() as tmp:  # the file store goes with it
                results[name] = replay(name, args, reqs, tmp, redis)
            print(f"  {name}: {results[name]['req_s']:.3f} req/s", flush=True)
    finally:
        if redis is not None:
            redis.stop()
    radix = results.get("radix")
    print_table(f"{len(reqs)} requests in process, concurrency {args.concurrency}, device pool "
                f"{args.max_total_tokens}", [table_row(r, radix) for r in results.values()])
    write_json("replay_hicache.json", {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
