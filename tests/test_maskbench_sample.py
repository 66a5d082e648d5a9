"""MaskBench sample, byte level: over a fixed stratified sample of MaskBench schemas,
every schema the registry compiles (what users get: machine-mode conversion in strict
mode, then the lazy or the pushdown backend) must reject every invalid test instance
and accept >= 99.5% of the valid ones (canonical compact serialization, keys in
declared order), stepping the instance's bytes through a fresh matcher. The full
tokenized benchmark (masks, timings, other engines) is benchmarks/maskbench.py."""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import random
import re
import warnings
from collections import defaultdict
from pathlib import Path

import pytest

from sgl.runtime.constrained import registry
from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.json_schema import canonical_json
from sgl.runtime.constrained.vocab import cached_gguf_tokenizer_info
from tests.grammar_helpers import GGUF


DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "maskbench"
N_SAMPLE = 300
TIMEOUT_S = 10.0  # per schema, compile and check, as benchmarks/maskbench.py


def _sample() -> list[Path]:
    files = sorted(DATA.glob("*.json"))
    by: dict[str, list[Path]] = defaultdict(list)
    for f in files:
        key = f.name.split("---")[0] if "---" in f.name else re.sub(r"_\d+\.json$", "", f.name)
        by[key].append(f)
    rng = random.Random(1234)
    out: list[Path] = []
    for _, fs in sorted(by.items()):
        out += rng.sample(fs, min(len(fs), max(2, round(N_SAMPLE * len(fs) / len(files)))))
    return out


def _accepts(compiled, text: str) -> bool:
    g = compiled.new_matcher()
    try:
        g.accept_bytes(text.encode())
    except GrammarError:
        return False
    return g.can_end()


def _check(path: str) -> list[tuple[bool, bool, str]] | None:
    """(valid, accepted, text) per test instance, None if the registry refuses."""
    tok = cached_gguf_tokenizer_info(GGUF)
    d = json.loads(Path(path).read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            compiled = registry.compile_tables("json_schema", d["schema"], tok, use_cache=False)
        except Exception:  # noqa: BLE001 - undeclared: not counted
            return None
    out = []
    for t in d["tests"]:
        text = canonical_json(t["data"], d["schema"])
        out.append((bool(t["valid"]), _accepts(compiled, text), text))
    return out


def _serve(conn) -> None:
    while True:
        path = conn.recv()
        conn.send(_check(path))


@functools.lru_cache(maxsize=1)
def _run() -> tuple[int, int, int, list[str], list[str]]:
    # One forked worker checks the schemas; a schema that takes longer than
    # TIMEOUT_S (the benchmark's own bound) is undeclared and the worker is replaced,
    # since a DFA build in Rust cannot be interrupted.
    cached_gguf_tokenizer_info(GGUF)  # loaded once, inherited by every fork
    ctx = mp.get_context("fork")
    declared = valid_total = valid_ok = 0
    invalid_accepted: list[str] = []
    rejected_valid: list[str] = []
    old = os.environ.get("SGL_GRAMMAR_DISK_CACHE")
    os.environ["SGL_GRAMMAR_DISK_CACHE"] = "0"  # build every DFA: test the builder too
    proc = conn = None
    try:
        for f in _sample():
            if proc is None:
                conn, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(child,), daemon=True)
                proc.start()
            conn.send(str(f))
            if not conn.poll(TIMEOUT_S):
                proc.kill()
                proc.join()
                proc = None
                continue
            res = conn.recv()
            if res is None:
                continue
            declared += 1
            for valid, got, text in res:
                if valid:
                    valid_total += 1
                    valid_ok += got
                    if not got:
                        rejected_valid.append(f"{f.name}: {text[:120]}")
                elif got:
                    invalid_accepted.append(f"{f.name}: {text[:160]}")
    finally:
        if proc is not None:
            proc.kill()
            proc.join()
        if old is None:
            os.environ.pop("SGL_GRAMMAR_DISK_CACHE", None)
        else:
            os.environ["SGL_GRAMMAR_DISK_CACHE"] = old
    return declared, valid_total, valid_ok, invalid_accepted, rejected_valid


@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="MaskBench data not present")
@pytest.mark.timeout(900)
def test_maskbench_sample_no_invalid_accepted():
    declared, _, _, invalid_accepted, _ = _run()
    assert declared >= 50, declared
    assert not invalid_accepted, invalid_accepted


@pytest.mark.skipif(not DATA.exists(), reason="MaskBench data not present")
@pytest.mark.timeout(900)
def test_maskbench_sample_valid_accepted():
    _, valid_total, valid_ok, _, rejected_valid = _run()
    assert valid_ok >= 0.995 * valid_total, (valid_ok, valid_total, rejected_valid[:10])
