"""--grammar-backend (SGL_GRAMMAR_BACKEND): ours, llguidance, xgrammar (when installed) and
outlines behind the same Grammar protocol: each accepts and refuses the same texts token
by token (mask and accept_token agreeing), and a backend that cannot take a kind says so."""

from __future__ import annotations

import importlib.util
import json

import pytest

from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.matcher import GrammarMatcher
from sgl.runtime.constrained.registry import compile_grammar
from sgl.runtime.constrained.vocab import greedy_encode

ARITH = 'root ::= expr\nexpr ::= expr ("+" | "-") term | term\nterm ::= [0-9]+ | "(" expr ")"\n'
LARK = 'start: item ("," item)*\nitem: NUMBER | "x"\n%import common.NUMBER\n'
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                     "additionalProperties": False})

CASES = {
    "regex": (r"[a-c]{2}\d", ["ab1", "cc9"], ["ab", "abc", "d11"]),
    "choices": (["yes", "no"], ["yes", "no"], ["ye", "maybe"]),
    "json_schema": (SCHEMA, ['{"a":1}', '{"a":-20}'], ['{"a":"x"}', '{}', '{"a":1,"b":2}']),
    "ebnf": (ARITH, ["1", "1+2-(3+4)", "10-2-3"], ["", "1+", "(1", "+1"]),
    "lark": (LARK, ["1", "1,x,2.5"], ["", "1,", "y"]),
}

BACKENDS = ["ours", "llguidance", "outlines"] + (
    ["xgrammar"] if importlib.util.find_spec("xgrammar") else [])


def full(tok, kind, spec, text) -> bool:
    m = GrammarMatcher(kind, spec, tok)
    for tid in greedy_encode(tok, text):
        allowed = bool(m.new_mask()[tid])
        ok = m.accept_token(tid)
        assert ok == allowed, ("mask and accept_token disagree", kind, text, tok.token_bytes[tid])
        if not ok:
            return False
    return bool(m.new_mask()[tok.eos_token_ids[0]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(CASES))
def test_backend_accepts_and_refuses(tok, monkeypatch, backend, kind):
    monkeypatch.setenv("SGL_GRAMMAR_BACKEND", backend)
    monkeypatch.setenv("SGL_GRAMMAR_DISK_CACHE", "0")
    spec, good, bad = CASES[kind]
    if backend == "outlines" and kind in ("ebnf", "lark"):
        with pytest.raises(GrammarError, match="outlines grammar backend supports regex"):
            compile_grammar(kind, spec, tok)
        return
    for text in good:
        assert full(tok, kind, spec, text), (backend, kind, text)
    for text in bad:
        assert not full(tok, kind, spec, text), (backend, kind, text)


def test_unknown_backend_is_a_clear_error(tok, monkeypatch):
    monkeypatch.setenv("SGL_GRAMMAR_BACKEND", "nope")
    with pytest.raises(GrammarError, match="SGL_GRAMMAR_BACKEND='nope': expected one of ours, llguidance"):
        compile_grammar("regex", "a", tok)


def test_cli_flag_exists():
    from sgl.launch_server import build_parser

    args = build_parser().parse_args(["--grammar-backend", "llguidance"])
    assert args.grammar_backend == "llguidance"


def test_xgrammar_missing_is_a_clear_error(monkeypatch):
    import sys

    from sgl.runtime.constrained import xgr

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import now fails as if not installed
    with pytest.raises(GrammarError, match="'xgrammar' is not installed"):
        xgr._module()
