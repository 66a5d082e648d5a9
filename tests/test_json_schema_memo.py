"""The converter's memoized helpers behave as the plain functions they replace: the
additional-member key trie (its nodes shared between name lists) accepts exactly the
keys that are not declared names, in any order of conversions; the memo tables stay
within their budgets; nested pattern alternations convert in linear time; literals
are spelled character by character as esc_char spells them."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl.runtime.constrained.json_schema import clear_memos
from sgl.runtime.constrained.json_schema._regex import ReservedCodePoint, esc_char, literal
from sgl.runtime.constrained.json_schema.keys import key_not_in
from sgl.runtime.constrained.json_schema.memo import ENTRY_BYTES, Table
from sgl.runtime.constrained.json_schema.patterns import translate

# Shared prefixes, a name that is a prefix of another, and characters that leave the
# "plain" fast path (quote, backslash, control, non-ASCII).
_ALPHABET = "ab\"\\\né"
_names = st.lists(st.text(_ALPHABET, max_size=4), min_size=1, max_size=6)


def _spelled(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


@settings(max_examples=60, deadline=None)
@given(names=_names, other=_names, probes=st.lists(st.text(_ALPHABET + "c", max_size=5), max_size=12))
def test_key_not_in_is_exactly_the_undeclared_keys(names, other, probes):
    clear_memos()
    cold = key_not_in(names)
    key_not_in(other)  # fills the node memo with an overlapping trie
    assert key_not_in(list(reversed(names))) == cold
    clear_memos()
    key_not_in(other)
    assert key_not_in(names) == cold  # a warm trie spells the same regex
    rx = re.compile(cold)
    for s in probes + names + [n + "c" for n in names] + [n[:-1] for n in names]:
        assert (rx.fullmatch(_spelled(s)) is not None) == (s not in names), (names, s)


def test_table_stays_within_its_budget():
    t = Table(budget=3 * (ENTRY_BYTES + 10))
    for i in range(10):
        assert t.put(i, "x" * 10, 10) == "x" * 10
        assert t.used <= t.budget
    assert 0 < len(t) <= 3
    assert t.put("big", "y", t.budget) == "y" and "big" not in t  # larger than the budget
    t.put("a", "b", 1)
    clear_memos()  # every table is registered
    assert len(t) == 0 and t.used == 0


def test_nested_alternation_converts_once_per_branch():
    # x then 24 levels of (yy|(...)): two characters per branch, so Python's parser
    # keeps each a branch instead of a class, and the leading x keeps the alternation
    # off the top level (split into pieces there). Converting each branch twice doubled
    # the work per level: 16 levels took 7 s, 24 would take half an hour.
    depth = 24
    pairs = [chr(97 + i) * 2 for i in range(depth)]
    pattern = "^x" + "".join(f"(?:{p}|" for p in pairs) + "zz" + ")" * depth + "$"
    body, (lo, hi) = translate(pattern)
    assert (lo, hi) == (3, 3)
    rx = re.compile('"' + body + '"')
    for text in pairs + ["zz"]:
        assert rx.fullmatch(f'"x{text}"'), text
    assert not rx.fullmatch('"xab"') and not rx.fullmatch('"aa"')


@pytest.mark.parametrize("cp", [0, 0x1F, 0x22, 0x2D, 0x41, 0x5C, 0x7F, 0xE9, 0xD800, 0xFFFF,
                                0x1F600, 0x10EFFF])
def test_literal_spells_each_character_as_esc_char(cp):
    text = "a" + chr(cp) + "-"
    assert literal(text) == "a" + esc_char(cp) + esc_char(0x2D)


def test_literal_refuses_reserved_code_points():
    with pytest.raises(ReservedCodePoint):
        literal("ok" + chr(0x10F000))
