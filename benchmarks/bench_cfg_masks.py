"""CFG mask benchmark (issue 18, gap 3): compile time and per-step mask time of a GBNF
grammar at the embedded model's 49k vocabulary, on the states of generated sequences.

A "generated sequence" here is a fixed set of documents the grammar accepts (for the
JSON-like grammar, JSON texts of the shapes a model writes: nested objects, arrays,
strings with escapes, numbers), tokenized greedily; each document is fed token by
token to one matcher and every state's mask is filled into a bool row and timed, as
the decode loop does. Tables are compiled fresh (no memory or disk cache), so first
visits to a state pay for their walk and later visits hit the caches, as in serving.

Routes: `cfg` (the general route, cfg_machines.py: what `ebnf` uses, on the native
engine), `cfg-numpy` (the same route on the numpy backend, SGL_REGEX_BACKEND=lazy), `lalr` (the old
GBNF -> Lark LALR(1) translation with our lexer, lark_grammar.py; only for grammars
that are LALR(1)), and `llguidance` when installed (its own matcher, its mask into a
bitmask unpacked into the same bool row, for comparison).

Run: .venv/bin/python benchmarks/bench_cfg_masks.py [--grammar tests/data/gbnf/json.gbnf]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sgl.runtime.constrained.vocab import cached_gguf_tokenizer_info, greedy_encode  # noqa: E402
from sgl.runtime.models.loader import embedded_gguf_path  # noqa: E402

DOCS = [
    '{"name": "Tom", "age": 3, "tags": ["cat", "orange"], "owner": {"name": "Ann", "city": "Oslo"}}',
    '[1, 2.5, -3e2, true, false, null, {"x": [], "y": {}}]',
    '{"id": 17, "title": "A \\"quoted\\" word and caf\u00e9", "items": [{"sku": "A-1", "qty": 2},'
    ' {"sku": "B-22", "qty": 10}], "paid": true, "note": null}',
    '{\n  "data": {\n    "list": [\n      1,\n      2\n    ],\n    "ok": false\n  }\n}',
    '{"matrix": [[1, 0, 0], [0, 1, 0], [0, 0, 1]], "label": "identity \\u00e9\\n"}',
]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q))


def run_route(name: str, make: Callable[[], Any], docs: list[str], tok: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    compiled = make()
    compile_ms = (time.perf_counter() - t0) * 1e3
    times: list[float] = []
    row = torch.zeros(tok.vocab_size, dtype=torch.bool)
    view = row.numpy()  # cleared with a memset, as the sampler does (masks.fill_masks)
    for doc in docs:
        g = compiled.new_matcher()
        for tid in greedy_encode(tok, doc) + [tok.eos_token_ids[0]]:
            view.fill(False)
            t = time.perf_counter()
            g.fill_mask(row)
            times.append((time.perf_counter() - t) * 1e3)
            assert row[tid], (name, "document token refused", tok.token_bytes[tid])
            g.accept_token(tid)
    return {"route": name, "compile_ms": round(compile_ms, 1), "masks": len(times),
            "mask_p50_ms": round(statistics.median(times), 3), "mask_p90_ms": round(pct(times, 90), 3),
            "mask_p99_ms": round(pct(times, 99), 3), "mask_max_ms": round(max(times), 2)}


def llguidance_make(gbnf: str, tok: Any) -> Callable[[], Any] | None:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return None
    from sgl.runtime.constrained.llg import CompiledLLG, llg_tokenizer

    llg_tokenizer(tok)  # per vocabulary, not per grammar
    return lambda: CompiledLLG("ebnf", gbnf, tok)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grammar", default=str(ROOT / "tests/data/gbnf/json.gbnf"))
    ap.add_argument("--docs", default=None, help="JSON list of documents (default: JSON texts)")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()
    import os

    os.environ["SGL_GRAMMAR_DISK_CACHE"] = "0"
    from sgl.runtime.constrained.registry import compile_tables
    from sgl.runtime.constrained.gbnf import gbnf_to_lark
    from sgl.runtime.constrained.lark_grammar import CompiledLark

    from sgl.runtime.constrained.lazy_regex import VocabWalker

    gguf = str(embedded_gguf_path())
    tok = cached_gguf_tokenizer_info(gguf)
    VocabWalker.of(tok)  # the per-vocabulary byte table: built once per process, not per grammar
    gbnf = Path(args.grammar).read_text(encoding="utf-8")
    docs = json.loads(Path(args.docs).read_text()) if args.docs else DOCS
    compile_tables("regex", "[a-z]+", tok, use_cache=False).new_matcher().allowed_token_ids()  # native library, trie

    def numpy_route() -> Any:
        os.environ["SGL_REGEX_BACKEND"] = "lazy"
        try:
            return compile_tables("ebnf", gbnf, tok, use_cache=False)
        finally:
            os.environ.pop("SGL_REGEX_BACKEND", None)

    rows = [run_route("cfg", lambda: compile_tables("ebnf", gbnf, tok, use_cache=False), docs, tok),
            run_route("cfg-numpy", numpy_route, docs, tok)]
    try:
        rows.append(run_route("lalr", lambda: CompiledLark(gbnf_to_lark(gbnf), tok, kind="ebnf"), docs, tok))
    except Exception as e:  # noqa: BLE001 - a non-LALR grammar: no row
        print(f"lalr route: {type(e).__name__}: {str(e)[:120]}")
    make = llguidance_make(gbnf, tok)
    if make is not None:
        rows.append(run_route("llguidance", make, docs, tok))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import cpu_model

    print(f"grammar {Path(args.grammar).name}, vocab {tok.vocab_size}, {len(docs)} documents, host {cpu_model()}")
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
    if args.json:
        Path(args.json).write_text(json.dumps({"host": cpu_model(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
