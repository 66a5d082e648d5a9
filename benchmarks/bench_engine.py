"""Engine benchmark (issue: runtime core), side by side in one run:

(a) 64 requests sharing a ~600-token few-shot prefix, 16 new tokens each:
    this engine vs this engine with the radix cache disabled vs transformers one by one;
(b) single-stream decode tok/s vs the memory-bandwidth bound (weight bytes / bandwidth);
(c) decode throughput at batch 1/8/32/64.

Run: .venv/bin/python benchmarks/bench_engine.py [--hf-requests 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_bandwidth_gbs, print_table, timed, write_json  # noqa: E402

from sgl.runtime.engine import Engine  # noqa: E402

FEWSHOT = "\n".join(
    f"Question: What is {a} plus {b}? Think step by step and give the answer as a number.\nAnswer: {a + b}"
    for a, b in [(i * 7 % 50, i * 13 % 40) for i in range(20)]
)


def shared_prefix_prompts(n: int) -> list[str]:
    return [f"{FEWSHOT}\nQuestion: What is {i} plus {i * 3 % 17}? Think step by step.\nAnswer:" for i in range(n)]


def run_shared(engine: Engine, prompts: list[str], new_tokens: int) -> tuple[float, dict]:
    sp = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.generate(prompts[0][:200], {"max_new_tokens": 1})  # warm-up
    engine.flush_cache()
    secs, outs = timed(lambda: engine.generate(prompts, sp))
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    return secs, {"cached_tokens": cached, "prompt_tokens": prompt}


def run_transformers(hf_dir: Path, prompts: list[str], new_tokens: int, tokenizer) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.bfloat16).eval()
    ids = [torch.tensor([tokenizer.encode(p)]) for p in prompts]
    with torch.no_grad():
        model.generate(ids[0], max_new_tokens=2, do_sample=False)
        t0 = torch.tensor(0.0)
        import time

        start = time.perf_counter()
        for x in ids:
            model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        del t0
        return time.perf_counter() - start


def decode_throughput(engine: Engine, batch: int, new_tokens: int = 64) -> float:
    prompts = [f"Story {i}: once upon a time there was a" for i in range(batch)]
    sp = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.generate(prompts, {"max_new_tokens": 1})
    secs, outs = timed(lambda: engine.generate(prompts, sp))
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / secs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--hf-requests", type=int, default=16,
                    help="transformers is timed on this many requests and scaled to --requests (0: skip it)")
    ap.add_argument("--batches", default="1,8,32,64", help="decode batch sizes of (c), comma-separated")
    args = ap.parse_args()
    prompts = shared_prefix_prompts(args.requests)
    results: dict = {}

    eng = Engine(max_total_tokens=65536)
    n_prefix = len(eng.tokenizer.encode(FEWSHOT))
    t_radix, st = run_shared(eng, prompts, args.new_tokens)
    plain = Engine(max_total_tokens=65536, disable_radix_cache=True)
    t_plain, st_plain = run_shared(plain, prompts, args.new_tokens)
    plain.shutdown()
    hf_n = min(args.hf_requests, args.requests)
    rows_a = [
        {"system": "sgl (radix cache)", "seconds": t_radix, "req/s": args.requests / t_radix,
         "cached_tokens": st["cached_tokens"], "speedup": 1.0},
        {"system": "sgl (radix disabled)", "seconds": t_plain, "req/s": args.requests / t_plain,
         "cached_tokens": st_plain["cached_tokens"], "speedup": t_plain / t_radix},
    ]
    t_hf = float("nan")
    if hf_n > 0:
        t_hf = run_transformers(eng.hf_dir, prompts[:hf_n], args.new_tokens, eng.tokenizer) * args.requests / hf_n
        rows_a.append({"system": f"transformers one by one (timed {hf_n}, scaled)", "seconds": t_hf,
                       "req/s": args.requests / t_hf, "cached_tokens": 0, "speedup": t_hf / t_radix})
    print_table(f"(a) {args.requests} requests, shared {n_prefix}-token prefix, {args.new_tokens} new tokens"
                " (speedup = that system's time / sgl's)", rows_a)
    results["shared_prefix"] = {"prefix_tokens": n_prefix, "rows": rows_a,
                                "ratio_vs_no_radix": t_plain / t_radix, "ratio_vs_transformers": t_hf / t_radix}

    weight_bytes = sum(eng.get_server_info()["weight_bytes_per_rank"])
    bw = measure_bandwidth_gbs()
    tok_s = decode_throughput(eng, 1, 64)
    bound = bw * 1e9 / weight_bytes
    rows_b = [{"weights_MB": weight_bytes / 1e6, "bandwidth_GB/s": bw, "bound_tok/s": bound,
               "measured_tok/s": tok_s, "fraction_of_bound": tok_s / bound}]
    print_table("(b) single-stream decode vs the memory-bandwidth bound", rows_b)
    results["single_stream"] = rows_b[0]

    rows_c = []
    for b in (int(x) for x in args.batches.split(",")):
        rows_c.append({"batch": b, "decode_tok/s": decode_throughput(eng, b, 32)})
    print_table("(c) decode throughput by batch size", rows_c)
    results["decode_batches"] = rows_c
    eng.shutdown()
    write_json("bench_engine.json", results)


if __name__ == "__main__":
    main()
