"""Compile caches (memory LRU, disk across processes), async compiler, batched mask apply."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from sgl.runtime.constrained import registry
from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.masks import allocate_masks, apply_masks, fill_masks
from sgl.runtime.constrained.registry import GrammarCompiler, compile_grammar, compile_tables
from sgl.runtime.constrained.vocab import greedy_encode
from tests.grammar_helpers import GGUF

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_memory_cache_hit_shares_tables_and_masks(tok, monkeypatch, tmp_path):
    monkeypatch.setenv("SGL_CACHE_DIR", str(tmp_path))
    spec = r"[a-c]{2}\d"
    a = compile_grammar("regex", spec, tok)
    before = registry.memory_cache_stats()["hits"]
    b = compile_grammar("regex", spec, tok)
    assert registry.memory_cache_stats()["hits"] == before + 1
    assert a is not b and a.compiled is b.compiled
    a.accept_token(greedy_encode(tok, "a")[0])
    ra, rb = (torch.zeros(tok.vocab_size, dtype=torch.bool) for _ in range(2))
    b.fill_mask(rb)
    a2 = compile_grammar("regex", spec, tok)
    a2.fill_mask(ra)
    assert torch.equal(ra, rb)  # fresh matchers start at the start state


_CHILD = r"""
import sys
from sgl.runtime.constrained import regex_grammar, registry
from sgl.runtime.constrained.vocab import cached_gguf_tokenizer_info
tok = cached_gguf_tokenizer_info(sys.argv[1])
if sys.argv[2] == "forbid":
    def boom(*a, **k):
        raise AssertionError("index rebuilt instead of loaded from disk")
    regex_grammar.build_index = boom
g = registry.compile_grammar("regex", r"(cat|dog)s? [0-9]{3}", tok)
print(sorted(g.allowed_token_ids())[:20])
"""


def test_disk_cache_survives_new_process(tmp_path):
    # the outlines Index path (the lazy DFA path has its own disk-cache test)
    env = dict(os.environ, SGL_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT, SGL_REGEX_BACKEND="outlines")
    run = lambda mode: subprocess.run([sys.executable, "-c", _CHILD, GGUF, mode], env=env,  # noqa: E731
                                      capture_output=True, text=True, timeout=300)
    first = run("build")
    assert first.returncode == 0, first.stderr
    assert list((tmp_path / "grammars").glob("*.pkl"))
    second = run("forbid")
    assert second.returncode == 0, second.stderr
    assert first.stdout == second.stdout


@pytest.mark.parametrize("bad", ["wrong width", "target out of range", "short accept", "not a DFA", "old pickle"])
def test_damaged_disk_dfa_is_rebuilt(tok, tmp_path, bad, monkeypatch):
    """A byte DFA read back from the disk cache with the wrong shape or targets (another
    version's pickle, a damaged file) is rebuilt and rewritten: before,
    the numpy backend raised in every request using it."""
    import numpy as np

    from sgl.runtime.constrained import dfa_build
    from sgl.runtime.constrained.byte_dfa import ByteDFA
    from sgl.runtime.constrained.cache import DiskCache

    rx = "[a-c]{2}x"
    good = dfa_build.build_byte_dfa(rx, "regex")
    assert good.well_formed()
    n = good.trans.shape[0]
    damaged = {
        "wrong width": ByteDFA(good.trans[:, :100].copy(), good.accept, good.initial),
        "target out of range": ByteDFA(np.where(good.trans >= 0, good.trans + n, -1), good.accept, good.initial),
        "short accept": ByteDFA(good.trans, good.accept[:-1], good.initial),
        "not a DFA": ByteDFA(good.trans, good.accept, n + 5),
        "old pickle": ByteDFA.__new__(ByteDFA),  # no fields at all
    }[bad]
    assert not damaged.well_formed()
    disk = DiskCache(tmp_path)
    key = registry.dfa_disk_key(rx)
    disk.put(key, damaged)
    got = registry._cached_dfa(rx, "regex", disk)
    assert got.well_formed() and np.array_equal(got.trans, good.trans)
    assert disk.get(key).well_formed()  # rewritten: the next process reads the good one
    disk.put(key, damaged)  # and the numpy backend, which compiles through the same cache, still matches
    monkeypatch.setenv("SGL_REGEX_BACKEND", "lazy")
    g = registry._build_lazy(rx, tok, "regex", disk).new_matcher()
    assert disk.get(key).well_formed()
    for t in greedy_encode(tok, "abx"):
        g.accept_token(t)
    mask = torch.zeros(tok.vocab_size, dtype=torch.bool)
    g.fill_mask(mask)
    assert mask[list(tok.eos_token_ids)].all() and mask.sum() == len(tok.eos_token_ids)  # complete: only EOS


def test_async_compiler(tok):
    comp = GrammarCompiler(tok, max_workers=1, timeout_s=60)
    try:
        f = comp.submit("lark", 'start: "x" NUM\nNUM: /[0-9]+/\n')
        g = f.result(timeout=60)
        assert g.jump_forward_string() == "x"
        bad = comp.submit("ebnf", "root ::= missing")
        with pytest.raises(GrammarError, match="ebnf"):
            bad.result(timeout=60)
        with pytest.raises(GrammarError, match="kind"):
            comp.submit("yaml", "x").result(timeout=1)
        again = comp.submit("lark", 'start: "x" NUM\nNUM: /[0-9]+/\n')
        assert again.done()  # memory-cache hit comes back already resolved
    finally:
        comp.shutdown()


def test_async_compiler_timeout(tok, monkeypatch):
    def slow(kind, spec, tok):
        time.sleep(1.0)
        raise AssertionError("unreachable result")

    monkeypatch.setattr(registry, "compile_grammar", slow)
    comp = GrammarCompiler(tok, timeout_s=0.1)
    try:
        with pytest.raises(GrammarError, match="timed out after 0.1s"):
            comp.submit("regex", "never-cached-[0-9]+").result(timeout=5)
    finally:
        comp.shutdown()


def test_apply_masks_only_touches_constrained_rows(tok):
    g = compile_grammar("regex", "[0-9]", tok)
    width = tok.vocab_size + 64  # lm_head padded wider than the vocabulary
    logits = torch.randn(3, width)
    orig = logits.clone()
    masks = allocate_masks(3, tok.vocab_size)
    rows = fill_masks([None, g, None], masks)
    assert rows == [1]
    apply_masks(logits, masks, rows)
    assert torch.equal(logits[0], orig[0]) and torch.equal(logits[2], orig[2])
    allowed = torch.isfinite(logits[1])
    assert set(torch.nonzero(allowed).flatten().tolist()) == set(g.allowed_token_ids())
    assert torch.equal(logits[1][allowed], orig[1][allowed])
    assert not allowed[tok.vocab_size:].any()
    same = logits.clone()
    assert torch.equal(apply_masks(same, masks, []), logits)


def test_choices_key_normalized(tok):
    a = compile_tables("choices", ["a", "b"], tok)
    b = compile_tables("choices", '["a", "b"]', tok)
    assert a is b
