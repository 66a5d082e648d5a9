"""Intersect sub-machines: a machine whose language is the intersection of regexes.

The product DFA (dfa_ops.intersect) is checked against Python's `re` on every short
string over a small alphabet; the plumbing (Machines.intersect -> MachineSpec ->
pushdown_build / registry, disk cache included) on small machine specs.
"""

from __future__ import annotations

import itertools
import re

import pytest

from sgl.runtime.constrained import dfa_build, registry
from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.cache import DiskCache
from sgl.runtime.constrained.dfa_ops import intersect
from sgl.runtime.constrained.json_schema._regex import call_marker
from sgl.runtime.constrained.json_schema.machines import Intersect, Machines, MachineSpec
from sgl.runtime.constrained.native.compiled import CompiledNative
from sgl.runtime.constrained.pushdown import CompiledPushdown
from sgl.runtime.constrained.pushdown_build import build_tables
from tests.grammar_helpers import accepts_text



def dfa_accepts(dfa, text: str) -> bool:
    s = dfa.initial
    for b in text.encode():
        s = int(dfa.trans[s, b])
        if s < 0:
            return False
    return bool(dfa.accept[s])


@pytest.mark.parametrize("parts", [
    ["[ab]*a[ab]", "(?:ab|b)*a?b?"],
    ["a|ab|abb", "ab*", "[ab]{2}"],  # leftmost-first alternatives must not drop "ab"
    ["(?:aa)*", "(?:aaa)*"],
])
def test_product_matches_re_on_all_short_strings(parts):
    dfa = intersect([dfa_build.build_byte_dfa(p) for p in parts])
    for n in range(7):
        for chars in itertools.product("ab", repeat=n):
            text = "".join(chars)
            want = all(re.fullmatch(p, text) for p in parts)
            assert dfa_accepts(dfa, text) == bool(want), (parts, text)


def test_empty_product_matches_nothing():
    with pytest.raises(GrammarError, match="matches nothing"):
        intersect([dfa_build.build_byte_dfa("a+"), dfa_build.build_byte_dfa("b+")])


def test_machines_intersect_is_memoized_and_reachable():
    m = Machines("")
    x = m.intersect(['"[a-z]+"', '"(?:ab)*"'])
    assert m.intersect(['"(?:ab)*"', '"[a-z]+"', '"[a-z]+"']) == x  # order, duplicates
    assert m.intersect(['"[a-z]+"']) == m.call('"[a-z]+"')  # one part: a plain call
    spec = m.spec(r"\[" + x + r"\]")
    assert Intersect(('"(?:ab)*"', '"[a-z]+"')) in spec.subs


def _spec_with_intersection(parts: list[str]) -> MachineSpec:
    m = Machines("")
    root = r'\{"k":(?:' + m.intersect(parts) + r"|null)\}"
    return m.spec(root)


@pytest.mark.parametrize("use_registry", [False, True])
def test_intersect_sub_in_pushdown(tok, tmp_path, use_registry, monkeypatch):
    spec = _spec_with_intersection(['"[a-z]{2,5}"', '"(?:ab|cd)*"'])
    if use_registry:
        monkeypatch.setenv("SGL_REGEX_BACKEND", "lazy")  # the numpy backend's disk cache
        disk = DiskCache(tmp_path)
        c = registry._build_pushdown(spec, tok, "json_schema", disk)
        assert any(tmp_path.iterdir())
        c2 = registry._build_pushdown(spec, tok, "json_schema", disk)  # from disk
        assert c2.num_states == c.num_states
    else:
        c = CompiledPushdown(build_tables(spec.root, spec.subs, dfa_build.build_byte_dfa), tok)
    for text, ok in [('{"k":"abcd"}', True), ('{"k":"ab"}', True), ('{"k":"null"}', False),
                     ('{"k":null}', True), ('{"k":"abcdab"}', False), ('{"k":"a"}', False),
                     ('{"k":"abc"}', False), ('{"k":""}', False)]:
        assert accepts_text(c, text) == ok, text


def test_intersect_sub_on_the_native_engine(tok):
    """The native engine multiplies the parts' lazy DFAs: a call in one part meets only
    the same call in the other (converter parts share their opening-quote call)."""
    spec = _spec_with_intersection(['"[a-z]{2,5}"', '"(?:ab|cd)*"'])
    c = registry._build_pushdown(spec, tok, "json_schema", None)
    assert isinstance(c, CompiledNative)
    for text, ok in [('{"k":"abcd"}', True), ('{"k":"ab"}', True), ('{"k":"null"}', False),
                     ('{"k":null}', True), ('{"k":"abcdab"}', False), ('{"k":"a"}', False),
                     ('{"k":"abc"}', False), ('{"k":""}', False)]:
        assert accepts_text(c, text) == ok, text
    empty = registry._build_pushdown(_spec_with_intersection(['"a+"', '"b+"']), tok, "json_schema", None)
    assert accepts_text(empty, '{"k":null}') and not accepts_text(empty, '{"k":"a"}')
    g = empty.new_matcher()
    g.accept_bytes(b'{"k":')
    assert g.jump_forward_string() == "null}"
    m = Machines("")
    digit = m.call("[0-9]")
    x = m.intersect([r"\[" + digit + r"(?:," + digit + r")*\]", r"\[" + digit + r"(?:,[0-9])?\]"])
    both = registry._build_pushdown(m.spec(x), tok, "json_schema", None)
    assert accepts_text(both, "[1]") and not accepts_text(both, "[1,2]") and not accepts_text(both, "[a]")


def test_empty_intersection_is_a_dead_call(tok):
    spec = _spec_with_intersection(['"a+"', '"b+"'])
    c = CompiledPushdown(build_tables(spec.root, spec.subs, dfa_build.build_byte_dfa), tok)
    assert accepts_text(c, '{"k":null}')
    assert not accepts_text(c, '{"k":"a"}') and not accepts_text(c, '{"k":"b"}')
    g = c.new_matcher()
    g.accept_bytes(b'{"k":')
    assert g.jump_forward_string() == "null}"


def test_call_marker_inside_a_part(tok):
    # Parts may call machines; a call counts as one character of the other part's
    # text classes (its marker code point), so "[1,2]" is 3 characters inside brackets.
    m = Machines("")
    digit = m.call("[0-9]")
    x = m.intersect([r"\[" + digit + r"(?:," + digit + r")*\]", r"\[[^\]]{1,2}\]"])
    spec = m.spec(x)
    assert spec.root == x == call_marker(1)
    c = CompiledPushdown(build_tables(spec.root, spec.subs, dfa_build.build_byte_dfa), tok)
    assert accepts_text(c, "[1]") and not accepts_text(c, "[1,2]") and not accepts_text(c, "[a]")
