"""Translate a JSON Schema `pattern` (Python/ECMA regex over decoded text) into a regex
over the JSON-encoded string body.

We parse with Python's own regex parser (jsonschema validates with `re.search`), walk
the tree, and spell every character set through `charsets.encode_set`. Unanchored
sides become "any characters". Features a DFA cannot express (backreferences,
lookaround, anchors in the middle, inline flags) raise `PatternUnsupported`.
Shorthand classes are narrowed to ASCII where Python's Unicode meaning is wider
(`\\d`, `\\w`); their negations use an ASCII universe, so we never accept a character
Python would reject (at the price of rejecting some non-ASCII text Python accepts).
"""

from __future__ import annotations

import re
from typing import Any

try:  # Python 3.11+
    import re._constants as C  # type: ignore[import-not-found]
    import re._parser as P  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import sre_constants as C  # type: ignore[no-redef]
    import sre_parse as P  # type: ignore[no-redef]

from ._regex import ANY_CHAR, Frag, alt, group, repeat
from .charsets import Ranges, complement, encode_set, intersect, normalize
from .memo import memo


class PatternUnsupported(Exception):
    """The pattern uses a feature a DFA regex cannot express."""


_ASCII = (0, 0x7F)
_SPACE: Ranges = [(0x09, 0x0D), (0x1C, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
                  (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
                  (0x3000, 0x3000)]
_DIGIT: Ranges = [(0x30, 0x39)]
_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
# Negations of the ASCII-narrowed classes must stay inside ASCII to remain sound.
_CATS: dict[Any, tuple[Ranges, bool]] = {
    C.CATEGORY_DIGIT: (_DIGIT, False),
    C.CATEGORY_NOT_DIGIT: (complement(_DIGIT, _ASCII), True),
    C.CATEGORY_WORD: (_WORD, False),
    C.CATEGORY_NOT_WORD: (complement(_WORD, _ASCII), True),
    C.CATEGORY_SPACE: (_SPACE, False),
    C.CATEGORY_NOT_SPACE: (complement(_SPACE), False),
}
_DOT: Ranges = complement([(0x0A, 0x0A)])


def _class(items: list) -> Ranges:
    ranges: Ranges = []
    negate = False
    ascii_only = False
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            ranges.append((av, av))
        elif op is C.RANGE:
            ranges.append(av)
        elif op is C.CATEGORY:
            rs, narrowed = _CATS[av]
            ranges += rs
            ascii_only |= av in (C.CATEGORY_DIGIT, C.CATEGORY_WORD) or narrowed
        else:
            raise PatternUnsupported(f"class item {op}")
    ranges = normalize(ranges)
    if negate:
        return complement(ranges, _ASCII) if ascii_only else complement(ranges)
    return ranges


def _seq(sub: Any) -> Frag:
    out = ""
    for op, av in sub:
        f = _node(op, av)
        if f is None:
            return None
        out += f
    return out


def _node(op: Any, av: Any) -> Frag:
    if op is C.LITERAL:
        return encode_set([(av, av)])
    if op is C.NOT_LITERAL:
        return encode_set(complement([(av, av)]))
    if op is C.ANY:
        return encode_set(_DOT)
    if op is C.IN:
        return encode_set(_class(av))
    if op is C.BRANCH:
        # Each branch converted once: converting it twice doubled the work per nesting level.
        branches = (_seq(b) for b in av[1])
        return alt(None if f is None else group(f) for f in branches)
    if op is C.SUBPATTERN:
        _, add_flags, del_flags, sub = av
        if add_flags or del_flags:
            raise PatternUnsupported("inline flags")
        f = _seq(sub)
        return None if f is None else group(f)
    if op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
        lo, hi, sub = av
        f = _seq(sub)
        return repeat(f, lo, None if hi is C.MAXREPEAT else hi)
    if op is getattr(C, "ATOMIC_GROUP", None):
        return _seq(av)
    raise PatternUnsupported(f"{str(op).lower()}")


_BEGIN = (C.AT_BEGINNING, C.AT_BEGINNING_STRING)
_END = (C.AT_END, C.AT_END_STRING)


def _strip_anchors(items: list) -> tuple[list, bool, bool]:
    start = bool(items) and items[0][0] is C.AT and items[0][1] in _BEGIN
    if start:
        items = items[1:]
    end = bool(items) and items[-1][0] is C.AT and items[-1][1] in _END
    if end:
        items = items[:-1]
    return items, start, end


def _pieces(items: list, start: bool, end: bool) -> list[tuple[Frag, int, int | None]]:
    """(body, min width, max width) per top-level alternative, anchors resolved."""
    items, s2, e2 = _strip_anchors(items)
    start, end = start or s2, end or e2
    if len(items) == 1 and items[0][0] is C.BRANCH:
        return [p for b in items[0][1][1] for p in _pieces(list(b), start, end)]
    if (len(items) == 1 and items[0][0] is C.SUBPATTERN and not items[0][1][1]
            and not items[0][1][2]):
        inner = list(items[0][1][3])
        if any(op is C.AT or op is C.BRANCH for op, _ in inner):
            return _pieces(inner, start, end)
    body = _seq(items)
    lo, hi = _width(items)
    if body is not None and not start:
        body, hi = ANY_CHAR + "*" + body, None
    if body is not None and not end:
        body, hi = body + ANY_CHAR + "*", None
    return [(body, lo, hi)]


# Memoized (a pure function of the pattern): schemas repeat the same patterns across
# properties and $defs, and the server converts many schemas in one process.
@memo(1 << 22, lambda pattern, out: len(pattern) + len(out[0] or ""))
def translate(pattern: str) -> tuple[Frag, tuple[int, int | None]]:
    """Encoded body regex for strings `re.search(pattern, s)` accepts, and the (min,
    max) decoded length of what it accepts (max None = unbounded)."""
    try:
        tree = P.parse(pattern)
    except re.error as e:
        raise PatternUnsupported(f"invalid pattern: {e}") from None
    if tree.state.flags & (re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE):
        raise PatternUnsupported("inline flags")
    pieces = [p for p in _pieces(list(tree), False, False) if p[0] is not None]
    if not pieces:
        return None, (0, 0)
    los = [p[1] for p in pieces]
    his = [p[2] for p in pieces]
    hi_all = None if any(h is None for h in his) else max(h for h in his if h is not None)
    return alt(p[0] for p in pieces), (min(los), hi_all)


def _width(items: list) -> tuple[int, int | None]:
    sub = P.SubPattern(P.State(), items)
    lo, hi = sub.getwidth()
    return lo, (None if hi >= C.MAXREPEAT else hi)


def single_class_repeat(pattern: str) -> tuple[Ranges, int, int | None] | None:
    """(charset, lo, hi) when the pattern is exactly ^[set]{lo,hi}$, else None."""
    try:
        items = list(P.parse(pattern))
    except re.error:
        return None
    core, start, end = _strip_anchors(items)
    if not (start and end and len(core) == 1 and core[0][0] is C.MAX_REPEAT):
        return None
    lo, hi, sub = core[0][1]
    sub = list(sub)
    if len(sub) != 1:
        return None
    op, av = sub[0]
    if op is C.IN:
        rs = _class(av)
    elif op is C.LITERAL:
        rs = [(av, av)]
    elif op is C.ANY:
        rs = _DOT
    else:
        return None
    return rs, lo, (None if hi is C.MAXREPEAT else hi)


__all__ = ["PatternUnsupported", "translate", "single_class_repeat", "intersect"]


def name_matches(pattern: str, name: str) -> bool:
    """Whether a patternProperties pattern applies to member `name` (unanchored search;
    Python's re stands in for ECMA-262 on the patterns such names meet)."""
    return re.search(pattern, name) is not None
