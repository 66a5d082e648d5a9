"""Regex-family grammars (regex, choices, json_schema) on the embedded 49k vocabulary."""

from __future__ import annotations

import json
import random

import pytest
import torch

from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.matcher import GrammarMatcher
from sgl.runtime.constrained.registry import compile_grammar
from sgl.runtime.constrained.vocab import greedy_encode


# [0-9], not \d: outlines-core (Rust regex) reads \d as any Unicode digit.
IPV4 = r"((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)"
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def drive(tok, kind, spec, text):
    """Feed text token by token (greedy split); return (all accepted, can_end)."""
    m = GrammarMatcher(kind, spec, tok)
    for tid in greedy_encode(tok, text):
        row = m.new_mask()
        allowed = bool(row[tid])
        ok = m.accept_token(tid)
        assert ok == allowed, "mask and accept_token disagree"
        if not ok:
            return False, False
    return True, m.can_end()


@pytest.mark.parametrize("regex,good,bad", [
    (IPV4, ["192.168.0.1", "8.8.8.8", "255.255.255.0"], ["256.1.1.1", "1.2.3", "1.2.3.4.5", "a.b.c.d"]),
    (DATE, ["2024-01-31", "1999-12-01"], ["2024-13-01", "2024-1-1", "24-01-01"]),
    (PHONE, ["(555) 123-4567"], ["555-123-4567", "(555)123-4567"]),
])
def test_regex_accepts_matching_and_rejects_others(tok, regex, good, bad):
    for s in good:
        assert drive(tok, "regex", regex, s) == (True, True), s
    for s in bad:
        assert drive(tok, "regex", regex, s) != (True, True), s


def test_eos_only_in_final_states(tok):
    eos = tok.eos_token_ids[0]
    m = GrammarMatcher("regex", DATE, tok)
    for i, tid in enumerate(greedy_encode(tok, "2024-01-31")):
        assert bool(m.new_mask()[eos]) == m.can_end() == False  # noqa: E712
        assert m.accept_token(tid)
    assert m.can_end() and m.new_mask()[eos]
    assert m.accept_token(eos) and m.is_terminated()
    m2 = GrammarMatcher("regex", DATE, tok)
    assert not m2.accept_token(eos)


def test_special_tokens_never_allowed(tok):
    m = GrammarMatcher("regex", r"[^\n]*", tok)
    row = m.new_mask()
    special = [i for i, b in enumerate(tok.token_bytes) if b is None and i not in tok.eos_token_ids]
    assert special and not row[special].any()
    assert row.sum() > 40000  # nearly every ordinary token fits "anything but newline"


def test_mask_padded_to_logits_width(tok):
    m = GrammarMatcher("regex", r"[a-z]+", tok)
    row = torch.zeros(tok.vocab_size + 128, dtype=torch.bool)
    m.fill_mask(row)
    assert not row[tok.vocab_size:].any() and row[: tok.vocab_size].any()


def test_mask_agrees_with_brute_force(tok):
    m = GrammarMatcher("regex", IPV4, tok)
    m.accept_string("10.2")
    row = m.new_mask()
    rng = random.Random(0)
    sample = rng.sample(range(tok.vocab_size), 3000) + greedy_encode(tok, "5.3.1")
    import re
    pat = re.compile(IPV4)
    for tid in sample:
        b = tok.token_bytes[tid]
        if b is None:
            continue
        text = "10.2" + b.decode("utf-8", errors="replace")
        # viable prefix: some completion matches -> probe with a set of suffixes
        viable = any(pat.fullmatch(text + suf) for suf in ["", "0", "1", ".1", "1.1", ".1.1", "0.1.1", "1.1.1", "5.5.5"]) \
            if "\ufffd" not in text else False
        assert bool(row[tid]) == viable, (tid, b)


def test_rollback_restores_state_and_copy_is_independent(tok):
    m = GrammarMatcher("regex", DATE, tok)
    ids = greedy_encode(tok, "2024-01-31")
    masks = []
    for tid in ids:
        masks.append(m.new_mask())
        assert m.accept_token(tid)
    m.rollback(3)
    assert torch.equal(m.new_mask(), masks[len(ids) - 3])
    c = m.copy()
    assert torch.equal(c.new_mask(), masks[0])  # copy starts fresh
    assert c.accept_token(ids[0])
    assert torch.equal(m.new_mask(), masks[len(ids) - 3])  # original untouched
    with pytest.raises(ValueError):
        m.rollback(100)


def test_choices(tok):
    choices = ["yes", "no", "maybe (later)", "a.b*c"]
    for c in choices:
        assert drive(tok, "choices", choices, c) == (True, True)
    assert drive(tok, "choices", choices, "ye") == (True, False)
    assert drive(tok, "choices", choices, "abbc")[0] is False
    assert drive(tok, "choices", json.dumps(choices), "a.b*c") == (True, True)
    m = GrammarMatcher("choices", ["maybe (later)", "no"], tok)
    assert m.accept_string("m") and m.jump_forward_string() == "aybe (later)"


def test_jump_forward_regex(tok):
    m = GrammarMatcher("regex", r"The answer is (yes|no)\.", tok)
    assert m.jump_forward_string() == "The answer is "
    assert m.accept_string("The answer is ")
    assert m.jump_forward_string() is None
    assert m.accept_string("y") and m.jump_forward_string() == "es."
    m = GrammarMatcher("regex", r"\d+", tok)
    assert m.jump_forward_string() is None
    m = GrammarMatcher("regex", r"caf\u00e9!", tok)
    assert m.jump_forward_string() == "café!"


def test_json_schema_grammar(tok):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    ok, end = drive(tok, "json_schema", json.dumps(schema), '{"name":"Bob","age":42}')  # compact by default
    assert ok and end
    assert not all(drive(tok, "json_schema", schema, '{"name": 3, "age": 42}'))
    assert drive(tok, "json_schema", schema, '{"name":"Bob"') == (True, False)


@pytest.mark.parametrize("kind,spec,word", [
    ("regex", "(unclosed", "regex"),
    ("json_schema", "{not json", "json_schema"),
    ("choices", "[]", "choices"),
    ("nonsense", "x", "kind"),
])
def test_invalid_specs_raise(tok, kind, spec, word):
    with pytest.raises(GrammarError, match=word):
        compile_grammar(kind, spec, tok)


def test_accept_token_raises_grammar_error_on_protocol(tok):
    g = compile_grammar("regex", r"\d+", tok)
    with pytest.raises(GrammarError):
        g.accept_token(greedy_encode(tok, "x")[0])
