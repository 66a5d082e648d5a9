"""Where the CPU time goes in our engine: the numbers behind benchmarks/PROFILE.md.

1. Step timing: wraps `scheduler.step` and `runner.forward` of a live engine (instance
   attributes only, no code change) and runs a single-stream decode and a 1,024-token
   prefill through `generate`, so "step wall - forward wall" is the scheduler's Python
   cost per step (batch building, sampling, radix bookkeeping). The engine runs in this
   process (inproc_engine.py) so the wrappers can reach its scheduler; detokenizing is
   the API process's job and not counted.
2. Op profile: replays a captured decode ForwardBatch and a 1,024-token prefill
   ForwardBatch through `runner.forward` under torch.profiler in this thread (the engine
   is idle, so rewriting the same KV slots is harmless), groups ops into matmul /
   attention / norm / rope / elementwise / other by op name, and prints the top ops.
   "Python between ops" is the self time of a record_function around the forward: time
   in the forward that no op accounts for (a step run by the C decode kernel, one opaque
   call, lands there whole). Percentages are of the profiled forward.
3. Shared prefix (`--workload shared`): bench_peers' 64 requests sharing a ~600-token
   few-shot prefix, 16 new tokens each, all submitted at once. Prints the time per step
   kind (the first request's prefill, the batched suffix prefill that runs cascade
   attention, the wide decode steps) and op-profiles one batched prefill and one wide
   decode step.

Run: .venv/bin/python benchmarks/profile_engine.py [--workload single|shared|all] [--top 12]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import FEWSHOT, shared_prefix_prompts  # noqa: E402
from common import print_table  # noqa: E402

from inproc_engine import InProcessEngine as Engine  # noqa: E402  (the loop in this process: see there)

REPLAY = "sgl::replay_forward"
GROUPS = [  # first match wins; names are op names as the profiler reports them
    # Our C kernels are opaque ctypes calls: label_c_kernels() names them for the profiler.
    ("C attention (attention.c)", ("sgl::c_attention",)),
    ("C fused ops (ops.c)", ("sgl::c_ops",)),
    ("C decode step (decode.c)", ("sgl::c_decode",)),
    ("attention: SDPA", ("scaled_dot_product", "flash_attention", "_efficient_attention", "_softmax", "baddbmm", "bmm")),
    ("attention: KV write/gather", ("index_put", "aten::index", "aten::where")),
    # Our bf16 linears run as oneDNN prepacked "mkldnn::_linear_pointwise" on this CPU.
    ("matmul (linear)", ("_linear_pointwise", "addmm", "aten::mm", "aten::linear", "aten::matmul")),
    ("rmsnorm", ("rsqrt", "aten::pow", "aten::mean")),
    ("rope", ("aten::cat", "aten::sub")),
    ("embedding", ("embedding",)),
    ("copies/casts", ("aten::copy_", "aten::to", "_to_copy", "contiguous", "aten::clone")),
    ("elementwise (silu, mul, add)", ("silu", "aten::mul", "aten::add")),
]


def label_c_kernels() -> None:
    """Wrap the C library's entry points in record_function ranges (on the loaded ctypes
    object only, no code change), so their time is not lumped into "Python between ops"."""
    from sgl.runtime.kernels.cpu import binding

    kernels = binding.kernels()  # declares every function; its wrappers look them up on `lib` per call
    if kernels is None:
        return
    lib = kernels.lib
    for name, label in (("sgl_attn_forward", "sgl::c_attention"), ("sgl_decode_step", "sgl::c_decode"),
                        ("sgl_ops_rmsnorm", "sgl::c_ops"), ("sgl_ops_add_rmsnorm", "sgl::c_ops"),
                        ("sgl_ops_rope", "sgl::c_ops"), ("sgl_ops_silu_mul", "sgl::c_ops")):
        fn = getattr(lib, name, None)
        if fn is None or getattr(fn, "_labelled", False):
            continue

        def wrapped(*a: Any, _fn: Any = fn, _label: str = label) -> Any:
            with record_function(_label):
                return _fn(*a)

        wrapped._labelled = True  # type: ignore[attr-defined]
        setattr(lib, name, wrapped)


def group_of(name: str) -> str:
    for g, keys in GROUPS:
        if any(k in name for k in keys):
            return g
    return "other"


def kind_of(fb: Any) -> str:
    """'decode' / 'prefill' for one request, 'decode batch' / 'prefill batch' for more."""
    return ("decode" if fb.is_decode else "prefill") + (" batch" if fb.batch_size > 1 else "")


class StepTimer:
    """Wraps scheduler.step / runner.forward, recording wall time and the batch kind."""

    def __init__(self, eng: Engine) -> None:
        self.steps: list[tuple[float, float, int, str]] = []  # (step s, forward s, num tokens, kind)
        self.captured: dict[str, Any] = {}
        sched, runner = eng.scheduler, eng.scheduler.runner
        orig_step, orig_fwd = sched.step, runner.forward
        self._fwd = 0.0
        self._tokens = 0
        self._kind = ""

        def fwd(fb: Any) -> torch.Tensor:
            t0 = time.perf_counter()
            out = orig_fwd(fb)
            self._fwd += time.perf_counter() - t0
            self._tokens += fb.num_tokens
            self._kind = kind_of(fb)
            self.captured.setdefault(self._kind, fb)
            return out

        def step() -> bool:
            self._fwd, self._tokens = 0.0, 0
            t0 = time.perf_counter()
            did = orig_step()
            if self._tokens:
                self.steps.append((time.perf_counter() - t0, self._fwd, self._tokens, self._kind))
            return did

        runner.forward = fwd  # type: ignore[method-assign]
        sched.step = step  # type: ignore[method-assign]
        self.idle = lambda: sched.call(lambda: None).result()  # the last step has been recorded


def op_profile(runner: Any, fb: Any, reps: int, top: int) -> tuple[float, list[dict], list[dict]]:
    """(unprofiled forward wall s, time by part, top ops) for replaying `fb`."""
    runner.forward(fb)
    wall = min(_time(lambda: runner.forward(fb)) for _ in range(reps))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            with record_function(REPLAY):
                runner.forward(fb)
    events = {e.key: e for e in prof.key_averages()}
    replay = events.pop(REPLAY)
    # Self time of the wrapper = time inside forward spent outside every op: Python code,
    # module calls, argument handling. Every op's self time excludes its children.
    total = replay.cpu_time_total / reps / 1e6
    self_s = {k: e.self_cpu_time_total / reps / 1e6 for k, e in events.items()}
    by_group: dict[str, float] = defaultdict(float)
    for k, v in self_s.items():
        by_group[group_of(k)] += v
    by_group["Python between ops"] = replay.self_cpu_time_total / reps / 1e6
    groups = [{"part": g, "ms": 1e3 * v, "% of forward": 100 * v / total}
              for g, v in sorted(by_group.items(), key=lambda kv: -kv[1])]
    tops = [{"op": k, "calls": int(events[k].count / reps), "self ms": 1e3 * v, "% of forward": 100 * v / total}
            for k, v in sorted(self_s.items(), key=lambda kv: -kv[1])[:top]]
    return wall, groups, tops


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def print_profiles(runner: Any, timer: StepTimer, kinds: list[str], args: argparse.Namespace) -> None:
    for kind in kinds:
        fb = timer.captured[kind]
        wall, groups, tops = op_profile(runner, fb, args.reps, args.top)
        print(f"\n### {kind}: forward {1e3 * wall:.2f} ms unprofiled ({fb.num_tokens} tokens, batch {fb.batch_size}, "
              f"context {max(fb.seq_lens_cpu)})")
        print_table(f"{kind}: time by part", groups)
        print_table(f"{kind}: top ops by self CPU time", tops)


def profile_single(eng: Engine, timer: StepTimer, args: argparse.Namespace) -> None:
    sp = {"temperature": 0, "max_new_tokens": args.decode_tokens, "ignore_eos": True}
    eng.generate("Story 0: once upon a time there was a", {"max_new_tokens": 2})
    timer.idle()
    timer.steps.clear()
    eng.flush_cache()
    eng.generate("Story 0: once upon a time there was a", sp)
    timer.idle()
    dec = [s for s in timer.steps if s[2] == 1]
    ids: list[int] = []
    while len(ids) < args.prefill_tokens:
        ids += eng.tokenizer.encode(FEWSHOT + "\n")
    eng.flush_cache()
    timer.steps.clear()
    timer.captured.pop("prefill", None)
    eng.generate(input_ids=ids[: args.prefill_tokens], sampling_params={"max_new_tokens": 1})
    timer.idle()
    pre = [s for s in timer.steps if s[2] > 1]
    if not pre:
        raise SystemExit(f"no prefill step was recorded (steps: {timer.steps})")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    rows = []
    for name, st in (("decode step (batch 1)", dec), (f"prefill step ({args.prefill_tokens} tokens)", pre)):
        step_s, fwd_s = mean([s[0] for s in st]), mean([s[1] for s in st])
        rows.append({"step": name, "steps": len(st), "step ms": 1e3 * step_s, "forward ms": 1e3 * fwd_s,
                     "scheduler overhead ms": 1e3 * (step_s - fwd_s),
                     "overhead %": 100 * (step_s - fwd_s) / step_s})
    print_table("Step wall time: model forward vs scheduler (Python) overhead", rows)
    print_profiles(eng.scheduler.runner, timer, ["decode", "prefill"], args)


def profile_shared(eng: Engine, timer: StepTimer, args: argparse.Namespace) -> None:
    prompts = shared_prefix_prompts(args.shared_requests)
    sp = {"temperature": 0, "max_new_tokens": args.shared_new_tokens, "ignore_eos": True}
    eng.flush_cache()
    timer.idle()
    timer.steps.clear()
    timer.captured.clear()
    t0 = time.perf_counter()
    eng.generate(prompts, sp)
    total = time.perf_counter() - t0
    timer.idle()
    rows = []
    for kind in ("prefill", "prefill batch", "decode batch", "decode"):
        st = [s for s in timer.steps if s[3] == kind]
        if not st:
            continue
        step_s, fwd_s = sum(s[0] for s in st), sum(s[1] for s in st)
        rows.append({"step kind": kind, "steps": len(st), "tokens": sum(s[2] for s in st), "step s": step_s,
                     "forward s": fwd_s, "scheduler s": step_s - fwd_s, "% of run": 100 * step_s / total})
    print_table(f"Shared prefix: {args.shared_requests} requests x {args.shared_new_tokens} new tokens, "
                f"{total:.2f} s end to end", rows)
    print_profiles(eng.scheduler.runner, timer, [k for k in ("prefill batch", "decode batch") if k in timer.captured], args)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=("single", "shared", "all"), default="all")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--shared-requests", type=int, default=64)
    ap.add_argument("--shared-new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all CPUs)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # this thread replays; the engine's thread gets num_threads
    eng = Engine(max_total_tokens=65536, num_threads=args.threads)
    label_c_kernels()
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    timer = StepTimer(eng)
    if args.workload in ("single", "all"):
        profile_single(eng, timer, args)
    if args.workload in ("shared", "all"):
        profile_shared(eng, timer, args)
    eng.shutdown()


if __name__ == "__main__":
    main()
