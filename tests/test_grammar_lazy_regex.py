"""Lazy regex backend (byte DFA, masks on demand) against outlines-core's full Index.

The reference is outlines-core on the same regex and vocabulary; allowed-token sets must
be identical at every step of driving several strings, except for tokens that end in a
lone UTF-8 lead byte, which outlines-core never indexes (we allow them: byte-fallback
tokens are legitimate, and the next token completes the character).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from sgl.runtime.constrained import dfa_build, registry
from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.dfa_build import build_byte_dfa
from sgl.runtime.constrained.lazy_regex import CompiledLazyRegex, LazyRegexGrammar
from sgl.runtime.constrained.native.compiled import CompiledNative
from sgl.runtime.constrained.pushdown import CompiledPushdown
from sgl.runtime.constrained.regex_grammar import CompiledRegex, build_index
from sgl.runtime.constrained.vocab import greedy_encode

MASKBENCH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "maskbench"

IPV4 = r"((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)"
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
PERSON = r'\{"name":"[^"\\]{1,12}","age":(0|[1-9][0-9]{0,2}),"tags":\[("[a-z]+"(,"[a-z]+")*)?\]\}'


@pytest.fixture(scope="module")
def lead_tail(tok):
    """Token ids whose bytes end in a UTF-8 lead byte (outlines-core never allows them)."""
    return {i for i, b in enumerate(tok.token_bytes) if b and 0xC2 <= b[-1] <= 0xF4}


def lazy(regex, tok):
    return CompiledLazyRegex(build_byte_dfa(regex), tok).new_matcher()


def outlines(regex, tok):
    return CompiledRegex(build_index(regex, tok), tok).new_matcher()


def compare_drive(tok, regex, text, lead_tail):
    """Drive both backends through `text`; assert equal masks at every step."""
    a, b = lazy(regex, tok), outlines(regex, tok)
    for tid in greedy_encode(tok, text) + [None]:
        sa = set(a.allowed_token_ids()) - lead_tail
        sb = set(b.allowed_token_ids()) - lead_tail
        assert sa == sb, (text, len(sa - sb), len(sb - sa))
        assert a.can_end() == b.can_end() and a.is_terminated() == b.is_terminated()
        if tid is None or tid not in sb:
            return b.can_end() and tid is None
        a.accept_token(tid)
        b.accept_token(tid)


@pytest.mark.parametrize("regex,texts", [
    (IPV4, ["192.168.0.1", "8.8.8.8", "256.1.1.1", "1.2.3"]),
    (DATE, ["2024-01-31", "1999-12-01", "2024-13-01"]),
    (PERSON, ['{"name":"Bob","age":42,"tags":["a","bc"]}', '{"name":"Zoë ünï","age":7,"tags":[]}',
              '{"name":"","age":1,"tags":[]}']),
])
def test_masks_equal_outlines_core(tok, lead_tail, regex, texts):
    results = [compare_drive(tok, regex, t, lead_tail) for t in texts]
    assert results[0] is True  # the first text of each list matches
    assert not all(results)  # and some other does not


def _maskbench_case(name):
    d = json.loads((MASKBENCH / name).read_text())
    from sgl.runtime.constrained.json_schema import canonical_json, schema_to_regex

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rx = schema_to_regex(d["schema"], strict=True)
    return rx, [(canonical_json(t["data"], d["schema"]), t["valid"]) for t in d["tests"]]


@pytest.mark.skipif(not MASKBENCH.exists(), reason="MaskBench data not present")
@pytest.mark.parametrize("name", ["BFCL_simple_48.json", "WashingtonPost---wp_69_Normalized.json",
                                  "Snowplow---sp_219_Normalized.json"])
def test_maskbench_schemas_equal_outlines_core(tok, lead_tail, name):
    rx, tests = _maskbench_case(name)
    for text, valid in tests:
        assert compare_drive(tok, rx, text, lead_tail) == valid, text


def test_lone_lead_byte_tokens_allowed_and_completed(tok):
    g = lazy(r'"[^"]*"', tok)
    g.accept_bytes(b'"')
    lead = tok.token_bytes.index(b"\xc3")
    assert lead in g.allowed_token_ids()
    g.accept_token(lead)
    allowed = set(g.allowed_token_ids())
    assert tok.token_bytes.index(b"\xa9") in allowed  # completes é
    assert tok.token_bytes.index(b'"') not in allowed  # a character is half spelled
    g.accept_token(tok.token_bytes.index(b"\xa9"))
    g.accept_bytes(b'"')
    assert g.can_end() and g.is_terminated()


def test_jump_forward_rollback_eos(tok):
    g = lazy(r"abc[0-9]|abd", tok)
    assert g.jump_forward_string() == "ab"
    g.accept_bytes(b"ab")
    assert g.jump_forward_string() is None  # c or d
    assert lazy("é[0-9]", tok).jump_forward_string() == "é"
    h = lazy(r'\{"k":(true|false)\}', tok)
    assert h.jump_forward_string() == '{"k":'
    h.accept_bytes(b'{"k":t')
    assert h.jump_forward_string() == "rue}"
    eos = tok.eos_token_ids[0]
    assert eos not in h.allowed_token_ids()
    with pytest.raises(GrammarError):
        h.accept_token(eos)
    h.accept_bytes(b"rue}")
    assert h.can_end() and h.is_terminated() and h.jump_forward_string() is None
    row = torch.zeros(tok.vocab_size, dtype=torch.bool)
    h.fill_mask(row)
    assert torch.nonzero(row).flatten().tolist() == [eos]
    h.accept_token(eos)
    assert h.is_terminated()
    h.rollback(2)
    assert h.num_accepted() == 1 and not h.can_end()
    with pytest.raises(ValueError):
        h.rollback(2)
    c = h.copy()
    assert c.compiled is h.compiled and c.num_accepted() == 0


def test_accept_token_agrees_with_mask(tok):
    g = lazy(PERSON, tok)
    rng = np.random.default_rng(0)
    for tid in greedy_encode(tok, '{"name":"Al'):
        g.accept_token(tid)
    row = torch.zeros(tok.vocab_size, dtype=torch.bool)
    g.fill_mask(row)
    for tid in rng.choice(tok.vocab_size, 300, replace=False).tolist():
        h = LazyRegexGrammar(g.compiled)
        h.states = list(g.states)
        try:
            h.accept_token(tid)
            ok = True
        except GrammarError:
            ok = False
        assert ok == bool(row[tid]), tid


def test_masks_cached_per_state(tok):
    c = CompiledLazyRegex(build_byte_dfa(r"[a-z]+"), tok)
    g = c.new_matcher()
    g.allowed_token_ids()
    g.accept_bytes(b"x")
    first = c.mask_computes
    for _ in range(3):
        g.accept_bytes(b"y")
        g.allowed_token_ids()
    assert c.mask_computes == first + 1  # every later state is the same DFA state


def test_interegular_engine_agrees_on_ascii(tok):
    for rx in (IPV4, PERSON.replace("[^\"\\\\]", "[a-zA-Z ]")):
        a = CompiledLazyRegex(build_byte_dfa(rx, engine="rust"), tok).new_matcher()
        b = CompiledLazyRegex(build_byte_dfa(rx, engine="interegular"), tok).new_matcher()
        text = "10.0.0.255" if rx == IPV4 else '{"name":"Al B","age":9,"tags":["x"]}'
        for tid in greedy_encode(tok, text):
            assert a.allowed_token_ids() == b.allowed_token_ids()
            a.accept_token(tid)
            b.accept_token(tid)
        assert a.can_end() and b.can_end()


def test_unsupported_regex_is_grammar_error(tok):
    with pytest.raises(GrammarError, match="regex"):
        build_byte_dfa(r"a(?=b)")
    with pytest.raises(GrammarError):
        build_byte_dfa(r"a[^\x00-\U0010ffff]")  # matches nothing


def test_registry_backend_choice_and_disk_cache(tok, monkeypatch, tmp_path):
    monkeypatch.setenv("SGL_CACHE_DIR", str(tmp_path))
    spec = r"(cat|dog)s? [0-9]{3}"

    def boom(*a, **k):
        raise AssertionError("a whole DFA was built")

    # native (the default): compiling parses the regex, no DFA is built or stored
    with monkeypatch.context() as m:
        m.setattr(dfa_build, "build_byte_dfa", boom)
        g = registry.compile_grammar("regex", spec, tok)
    assert isinstance(g.compiled, CompiledNative)
    assert not list((tmp_path / "grammars").glob("*.pkl"))
    # the numpy backend builds the byte DFA, stores it, and loads it next time
    monkeypatch.setenv("SGL_REGEX_BACKEND", "lazy")
    lazy = registry.compile_grammar("regex", spec, tok)
    assert isinstance(lazy.compiled, CompiledLazyRegex)
    assert list((tmp_path / "grammars").glob("*.pkl"))
    registry.clear_memory_cache()
    monkeypatch.setattr(dfa_build, "build_byte_dfa", boom)
    g2 = registry.compile_grammar("regex", spec, tok)
    assert g2.allowed_token_ids() == lazy.allowed_token_ids() == sorted(g.allowed_token_ids())
    monkeypatch.setenv("SGL_REGEX_BACKEND", "outlines")
    g3 = registry.compile_grammar("regex", spec, tok)
    assert isinstance(g3.compiled, CompiledRegex)
    assert set(g3.allowed_token_ids()) == set(g.allowed_token_ids())
    monkeypatch.setenv("SGL_REGEX_BACKEND", "nope")
    with pytest.raises(GrammarError, match="SGL_REGEX_BACKEND"):
        registry.compile_grammar("regex", spec + "x", tok)


@pytest.mark.parametrize("backend,single,machines", [("native", CompiledNative, CompiledNative),
                                                      ("lazy", CompiledLazyRegex, CompiledPushdown)])
def test_json_schema_and_choices_backends(tok, monkeypatch, backend, single, machines):
    monkeypatch.setenv("SGL_REGEX_BACKEND", backend)
    g = registry.compile_grammar("choices", ["yes", "no"], tok)
    assert isinstance(g.compiled, single)
    closed = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    j = registry.compile_grammar("json_schema", closed, tok)
    assert isinstance(j.compiled, single)  # fits one regex: one machine
    j.accept_bytes(b'{"ok":true}')
    assert j.can_end()
    # Extra members may be any JSON value at any depth: a free-form machine, pushdown.
    open_ = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    p = registry.compile_grammar("json_schema", open_, tok)
    assert isinstance(p.compiled, machines) and p.compiled.num_machines > 1
    p.accept_bytes(b'{"ok":true,"x":[{"y":[null]}]}')
    assert p.can_end()


def _full_match(g, text: str) -> bool:
    try:
        g.accept_bytes(text.encode())
    except GrammarError:
        return False
    return g.can_end()


@pytest.mark.parametrize("engine", ["rust", "interegular"])
def test_alternatives_where_one_is_a_prefix_of_another(tok, engine):
    # The Rust DFA has leftmost-first semantics: without the end marker, `(?:a|ab)`
    # stopped at "a" and "ab" was refused.
    for rx, good, bad in [("(?:a|ab)", ["a", "ab"], ["abb", "b", ""]),
                          ("(?:x|xy|xyz)w?", ["x", "xy", "xyz", "xyzw", "xw"], ["xyzww", "y"]),
                          ("(?:a*|b)c?", ["", "aa", "b", "aac", "c"], ["bb", "ab"])]:
        dfa = build_byte_dfa(rx, engine=engine)
        for text in good + bad:
            assert _full_match(CompiledLazyRegex(dfa, tok).new_matcher(), text) == (text in good), (rx, text)


def test_choices_and_enum_with_prefix_members(tok, regex_backend):
    g = registry.compile_tables("choices", ["yes", "yes please", "no"], tok, use_cache=False)
    for text, ok in [("yes", True), ("yes please", True), ("no", True), ("yes p", False)]:
        assert _full_match(g.new_matcher(), text) == ok, text
    m = g.new_matcher()
    m.accept_bytes(b"yes")
    assert m.can_end() and not m.is_terminated() and m.allowed_token_ids()  # may go on
    schema = {"enum": ["a", "ab"]}
    j = registry.compile_tables("json_schema", schema, tok, use_cache=False)
    for text, ok in [('"a"', True), ('"ab"', True), ('"b"', False), ('"abb"', False)]:
        assert _full_match(j.new_matcher(), text) == ok, text
    k = registry.compile_tables("json_schema", {"type": "array", "items": {"enum": ["a", "ab"]}},
                                tok, use_cache=False)
    assert _full_match(k.new_matcher(), '["ab","a","ab"]')


def test_end_marker_code_point_is_never_text(tok):
    # U+10FFFF is the end marker (cut out of every DFA); its neighbours stay text.
    dfa = build_byte_dfa(".*")
    assert _full_match(CompiledLazyRegex(dfa, tok).new_matcher(), "a\U0010fffe\u00e9")
    assert not _full_match(CompiledLazyRegex(dfa, tok).new_matcher(), "a\U0010ffff")
    # `$` cannot come before the marker: such a regex is built without one.
    assert _full_match(CompiledLazyRegex(build_byte_dfa("ab$"), tok).new_matcher(), "ab")
