"""JSON Schema -> regex conversion time on MaskBench (issue 18, gap 2: compile time).

Times `schema_to_machines` alone (the pure-Python converter, before any DFA is built)
with the registry's options (its JSON whitespace, a leading one allowed), over the
same stratified sample `maskbench.py` uses, and prints p50/p90/p99/max plus the
slowest schemas. The converter memoizes pure helpers across schemas (json_schema/memo.py),
as a server process does: by default each schema is converted once, in order, with the
tables the schemas before it filled. `--cold` empties those tables before every
conversion instead, and only then may `--repeat` take the best of several runs (the
machine is shared; a warm repeat would hit what its own first run memoized).

`--save PATH` pickles every outcome ({file name: ("ok", root, subs) or ("error",
message)}, warnings included); `--compare PATH` checks this run's outcomes against such
a pickle and counts identical / changed ones, so a speed change to the converter can
prove it emits the same regexes.

  .venv/bin/python benchmarks/bench_convert.py --sample 2000
  .venv/bin/python benchmarks/bench_convert.py --sample 2000 --cold --repeat 3
  .venv/bin/python benchmarks/bench_convert.py --all --save /tmp/convert-golden.pkl
  .venv/bin/python benchmarks/bench_convert.py --sample 2000 --compare /tmp/convert-golden.pkl
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, print_table, write_json  # noqa: E402
from maskbench import DATA, pct, stratified_sample  # noqa: E402

from sgl.runtime.constrained.json_schema import Intersect, clear_memos, schema_to_machines  # noqa: E402
from sgl.runtime.constrained.registry import DEFAULT_JSON_WHITESPACE  # noqa: E402

Outcome = tuple[Any, ...]


def convert_once(schema: Any, cold: bool = False) -> tuple[float, Outcome]:
    """(seconds, outcome) of one conversion; the outcome is plain, comparable data.
    `cold` empties the converter's memo tables first (as in a fresh process)."""
    if cold:
        clear_memos()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        try:
            spec = schema_to_machines(schema, whitespace=DEFAULT_JSON_WHITESPACE, leading=True)
        except Exception as e:  # noqa: BLE001 - a refusal is an outcome too
            dt = time.perf_counter() - t0
            return dt, ("error", f"{type(e).__name__}: {e}", _messages(caught))
        dt = time.perf_counter() - t0
    subs = tuple(("intersect", s.parts) if isinstance(s, Intersect) else s for s in spec.subs)
    return dt, ("ok", spec.root, subs, _messages(caught))


def _messages(caught: list[warnings.WarningMessage]) -> tuple[str, ...]:
    return tuple(str(w.message) for w in caught)


def compare(outcomes: dict[str, Outcome], golden: dict[str, Outcome]) -> dict[str, Any]:
    same = [f for f in outcomes if golden.get(f) == outcomes[f]]
    changed = [f for f in outcomes if f in golden and golden[f] != outcomes[f]]
    missing = [f for f in outcomes if f not in golden]
    return {"identical": len(same), "changed": changed, "not_in_golden": len(missing)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sample", type=int, default=2000, help="stratified sample size")
    ap.add_argument("--all", action="store_true", help="every file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="best of this many runs per schema (with --cold)")
    ap.add_argument("--cold", action="store_true",
                    help="empty the converter's memo tables before each conversion")
    ap.add_argument("--top", type=int, default=12, help="slowest schemas to list")
    ap.add_argument("--save", help="pickle every outcome here")
    ap.add_argument("--compare", help="pickle of outcomes to compare this run's against")
    args = ap.parse_args()
    if args.repeat > 1 and not args.cold:
        # A repeat would hit the memo entries its own first run made.
        ap.error("--repeat above 1 needs --cold")
    files = stratified_sample(list(DATA.glob("*.json")), None if args.all else args.sample, args.seed)
    convert_once({"type": "object", "properties": {"a": {"type": "string"}}})  # imports
    times: dict[str, float] = {}
    outcomes: dict[str, Outcome] = {}
    t_all = time.perf_counter()
    for f in files:
        # Parsed just before it is converted (as the registry does): 11k schemas held
        # at once would make every full garbage collection walk all of them.
        name, schema = f.name, json.loads(f.read_text())["schema"]
        best = float("inf")
        for _ in range(args.repeat):
            dt, outcomes[name] = convert_once(schema, args.cold)
            best = min(best, dt)
        times[name] = best
    wall = time.perf_counter() - t_all
    ok = [times[f] for f, o in outcomes.items() if o[0] == "ok"]
    rows = [{"schemas": len(files), "converted": len(ok),
             "p50 ms": 1000 * pct(ok, .5), "p90 ms": 1000 * pct(ok, .9),
             "p99 ms": 1000 * pct(ok, .99), "max ms": 1000 * max(ok, default=float("nan")),
             "total s": sum(ok), "wall s": wall}]
    memos = "emptied before each schema" if args.cold else "kept across schemas, as in a server"
    print(f"cpu: {cpu_model()}; whitespace {DEFAULT_JSON_WHITESPACE!r}, leading; best of {args.repeat};"
          f" memo tables {memos}")
    print_table("schema_to_machines time (converted schemas)", rows)
    slow = sorted(((times[f], f) for f, o in outcomes.items() if o[0] == "ok"), reverse=True)
    print_table("slowest", [{"schema": f, "ms": 1000 * t} for t, f in slow[:args.top]])
    result: dict[str, Any] = {"args": vars(args), "summary": rows[0],
                              "per_schema_ms": {f: 1000 * t for f, t in times.items()}}
    if args.compare:
        golden = pickle.loads(Path(args.compare).read_bytes())
        cmp = compare(outcomes, golden)
        print(f"\noutputs vs {args.compare}: {cmp['identical']} identical, {len(cmp['changed'])} changed,"
              f" {cmp['not_in_golden']} not in it")
        for f in cmp["changed"][:20]:
            print(f"  changed: {f}")
        result["compare"] = cmp
    if args.save:
        Path(args.save).write_bytes(pickle.dumps(outcomes))
        print(f"saved {len(outcomes)} outcomes to {args.save}")
    name = "bench_convert" + ("_all" if args.all else "") + ("_cold" if args.cold else "")
    write_json(name + ".json", result)


if __name__ == "__main__":
    main()
