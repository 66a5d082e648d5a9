"""DSL benchmark: the radix cache's effect on prompt programs, side by side in one run.

Workloads (in-process sgl.Engine, temperature 0):
  select64  a batch of 64 few-shot sentiment programs, each ending in select() over 3 labels
  tot       a tree-of-thought program: fork(4) plans, a yes/no select per plan, pick the best
Each runs on `sgl.Engine()` and on `sgl.Engine(disable_radix_cache=True)`. Reported:
wall time, programs/s, prompt tokens actually computed (prompt - cached), the cache hit
rate, and whether both engines chose the same answers. Prints a table and writes
benchmarks/results/dsl_bench.json.

    python benchmarks/dsl_bench.py [--num 64] [--tot-runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import sgl

FEW_SHOT = "".join(
    f"Review: {r}\nSentiment: {lab}\n"
    for r, lab in [
        ("I loved every minute of it, the cast was brilliant.", "positive"),
        ("The food was cold and the staff were rude to us.", "negative"),
        ("The train left at nine and arrived at noon.", "neutral"),
        ("Absolutely wonderful experience, highly recommended!", "positive"),
        ("It broke after two days and support never answered.", "negative"),
        ("The manual has forty pages and a blue cover.", "neutral"),
    ] * 3
)
SUBJECTS = ["film", "hotel", "phone", "book", "restaurant", "laptop", "concert", "game"]
ADJ = ["amazing", "awful", "ordinary", "fantastic", "disappointing", "fine", "superb", "broken"]


@sgl.function
def classify(s, review):
    s += "Classify the sentiment of each review as positive, negative or neutral.\n\n" + FEW_SHOT
    s += "Review: " + review + "\nSentiment: "
    s += sgl.select("label", ["positive", "negative", "neutral"])


@sgl.function
def tree_of_thought(s, question):
    s += "You are a careful planner. Think about the question from several angles.\n"
    s += "Question: " + question + "\n"
    forks = s.fork(4)
    forks += lambda i: f"Approach {i + 1}:" + sgl.gen("plan", max_tokens=24, stop="\n") + \
        "\nIs this approach practical? " + sgl.select("ok", ["yes", "no"])
    forks.join()
    s += "".join(f"Approach {i + 1}:{p} ({o})\n" for i, (p, o) in enumerate(zip(s["plan"], s["ok"])))
    s += "The best approach is number " + sgl.select("best", ["1", "2", "3", "4"]) + ".\n"
    s += "Final answer:" + sgl.gen("answer", max_tokens=24, stop="\n")


def measure(engine, fn) -> dict:
    engine.flush_cache()
    before = engine.get_server_info()
    t0 = time.perf_counter()
    answers, n = fn()
    wall = time.perf_counter() - t0
    after = engine.get_server_info()
    prompt = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    cached = after["cached_tokens_total"] - before["cached_tokens_total"]
    return {"wall_s": round(wall, 3), "programs": n, "programs_per_s": round(n / wall, 3),
            "prompt_tokens": prompt, "computed_prompt_tokens": prompt - cached,
            "cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0, "answers": answers}


def run_config(disable_radix_cache: bool, num: int, tot_runs: int) -> dict:
    engine = sgl.Engine(disable_radix_cache=disable_radix_cache)
    reviews = [f"The {SUBJECTS[i % 8]} was {ADJ[(i * 3) % 8]} and I {['liked', 'hated', 'noticed'][i % 3]} it ({i})."
               for i in range(num)]

    def select_batch():
        states = classify.run_batch([{"review": r} for r in reviews], backend=engine, temperature=0,
                                    num_threads=num)
        return [st["label"] for st in states], len(states)

    def tot():
        qs = ["How can I save money on groceries?", "How do I learn to play the guitar?"]
        out = []
        for k in range(tot_runs):
            st = tree_of_thought.run(qs[k % len(qs)], backend=engine, temperature=0)
            out.append([st["best"], st["answer"]])
        return out, tot_runs

    classify.run(reviews[0], backend=engine, temperature=0)  # warm up kernels and grammar paths
    res = {"select64": measure(engine, select_batch), "tot": measure(engine, tot)}
    engine.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--tot-runs", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "dsl_bench.json"))
    args = ap.parse_args()

    radix = run_config(False, args.num, args.tot_runs)
    plain = run_config(True, args.num, args.tot_runs)

    rows = []
    print(f"{'workload':10s} {'metric':24s} {'radix':>12s} {'no radix':>12s} {'ratio':>8s}")
    for w in ("select64", "tot"):
        a, b = radix[w], plain[w]
        for m in ("wall_s", "programs_per_s", "computed_prompt_tokens", "cache_hit_rate"):
            ratio = (b[m] / a[m]) if m in ("wall_s", "computed_prompt_tokens") and a[m] else (
                a[m] / b[m] if b[m] else float("inf"))
            print(f"{w:10s} {m:24s} {a[m]:>12} {b[m]:>12} {ratio:>7.2f}x")
            rows.append({"workload": w, "metric": m, "radix": a[m], "no_radix": b[m], "ratio": round(ratio, 3)})
        same = a["answers"] == b["answers"]
        print(f"{w:10s} {'same answers':24s} {str(same):>12s}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": {"num": args.num, "tot_runs": args.tot_runs}, "rows": rows, "radix": radix, "no_radix": plain,
                   "note": "ratio: no-radix/radix for time and computed tokens, radix/no-radix otherwise"},
                  f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
