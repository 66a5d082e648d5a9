"""Accuracy at the constraint boundary (issue 18, gap 1): do constraints cost right answers?

100 short questions with known answers (benchmarks/data/boundary_questions.jsonl: 70 with
an integer answer, 30 with a fixed set of options) are answered by the embedded model,
greedy, few-shot, in prompts that end three ways: "Answer:" (`:`), "Answer: " (`: `) and
"Answer:\\n" (`\\n`). Each integer question is answered with `gen_int`, with a regex a user
would write (`[0-9]+`), with a JSON schema (`{"answer": integer}`, in a JSON-answer
few-shot prompt), and unconstrained then parsed (the first integer of the text, in both
prompt styles); each option question with `select` and unconstrained then parsed (the
option that appears first).

Two behaviours, in one run, each on its own engine:
- `today`: no token healing; SGLang's `gen_int` (regex `[-+]?[0-9]+[ \\n]*`, stops " "
  and "\\n"); `select` scores each option exactly as written; compact JSON (sent as the
  schema's compact regex) and jump-forward over the whole forced text
  (--disable-jump-forward-healing).
- `new`: token healing on (what the DSL sends on an sgl backend); the DSL's typed-gen
  pattern (one optional space or newline before the value unless the prompt ends in one,
  sgl/lang/ir.py typed_regex) and regex form (the user's regex between an optional space,
  left out after a prompt ending in whitespace, and an optional trailing space/newline,
  TOLERANT_REGEX); `select` also scores " option" after a prefix that ends
  in a non-space; JSON as the server sends a json_schema now (`json`: one optional space
  between JSON tokens and before the value, registry.DEFAULT_JSON_WHITESPACE, and
  jump-forward holding back a forced tail the model would extend), and compact (`json
  compact`, the schema's compact regex, same engine) to show what the whitespace buys.

The value is parsed as the DSL stores it (gen_int: the digits; select: the option). Target
of the issue: each constrained row >= the unconstrained-parsed row of its prompt style, in
every prompt shape. Prints lscpu's model name; writes results/bench_boundary_accuracy.json.

Run: .venv/bin/python benchmarks/bench_boundary_accuracy.py [--limit N] [--methods json]
(--methods: comma-separated words; a method runs if its name contains one, e.g. `json`
runs the JSON rows and their unconstrained baseline; `select,option` the option rows).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, print_table, write_json  # noqa: E402

from sgl.lang.backends.engine import EngineBackend  # noqa: E402
from sgl.lang.choices import token_length_normalized  # noqa: E402
from sgl.lang.interpreter import dtype_constraint, regex_result, typed_result  # noqa: E402
from sgl.lang.ir import REGEX_INT, TOLERANT_REGEX, TOLERANT_REGEX_AFTER_SPACE  # noqa: E402
from sgl.runtime.constrained.regex_grammar import json_schema_to_regex  # noqa: E402
from sgl.runtime.engine import Engine  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "boundary_questions.jsonl"
SHAPES = {":": ":", ": ": ": ", "\\n": ":\n"}  # label -> how the prompt ends after "Answer"

NUM_HEAD = ("Answer each question with a number.\n\n"
            "Question: How many wheels does a car have?\nAnswer: 4\n\n"
            "Question: What is 3 plus 4?\nAnswer: 7\n\n")
JSON_HEAD = ("Answer each question in JSON.\n\n"
             "Question: How many wheels does a car have?\nAnswer: {\"answer\": 4}\n\n"
             "Question: What is 3 plus 4?\nAnswer: {\"answer\": 7}\n\n")
CHOICE_HEAD = ("Answer each question with one of the options.\n\n"
               "Question: What is the capital of Peru? Options: Lima, Quito, Bogota.\nAnswer: Lima\n\n"
               "Question: Is lava hot or cold? Options: hot, cold.\nAnswer: hot\n\n")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


def load(limit: int | None) -> tuple[list[dict], list[dict]]:
    items = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    ints = [it for it in items if it["kind"] == "int"]
    chs = [it for it in items if it["kind"] == "choice"]
    if limit:
        ints, chs = ints[: max(1, limit * 7 // 10)], chs[: max(1, limit * 3 // 10)]
    return ints, chs


def first_int(text: str) -> int | None:
    m = re.search(r"-?\d+", text)
    return int(m.group(0)) if m else None


def as_int(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def json_answer(text: str) -> int | None:
    try:
        v = json.loads(text).get("answer")
    except (ValueError, AttributeError):
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def first_choice(text: str, choices: list[str]) -> str | None:
    low = text.lower()
    hits = [(m.start(), c) for c in choices for m in [re.search(r"\b" + re.escape(c.lower()) + r"\b", low)] if m]
    return min(hits)[1] if hits else None


def run_gens(engine: Engine, prompts: list[str], params: dict[str, Any]) -> list[str]:
    sp = {"temperature": 0.0, **params}
    res = engine.generate(prompts, [dict(sp) for _ in prompts])
    return [r["text"] for r in res]


def int_methods(mode: str, end: str) -> dict[str, tuple[str, dict[str, Any], Any]]:
    """method -> (prompt head, sampling params, text -> value) for one behaviour and one
    prompt ending (the DSL's patterns depend on whether the prompt ends in whitespace)."""
    heal = mode == "new"
    after_space = end.endswith((" ", "\n"))
    if heal:
        regex, stops = dtype_constraint(int, after_space)
        gen_int = {"regex": regex, "max_new_tokens": 6, **({"stop": stops} if stops else {})}
        gen_int_value = lambda t: as_int(typed_result(t)[1])  # noqa: E731
    else:
        gen_int = {"regex": REGEX_INT, "stop": [" ", "\n"], "max_new_tokens": 6}
        gen_int_value = as_int
    base = {"token_healing": heal}
    user = r"[0-9]+"  # a regex gen as a user writes it; the DSL sends TOLERANT_REGEX of it
    tolerant = TOLERANT_REGEX_AFTER_SPACE if after_space else TOLERANT_REGEX
    regex = {"regex": tolerant.format(user) if heal else user, "max_new_tokens": 6, **base}
    out = {
        "gen_int": (NUM_HEAD, {**gen_int, **base}, gen_int_value),
        "regex [0-9]+": (NUM_HEAD, regex, lambda t: as_int(regex_result(t, user)[1])),
        "free (number prompt)": (NUM_HEAD, {"max_new_tokens": 8, **base}, first_int),
        "json": (JSON_HEAD, {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 16, **base}, json_answer),
        "free (json prompt)": (JSON_HEAD, {"max_new_tokens": 16, **base}, first_int),
    }
    compact = {"regex": json_schema_to_regex(json.dumps(SCHEMA)), "max_new_tokens": 16, **base}
    if heal:
        out["json compact"] = (JSON_HEAD, compact, json_answer)
    else:  # today's server default for a json_schema
        out["json"] = (JSON_HEAD, compact, json_answer)
    return out


def wanted(name: str, words: list[str] | None) -> bool:
    return words is None or any(w in name for w in words)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="use about this many questions (smoke runs)")
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--max-running-requests", type=int, default=None,
                    help="cap the batch (e.g. 16: every step then fits the C decode kernel's rows, so a "
                         "request's logits no longer depend on which path its batch took)")
    ap.add_argument("--methods", default=None, help="comma-separated words: run the methods whose name "
                                                    "contains one (default: all)")
    args = ap.parse_args()
    words = args.methods.split(",") if args.methods else None
    ints, chs = load(args.limit)
    print(f"cpu: {cpu_model()}\nquestions: {len(ints)} integer, {len(chs)} option")
    t0 = time.perf_counter()
    acc: dict[tuple[str, str], dict[str, float]] = {}
    samples: dict[str, Any] = {}
    for mode in ("today", "new"):
        caps = {} if args.max_running_requests is None else {"max_running_requests": args.max_running_requests}
        engine = Engine(max_total_tokens=args.max_total_tokens, disable_jump_forward_healing=mode == "today", **caps)
        backend = EngineBackend(engine)
        try:
            for method in int_methods(mode, ":"):
                if not wanted(method, words):
                    continue
                for label, end in SHAPES.items():
                    head, params, value = int_methods(mode, end)[method]
                    prompts = [f"{head}Question: {it['question']}\nAnswer{end}" for it in ints]
                    texts = run_gens(engine, prompts, params)
                    ok = [value(t) == it["answer"] for t, it in zip(texts, ints)]
                    acc.setdefault((method, mode), {})[label] = 100.0 * sum(ok) / len(ok)
                    samples[f"{method}|{mode}|{label}"] = texts[:5]
            for label, end in SHAPES.items():
                prompts = [f"{CHOICE_HEAD}Question: {it['question']} Options: {', '.join(it['choices'])}.\nAnswer{end}"
                           for it in chs]
                if wanted("select", words):
                    picks = []
                    for p, it in zip(prompts, chs):
                        if mode == "new":
                            picks.append(backend.select(p, it["choices"], 0.0, token_length_normalized).decision)
                        else:  # each option scored exactly as written, as before
                            normalized = backend._score(p, it["choices"], False)[0]
                            picks.append(it["choices"][max(range(len(normalized)), key=lambda i: (normalized[i], -i))])
                    ok = [pk == it["answer"] for pk, it in zip(picks, chs)]
                    acc.setdefault(("select", mode), {})[label] = 100.0 * sum(ok) / len(ok)
                    samples[f"select|{mode}|{label}"] = picks[:5]
                if wanted("free (option prompt)", words):
                    texts = run_gens(engine, prompts, {"max_new_tokens": 6, "token_healing": mode == "new"})
                    ok = [first_choice(t, it["choices"]) == it["answer"] for t, it in zip(texts, chs)]
                    acc.setdefault(("free (option prompt)", mode), {})[label] = 100.0 * sum(ok) / len(ok)
        finally:
            engine.shutdown()
    wall = time.perf_counter() - t0
    rows = [{"method": m, "behaviour": mode, **{f"acc% '{s}'": acc[(m, mode)][s] for s in SHAPES}}
            for (m, mode) in sorted(acc, key=lambda k: (k[0], k[1] != "today"))]
    print_table(f"boundary accuracy, greedy, {len(ints)} integer + {len(chs)} option questions ({cpu_model()})", rows)
    print(f"\nwall: {wall:.0f} s")
    write_json("bench_boundary_accuracy.json", {"rows": rows, "samples": samples, "wall_s": wall,
                                                "questions": {"int": len(ints), "choice": len(chs)}})


if __name__ == "__main__":
    main()
