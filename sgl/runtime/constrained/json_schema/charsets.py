"""Sets of decoded characters, and how to spell them inside a JSON string.

Patterns, formats and property-name exclusions talk about *decoded* characters, but
the regex runs over the JSON text. `encode_set` turns a set of code points into the
alternation of their canonical JSON spellings (raw where JSON allows it, the short
escapes, `\\u00XX` for other control characters), the spellings `json.dumps(...,
ensure_ascii=False)` produces. Arbitrary `\\uXXXX` spellings are left out on purpose:
they would let a constrained string smuggle in characters the set excludes.
"""

from __future__ import annotations

from ._regex import MAX_CODEPOINT, Frag, NEVER, alt, char_class
from .memo import memo, memo_small

Ranges = list[tuple[int, int]]

# Regexes matching the short escape that spells each code point.
_SHORT = {0x22: r'\\"', 0x5C: r"\\\\", 0x08: r"\\b", 0x0C: r"\\f", 0x0A: r"\\n",
          0x0D: r"\\r", 0x09: r"\\t"}
_OTHER_CONTROLS = [cp for cp in range(0x20) if cp not in _SHORT]


def normalize(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def complement(ranges: Ranges, universe: tuple[int, int] = (0, MAX_CODEPOINT)) -> Ranges:
    out: Ranges = []
    nxt = universe[0]
    for lo, hi in normalize(ranges):
        if lo > nxt:
            out.append((nxt, min(lo - 1, universe[1])))
        nxt = max(nxt, hi + 1)
    if nxt <= universe[1]:
        out.append((nxt, universe[1]))
    return [(a, b) for a, b in out if a <= b]


def intersect(a: Ranges, b: Ranges) -> Ranges:
    out: Ranges = []
    for lo1, hi1 in normalize(a):
        for lo2, hi2 in normalize(b):
            lo, hi = max(lo1, lo2), min(hi1, hi2)
            if lo <= hi:
                out.append((lo, hi))
    return normalize(out)


def encode_set(ranges: Ranges) -> Frag:
    """Regex for one decoded character from `ranges`, spelled canonically in JSON."""
    return _encode_set(tuple(normalize(ranges)))


# Memoized: key tries and patterns spell the same few hundred sets thousands of times
# (one Kubernetes schema: ~8k key characters and ~4k trie exits, ~400 distinct sets).
@memo(1 << 21, lambda ranges, out: 8 * len(ranges) + len(out or ""))
def _encode_set(ranges: tuple[tuple[int, int], ...]) -> Frag:
    raw = intersect(ranges, [(0x20, 0x21), (0x23, 0x5B), (0x5D, MAX_CODEPOINT)])
    parts: list[Frag] = [char_class(raw)]
    # Every code point spelled as an escape is below 0x5D; `ranges` is sorted.
    low: set[int] = set()
    for lo, hi in ranges:
        if lo > 0x5C:
            break
        low.update(range(lo, min(hi, 0x5C) + 1))
    parts += [spelled for cp, spelled in _SHORT.items() if cp in low]
    others = [cp for cp in _OTHER_CONTROLS if cp in low]
    if len(others) == len(_OTHER_CONTROLS):
        parts.append(r"\\u00(?:0[0-7bef]|1[0-9a-f])")
    else:
        parts.extend(r"\\u00%02x" % cp for cp in others)
    return alt(parts) if any(p is not None for p in parts) else NEVER


def encode_literal(text: str) -> str:
    """Regex for the canonical JSON spelling of the decoded string `text` (no quotes)."""
    return "".join(map(_encode_char, text))


@memo_small(1 << 12)
def _encode_char(ch: str) -> str:
    frag = _encode_set(((ord(ch), ord(ch)),))
    assert frag is not None
    return frag
