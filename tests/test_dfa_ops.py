"""dfa_ops.intersect against brute force: a byte string is accepted by the product iff
every part's regex fully matches it, the product is trimmed (every state reachable and
able to reach acceptance), and empty intersections raise."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.byte_dfa import ByteDFA
from sgl.runtime.constrained.byte_dfa import coreachable
from sgl.runtime.constrained.dfa_build import build_byte_dfa
from sgl.runtime.constrained.dfa_ops import intersect


def dfa_of(regex: str) -> ByteDFA:
    # The Rust DFA is leftmost-first (it drops continuations after an early match), so
    # it is built with a terminator, as the pushdown backend does with its end marker;
    # interegular is exact as is. Strings are run with the terminator appended.
    return build_byte_dfa("(?:" + regex + ")!")


def run(dfa: ByteDFA, data: bytes) -> bool:
    s = dfa.initial
    for b in data + b"!":
        s = int(dfa.trans[s, b])
        if s < 0:
            return False
    return bool(dfa.accept[s])


def alive_prefix(dfa: ByteDFA, data: bytes) -> bool:
    s = dfa.initial
    for b in data:
        s = int(dfa.trans[s, b])
        if s < 0:
            return False
    return True


CASES = [
    ["[ab]*a[ab]{2}", "(?:ab|b)*a?", "[ab]{0,6}"],
    ["a*b*c*", "(?:abc)*|c+", ".{0,5}"],
    ["[a-c]{2,7}", "(?:a|bc)+", "[^a].*|a"],
    ["(?:é|e)+[ab]?", "[^a]{1,4}", ".*"],
    ["x?(?:ab)*", "(?:xa|a)(?:ba)*b?"],
]
ALPHABET = ["a", "b", "c", "x", "e", "é", "ab", "bc"]


def _strings(rng: random.Random, n: int) -> list[str]:
    out = {""}
    while len(out) < n:
        out.add("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8))))
    return sorted(out)


@pytest.mark.parametrize("regexes", CASES)
def test_product_matches_brute_force(regexes: list[str]) -> None:
    rng = random.Random(len("".join(regexes)))
    dfas = [dfa_of(r) for r in regexes]
    for k in range(2, len(regexes) + 1):
        prod = intersect(dfas[:k])
        hits = 0
        for s in _strings(rng, 400):
            want = all(re.fullmatch(r, s) for r in regexes[:k])
            hits += want
            assert run(prod, s.encode()) == bool(want), (regexes[:k], s)
        assert hits, f"no positive sample for {regexes[:k]}"


@pytest.mark.parametrize("regexes", CASES)
def test_product_is_trimmed(regexes: list[str]) -> None:
    prod = intersect([dfa_of(r) for r in regexes])
    assert prod.initial == 0
    n = prod.trans.shape[0]
    assert coreachable(prod.trans, prod.accept).all()
    # Every state reachable from the start.
    seen = np.zeros(n, dtype=bool)
    seen[0] = True
    todo = [0]
    while todo:
        s = todo.pop()
        for t in prod.trans[s][prod.trans[s] >= 0].tolist():
            if not seen[t]:
                seen[t] = True
                todo.append(t)
    assert seen.all()


def test_partial_utf8_and_prefix_liveness() -> None:
    # "é" is C3 A9: a prefix ending after C3 is alive in the product iff a completion
    # exists in both parts.
    prod = intersect([dfa_of("(?:é|e)+"), dfa_of("[^e]+")])
    assert run(prod, "éé".encode())
    assert not run(prod, "eé".encode())
    assert alive_prefix(prod, b"\xc3")
    assert not alive_prefix(prod, b"e")


def test_empty_intersection_raises() -> None:
    with pytest.raises(GrammarError, match="matches nothing"):
        intersect([dfa_of("a+"), dfa_of("b+")])


def test_single_part_is_the_part() -> None:
    d = dfa_of("[ab]{1,3}")
    prod = intersect([d])
    for s in ["", "a", "ab", "abb", "abba", "c"]:
        assert run(prod, s.encode()) == bool(re.fullmatch("[ab]{1,3}", s))


def test_long_chain_counts_exactly() -> None:
    # A long linear product (thousands of frontiers) stays exact at the bound.
    prod = intersect([dfa_of("[a-z]{0,3000}"), dfa_of("(?:ab)*a?")])
    s = "ab" * 1500
    assert run(prod, s.encode())
    assert not run(prod, (s + "a").encode())
    assert run(prod, s[:-1].encode())


def test_product_without_terminator_interegular() -> None:
    # interegular DFAs are exact without a terminator, so acceptance inside the product
    # (both parts accept at once) is what decides here.
    regexes = ["[ab]*a[ab]{2}", "(?:ab|b)*a?", "[ab]{0,6}"]
    prod = intersect([build_byte_dfa(r, engine="interegular") for r in regexes])
    rng = random.Random(7)
    for s in _strings(rng, 300):
        want = all(re.fullmatch(r, s) for r in regexes)
        d = prod.initial
        for b in s.encode():
            d = int(prod.trans[d, b])
            if d < 0:
                break
        assert (d >= 0 and bool(prod.accept[d])) == bool(want), s
