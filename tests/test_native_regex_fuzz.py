"""Seeded differential fuzzing of the native regex parser (native/regex_nfa.c).

Random regexes in the native dialect (literals incl. non-ASCII and \\x \\u \\U escapes,
classes with ranges, negation, escapes and shorthands, plain and named groups,
alternation with empty branches, greedy and lazy quantifiers, end anchors) are built by
native_dfa.build and by the outlines-core route (dfa_rust.build_rust); the two trimmed
DFAs must accept the same language (a BFS over state pairs). Independently of Rust:
every class is checked against a Python model of its code point set at all of its
boundaries, every DFA must accept only valid UTF-8 that never spells U+10FFFF, and
random garbage text must build, fall back (None) or raise GrammarError, never crash.

The generator steers around the Rust route's own faults, which the differential found
(native is right in each): a class that matches nothing inside an alternation makes
outlines-core drop or refuse branches (`(a[^\\w\\W]||b)` loses "b"), and Rust negates
`[^\\ud7ff\\ue000]` into a class that still holds U+D7FF and U+E000 (regex-syntax
treats the two as adjacent, the gap between them inverted). So negated classes here
hold no shorthand and neither of those two code points.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from sgl.runtime.constrained.base import GrammarError
from sgl.runtime.constrained.byte_dfa import ByteDFA
from sgl.runtime.constrained.dfa_rust import build_rust
from sgl.runtime.constrained.native.binding import NativeEngine, available
from sgl.runtime.constrained.native.shorthand import shorthand_tables
from sgl.runtime.constrained.native_dfa import build

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler: the native engine is off")

MAX = 0x10FFFF


# ---------------------------------------------------------------------- oracles
class ProductTooLarge(Exception):
    """The pair BFS passed its bound: the two DFAs are not compared."""


def equivalent(a: ByteDFA, b: ByteDFA, limit: int = 200_000) -> bytes | None:
    """None if the trimmed DFAs accept the same language, else a distinguishing prefix."""
    seen = {(a.initial, b.initial): b""}
    todo = deque(seen)
    while todo:
        x, y = todo.popleft()
        w = seen[(x, y)]
        if bool(a.accept[x]) != bool(b.accept[y]):
            return w
        la, lb = a.trans[x] >= 0, b.trans[y] >= 0
        if (la != lb).any():
            return w + bytes([int(np.nonzero(la != lb)[0][0])])
        for byte in np.nonzero(la)[0].tolist():
            k = (int(a.trans[x, byte]), int(b.trans[y, byte]))
            if k not in seen:
                seen[k] = w + bytes([byte])
                todo.append(k)
        if len(seen) >= limit:
            raise ProductTooLarge(len(seen))
    return None


def _utf8_automaton() -> np.ndarray:
    """Valid UTF-8 with no surrogates and no U+10FFFF: state 0 = between characters."""
    t = np.full((10, 256), -1, dtype=np.int64)
    t[0, 0x00:0x80] = 0
    t[0, 0xC2:0xE0] = 1
    t[0, 0xE0], t[0, 0xED], t[0, 0xF0], t[0, 0xF4] = 4, 5, 6, 7
    t[0, 0xE1:0xED] = t[0, 0xEE:0xF0] = 2
    t[0, 0xF1:0xF4] = 3
    for k in (1, 2, 3):
        t[k, 0x80:0xC0] = k - 1
    t[4, 0xA0:0xC0] = 1  # E0: no overlong forms
    t[5, 0x80:0xA0] = 1  # ED: no surrogates
    t[6, 0x90:0xC0] = 2  # F0: no overlong forms
    t[7, 0x80:0x8F], t[7, 0x8F] = 2, 8  # F4: nothing above U+10FFFF
    t[8, 0x80:0xBF], t[8, 0xBF] = 1, 9
    t[9, 0x80:0xBF] = 0  # F4 8F BF BF (U+10FFFF) refused
    return t


_UTF8 = _utf8_automaton()


def utf8_violation(d: ByteDFA) -> bytes | None:
    """A path of `d` that is not valid text (or an accepted string ending mid-character)."""
    seen = {(d.initial, 0): b""}
    todo = deque(seen)
    while todo:
        x, u = todo.popleft()
        w = seen[(x, u)]
        if d.accept[x] and u != 0:
            return w
        for byte in np.nonzero(d.trans[x] >= 0)[0].tolist():
            v = int(_UTF8[u, byte])
            if v < 0:
                return w + bytes([byte])
            k = (int(d.trans[x, byte]), v)
            if k not in seen:
                seen[k] = w + bytes([byte])
                todo.append(k)
    return None


def accepts(d: ByteDFA, data: bytes) -> bool:
    s = d.initial
    for b in data:
        s = int(d.trans[s, b])
        if s < 0:
            return False
    return bool(d.accept[s])


# ---------------------------------------------------------------------- generator
_EDGES = [0x41, 0x7F, 0x80, 0xE9, 0x7FF, 0x800, 0xFFF, 0x1000, 0xD7FF, 0xE000, 0xFFFD, 0xFFFF, 0x10000,
          0x1F600, 0x3FFFF, 0x40000, 0x10FFFD]
_META = ".^$*+?()[]{}|\\/-"


class Gen:
    """Random regexes of the dialect, small enough for the Rust route to stay fast."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.names = 0

    def cp(self, avoid: tuple[int, ...] = ()) -> int:
        r = self.r
        x = r.random()
        c = r.choice(_EDGES) if x < 0.4 else r.randrange(0x20, 0x7F) if x < 0.7 else r.randrange(0x80, 0x30000)
        if 0xD800 <= c <= 0xDFFF or c in avoid:
            c = 0xD7FE
        return c

    def spell(self, c: int, in_class: bool) -> str:
        r = self.r
        special = "]\\^-[" if in_class else _META
        if chr(c) in special or c < 0x20 or c in (0x85, 0x2028, 0x2029) or r.random() < 0.4:
            k = r.random()
            if c < 0x100 and k < 0.3:
                return "\\x%02x" % c
            if k < 0.5:
                return "\\x{%x}" % c
            return "\\u%04X" % c if c < 0x10000 else "\\U%08x" % c
        return chr(c)

    def klass(self) -> str:
        r = self.r
        neg = r.random() < 0.3
        avoid = (0xD7FF, 0xE000) if neg else ()
        items = []
        for _ in range(r.randint(1, 3)):
            x = r.random()
            if x < 0.2 and not neg:
                items.append("\\" + r.choice("dswDSW"))
            elif x < 0.6:
                a, b = sorted((self.cp(avoid), self.cp(avoid)))
                items.append(self.spell(a, True) + "-" + self.spell(b, True))
            else:
                items.append(self.spell(self.cp(avoid), True))
        return "[" + ("^" if neg else "") + "".join(items) + "]"

    def atom(self, depth: int) -> str:
        r = self.r
        x = r.random()
        if depth and x < 0.25:
            self.names += 1
            g = r.choice(["(?:%s)", "(%s)", f"(?P<g{self.names}>%s)", f"(?<n{self.names}>%s)"])
            return g % self.alt(depth - 1)
        if x < 0.45:
            return self.klass()
        if x < 0.5:
            return "."
        if x < 0.56:
            return "\\" + r.choice("dswDSWntrfva")
        if x < 0.8:
            return r.choice("abcxyz019_,:")
        return self.spell(self.cp(), False)

    def quant(self) -> str:
        r = self.r
        if r.random() < 0.6:
            return ""
        a = r.randint(0, 2)
        q = r.choice(["*", "+", "?", f"{{{a}}}", f"{{{a},}}", f"{{{a},{a + r.randint(0, 2)}}}"])
        return q + ("?" if r.random() < 0.2 else "")

    def alt(self, depth: int) -> str:
        r = self.r
        return "|".join("".join(self.atom(depth) + self.quant() for _ in range(r.choice([0, 1, 1, 2, 2, 3])))
                        for _ in range(r.choice([1, 1, 2, 3])))

    def regex(self) -> str:
        self.names = 0
        return self.alt(2)


# ---------------------------------------------------------------------- tests
def _native(rx: str) -> ByteDFA | str | None:
    try:
        return build(rx)
    except GrammarError as e:
        return "empty" if "matches nothing" in str(e) else f"error: {e}"


def _rust(rx: str) -> ByteDFA | None:
    try:
        return build_rust(rx)
    except GrammarError:
        return None  # the Rust route refuses it (size limits, its own faults): not compared


def _differential(seed: int, n: int) -> int:
    g = Gen(seed)
    compared = 0
    for _ in range(n):
        rx = g.regex()
        a = _native(rx)
        assert a is not None, f"native parser refused dialect regex {rx!r}"
        if isinstance(a, str):
            assert a == "empty", (rx, a)
            continue
        assert utf8_violation(a) is None, rx
        b = _rust(rx)
        if b is None:
            continue
        try:
            w = equivalent(a, b)
        except ProductTooLarge:
            continue  # too many state pairs to compare here (rare: deep counted repeats)
        assert w is None, f"{rx!r}: native and Rust DFAs differ after {w!r}"
        compared += 1
    return compared


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [1, 2])
def test_native_matches_rust_route(seed):
    assert _differential(seed, 60) > 45


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [3, 4, 5])
def test_native_matches_rust_route_long(seed):
    assert _differential(seed, 1000) > 800


def _anchored(seed: int, n: int) -> None:
    """Anchors at the very ends change nothing under full-match semantics."""
    g = Gen(seed)
    for _ in range(n):
        rx = g.regex()
        plain = _native(rx)
        for pre, post in (("^", "$"), ("^", ""), ("", "$"), ("\\A", "\\z")):
            got = _native(pre + rx + post)
            if isinstance(plain, ByteDFA):
                assert isinstance(got, ByteDFA) and equivalent(plain, got) is None, (pre, rx, post)
            else:
                assert got == plain, (pre, rx, post)


def test_end_anchors_are_ignored():
    _anchored(7, 60)


# -- classes against a model of their code point sets -----------------------------------
def _shorthands() -> dict[str, list[tuple[int, int]]]:
    t = shorthand_tables().tolist()
    out, o = {}, 3
    for name, k in zip("dsw", t[:3]):
        out[name] = [(t[o + 2 * i], t[o + 2 * i + 1]) for i in range(k)]
        o += 2 * k
    return out


def _norm(rs):
    out: list[tuple[int, int]] = []
    for a, b in sorted(rs):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _complement(rs):
    out, lo = [], 0
    for a, b in _norm(rs):
        if a > lo:
            out.append((lo, a - 1))
        lo = b + 1
    return out + ([(lo, MAX)] if lo <= MAX else [])


def test_classes_match_their_code_point_sets():
    sh = _shorthands()
    g = Gen(11)
    r = g.r
    for _ in range(250):
        items, ranges = [], []
        for _ in range(r.randint(1, 5)):
            if r.random() < 0.15:
                c = r.choice("dswDSW")
                items.append("\\" + c)
                ranges += sh[c.lower()] if c.islower() else _complement(sh[c.lower()])
            else:
                a, b = sorted((g.cp(), g.cp()))
                if r.random() < 0.3:
                    b = a
                items.append(g.spell(a, True) + ("" if a == b else "-" + g.spell(b, True)))
                ranges.append((a, b))
        neg = r.random() < 0.4
        rx = "[" + ("^" if neg else "") + "".join(items) + "]"
        model = _complement(ranges) if neg else _norm(ranges)
        probes = set(_EDGES) | {0, 0x7F, 0x10FFFE, MAX} | {r.randrange(0x110000) for _ in range(10)}
        for a, b in model:
            probes |= {a - 1, a, b, b + 1}
        d = _native(rx)
        assert d is not None and d != "error", rx
        for c in sorted(p for p in probes if 0 <= p <= MAX and not 0xD800 <= p <= 0xDFFF):
            want = c != MAX and any(a <= c <= b for a, b in model)
            got = isinstance(d, ByteDFA) and accepts(d, chr(c).encode())
            assert got == want, f"{rx!r} on U+{c:04X}: {got}, want {want}"
        if isinstance(d, ByteDFA):
            assert utf8_violation(d) is None, rx


def test_u10ffff_is_never_matched():
    # U+10FFFF is the outlines-core route's end marker: neither builder may match it,
    # whether spelled in a class or as a literal.
    for rx in (r"a\U0010FFFF?", "a\U0010ffff?", r"a\x{10ffff}?", r"a[\U0010FFFE-\U0010FFFF]?"):
        d = build(rx)
        assert accepts(d, b"a") and not accepts(d, "a\U0010ffff".encode()), rx
    assert accepts(build(r"[\U0010FFFE-\U0010FFFF]"), "\U0010fffe".encode())
    for rx in (r"\U0010FFFF", r"[\U0010FFFF]"):
        with pytest.raises(GrammarError, match="matches nothing"):
            build(rx)


# -- robustness ------------------------------------------------------------------------
_SOUP = list("()[]{}|*+?^$\\.-:,<>=!PpdDsSwWbBxuUnrtfvae0123456789abcAZ_&~# ") + [
    "é", "中", "😀", "\U0010ffff", "\U0010f000", "\U0010f001", "\x00", "\n"]


def test_garbage_patterns_build_fall_back_or_raise():
    r = random.Random(5)
    uni = shorthand_tables()
    outcomes = {"built": 0, "unsupported": 0, "refused": 0}
    for _ in range(3000):
        rx = "".join(r.choice(_SOUP) for _ in range(r.randint(0, 24)))
        calls = r.random() < 0.3
        eng = NativeEngine(3 if calls else 1, "fuzz", json_mode=not calls, max_states=2000)
        try:
            if not eng.set_regex(0, rx, calls=calls, uni=uni, no_empty=r.random() < 0.3, max_nfa_states=20_000):
                outcomes["unsupported"] += 1
                continue
            if calls:
                eng.set_regex(1, "a|b(?:\U0010f001)?", calls=True, uni=None, no_empty=True)
                eng.set_regex(2, "c+", calls=True, uni=None, no_empty=True)
            eng.finalize()
            trans, accept = eng.export(0)
            assert trans.shape == (accept.size, 256) and (trans < accept.size).all()
            outcomes["built"] += 1
        except GrammarError:
            outcomes["refused"] += 1
    assert min(outcomes.values()) > 100, outcomes


def test_group_nesting_limit():
    assert build("(" * 2000 + "a" + ")" * 2000) is not None
    assert build("(?:" * 2000 + "a*|" + ")+" * 2000) is not None
    assert build("(" * 2001 + "a" + ")" * 2001) is None  # left to the other builder
    assert build("(" * 100_000) is None


def test_nfa_bound_is_an_error():
    eng = NativeEngine(1, "regex")
    with pytest.raises(GrammarError, match="NFA exceeds"):
        eng.set_regex(0, "(?:a{100}){100}", calls=False, uni=None, max_nfa_states=1000)
    assert eng.set_regex(0, "abc", calls=False, uni=None)  # the machine is still unset


@pytest.mark.timeout(60)
def test_repeats_of_an_empty_body_are_refused_not_compiled_for_ever():
    # No NFA states, but ~10^15 compile steps: the compile itself is bounded too.
    eng = NativeEngine(1, "regex")
    for pattern in ("(?:(?:(?:){99999}){99999}){99999}", "(?:(?:a{0}){99999}){99999}"):
        with pytest.raises(GrammarError, match="NFA exceeds"):
            eng.set_regex(0, pattern, calls=False, uni=None)
    assert eng.set_regex(0, "(?:){5}x", calls=False, uni=None)  # a small one still compiles


def test_an_out_of_memory_engine_fails_its_grammar_not_the_batch():
    from sgl.runtime.constrained.native.binding import NOMEM

    err = NativeEngine(1, "regex")._fail(NOMEM)
    assert isinstance(err, GrammarError) and isinstance(err, MemoryError)  # NativeGrammar keeps it as its error
