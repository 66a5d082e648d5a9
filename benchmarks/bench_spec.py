"""Speculative decoding: tokens/s with it on vs off, side by side in one run.

Tasks where drafts pay (the output copies its context: rewrite a JSON object with one
field changed, continue a code file of similar functions, summarize a text quoting it)
and one where they don't (a free story). Each task runs at batch 1 and batch 8 (eight
variants of its prompt at once), greedy, on the same engine settings with
`--speculative-algorithm` off, `ngram`, and (batch 1, where given) `draft` with the
embedded model drafting for itself: the draft is always right, so that row shows the
ceiling of a draft model's acceptance and the cost of running one.

Each engine runs every task once untimed first, so the timed run's prompts are cached
(prefill is not what is measured) and the C kernels are built. Reported per row: output
tokens/s of the batch (all its output tokens / wall time), mean accept length (tokens a
request's decode step yields: 1 = no gain), accept rate of drafts, and the speed-up over
`off` for the same task and batch. Outputs of `off` and the speculating engines are
compared token for token (greedy: they must be identical; a mismatch is printed).

Run: .venv/bin/python benchmarks/bench_spec.py [--dtype auto] [--max-new-tokens 160]
     [--draft-tokens 4] [--batches 1 8] [--no-draft] [--draft-policy adaptive|always]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_flags, cpu_model, print_table, write_json  # noqa: E402

from sgl.runtime.engine import Engine  # noqa: E402
from sgl.runtime.models.loader import embedded_gguf_path  # noqa: E402

PEOPLE = [("Ada Lovelace", 1815, "London"), ("Alan Turing", 1912, "London"), ("Grace Hopper", 1906, "New York"),
          ("Marie Curie", 1867, "Warsaw"), ("Niels Bohr", 1885, "Copenhagen"), ("Emmy Noether", 1882, "Erlangen"),
          ("Carl Gauss", 1777, "Brunswick"), ("Lise Meitner", 1878, "Vienna")]

CODE = '''class Vector:
    def __init__(self, x: float, y: float) -> None:
        self.x = x
        self.y = y

    def add(self, other: "Vector") -> "Vector":
        return Vector(self.x + other.x, self.y + other.y)

    def sub(self, other: "Vector") -> "Vector":
        return Vector(self.x - other.x, self.y - other.y)

    def mul(self, other: "Vector") -> "Vector":
        return Vector(self.x * other.x, self.y * other.y)
'''

DOC = ("The river town of Millbrook was founded in 1820 by grain merchants. Its stone bridge, built in 1846, "
       "still carries traffic today. In 1901 a fire destroyed the old market hall, and the town rebuilt it in "
       "brick within two years. The railway arrived in 1872 and brought textile mills that employed half the "
       "town by 1900. The last mill closed in 1968, and the buildings now house a museum and artists' studios. "
       "Today Millbrook is known for its autumn fair, which has been held every October since 1885.")


def prompts(eng: Engine, task: str, n: int) -> list[str]:
    def chat(text: str) -> str:
        return eng.apply_chat_template([{"role": "user", "content": text}])

    out = []
    for i in range(n):
        name, born, city = PEOPLE[i % len(PEOPLE)]
        if task == "json_rewrite":
            rec = {"id": 1000 + i, "name": name, "born": born, "city": city, "email": f"user{i}@example.com",
                   "skills": ["mathematics", "writing", "teaching"], "active": True, "score": 87.5 + i,
                   "address": {"street": f"{10 + i} High Street", "zip": f"{40000 + i}", "country": "UK"}}
            out.append(chat("Rewrite this JSON object with the city changed to \"Paris\". Output only the JSON.\n"
                            + json.dumps(rec, indent=2)))
        elif task == "code_continue":
            out.append(CODE + f"\n    # variant {i}\n    def div(self, other: \"Vector\") -> \"Vector\":\n")
        elif task == "summarize_quotes":
            out.append(chat(f"Summarize this text for reader {i}: quote its three most important sentences "
                            f"word for word, each on its own line, then add one sentence of your own.\n\n" + DOC))
        elif task == "free_story":
            out.append(chat(f"Write an imaginative short story about {name} discovering a hidden door in {city}."))
        else:
            raise ValueError(task)
    return out


TASKS = ("json_rewrite", "code_continue", "summarize_quotes", "free_story")


def run_engine(label: str, kwargs: dict[str, Any], args: argparse.Namespace) -> dict[tuple[str, int], dict]:
    eng = Engine(max_total_tokens=16384, dtype=args.dtype, **kwargs)
    results: dict[tuple[str, int], dict] = {}
    try:
        for batch in args.batches:
            if label == "draft" and batch != 1:
                continue
            for task in TASKS:
                ps = prompts(eng, task, batch)
                sp = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": False}
                eng.generate(ps, [sp] * batch)  # warm: the timed run finds its prompts cached
                t0 = time.perf_counter()
                outs = eng.generate(ps, [sp] * batch)
                wall = time.perf_counter() - t0
                toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
                steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
                drafted = sum(o["meta_info"].get("spec_draft_tokens", 0) for o in outs)
                accepted = sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs)
                results[(task, batch)] = {
                    "tok_s": toks / wall, "tokens": toks, "wall_s": wall,
                    "accept_length": (toks - batch) / steps if steps else 1.0,  # decode tokens per decode step
                    "accept_rate": accepted / drafted if drafted else None,
                    "output_ids": [o["output_ids"] for o in outs],
                }
                print(f"{label:6s} {task:17s} batch {batch}: {toks / wall:7.1f} tok/s "
                      f"({toks} tokens, {wall:.1f} s)", flush=True)
    finally:
        eng.shutdown()
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--no-draft", action="store_true", help="skip the draft-model rows")
    ap.add_argument("--draft-policy", default="adaptive", choices=("adaptive", "always"))
    args = ap.parse_args()
    print(f"cpu: {cpu_model()}\nflags: {cpu_flags()}")
    engines: dict[str, dict[str, Any]] = {
        "off": {},
        "ngram": {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": args.draft_tokens,
                  "speculative_draft_policy": args.draft_policy},
    }
    if not args.no_draft:
        engines["draft"] = {"speculative_algorithm": "draft", "speculative_num_draft_tokens": args.draft_tokens,
                            "speculative_draft_policy": args.draft_policy,
                            "speculative_draft_model_path": str(embedded_gguf_path())}
    res = {label: run_engine(label, kw, args) for label, kw in engines.items()}
    rows = []
    mismatches = []
    for (task, batch), base in res["off"].items():
        for label in engines:
            r = res[label].get((task, batch))
            if r is None:
                continue
            same = r["output_ids"] == base["output_ids"]
            if not same:
                mismatches.append(f"{label} {task} batch {batch}")
            rows.append({"task": task, "batch": batch, "spec": label, "tok/s": r["tok_s"],
                         "speed-up": r["tok_s"] / base["tok_s"], "accept length": r["accept_length"],
                         "accept rate": r["accept_rate"] if r["accept_rate"] is not None else "-",
                         "same output": "yes" if same else "NO"})
    print_table(f"speculative decoding, {args.draft_tokens} drafts, greedy, {args.max_new_tokens} new tokens max "
                f"({cpu_model()})", rows)
    if mismatches:
        print("\noutputs differ from spec off:", ", ".join(mismatches))
    write_json("bench_spec.json", {"args": vars(args), "rows": rows, "mismatches": mismatches})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
