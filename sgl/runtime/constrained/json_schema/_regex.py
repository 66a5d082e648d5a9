"""Small regex-building helpers shared by the JSON Schema converter.

A fragment is a regex string, or `NEVER` (None) for "matches nothing": outlines-core
has no empty-language regex, so impossible branches (a recursion cut off at its depth
bound, an empty enum intersection) are pruned while building instead. The emitted
dialect is the common subset of Python `re` and Rust `regex` (what outlines-core
compiles), so tests can check our output with `re.fullmatch`.
"""

from __future__ import annotations

import json
from typing import Iterable, Optional

from .memo import Table

Frag = Optional[str]
NEVER: Frag = None

# Code points U+10F000..U+10FFFF (the top of Plane 16's private use area) are reserved
# as call markers of the pushdown backend (see machines.py): one marker per sub-machine
# stands for "a value of that machine appears here". Every character class the
# converter emits stops below them, so a marker byte path in a DFA is never text.
RESERVED_BASE = 0x10F000
RESERVED_COUNT = 0x1000
MAX_CODEPOINT = RESERVED_BASE - 1
SURROGATES = (0xD800, 0xDFFF)
_NOT_RESERVED = r"\U0010f000-\U0010ffff"

# One character of a JSON string body, any spelling (raw, short escape, \uXXXX).
ANY_CHAR = r'(?:[^"\\\x00-\x1f' + _NOT_RESERVED + r']|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
# One *decoded* character per match, so counting matches counts characters:
# \u escapes outside the surrogate block, or a full surrogate pair.
COUNTED_CHAR = (
    r'(?:[^"\\\x00-\x1f' + _NOT_RESERVED + r']|\\["\\/bfnrt]'
    r"|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})"
    r"|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})"
)
# One decoded character spelled the way `json.dumps(..., ensure_ascii=False)` spells it
# (raw, short escape, or \u00XX for a control character): ~15 DFA states per counted
# character where COUNTED_CHAR's free \uXXXX spellings cost ~26, so long maxLength
# bounds stay cheap. Still sound: every match decodes to exactly one character.
CANON_COUNTED_CHAR = r'(?:[^"\\\x00-\x1f' + _NOT_RESERVED + r']|\\["\\/bfnrt]|\\u00[01][0-9a-fA-F])'
STRING = '"' + ANY_CHAR + '*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = "(?:true|false)"
NULL = "null"

_META = set(".^$|?*+()[]{}\\-&~#")


def esc_char(cp: int) -> str:
    """Spell one code point so both Python `re` and Rust `regex` read it literally."""
    c = chr(cp)
    if c.isascii() and c.isalnum():
        return c
    if cp < 0x80:
        if c in _META or cp < 0x20 or cp == 0x7F or c in "\"'/<>`":
            return "\\x%02x" % cp
        return c
    if cp <= 0xFFFF:
        return "\\u%04x" % cp
    return "\\U%08x" % cp


class _Spellings(Table):
    """code point -> esc_char(code point), filled on first use: `str.translate` with it
    spells a long enum in C instead of one Python call per character."""

    def __missing__(self, cp: int) -> str:
        out = esc_char(cp)
        return self.put(cp, out, len(out))


_SPELLINGS = _Spellings(1 << 21)


def literal(text: str) -> str:
    """A regex matching exactly `text` (raw bytes of already-encoded JSON)."""
    if text and max(text) >= chr(RESERVED_BASE):
        # Spelled literally it would read as a call marker; no schema in practice uses these.
        raise ReservedCodePoint(text)
    return text.translate(_SPELLINGS)


class ReservedCodePoint(ValueError):
    """A literal uses a code point reserved for call markers (U+10F000..U+10FFFF)."""


def call_marker(machine_id: int) -> str:
    """The regex text standing for one value of sub-machine `machine_id`."""
    if not 0 <= machine_id < RESERVED_COUNT:
        raise ValueError(f"machine id {machine_id} outside the marker range")
    return "\\U%08x" % (RESERVED_BASE + machine_id)


# What json.dumps(value, separators=(",", ":"), ensure_ascii=False) builds per call.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def json_literal(value: object) -> str:
    """A regex matching the compact canonical JSON serialization of `value`."""
    return literal(_COMPACT.encode(value))


def group(frag: str) -> str:
    return "(?:" + frag + ")"


def alt(frags: Iterable[Frag]) -> Frag:
    # First occurrences in order; a dict keeps long enums linear (a list scan was quadratic).
    kept = [f for f in dict.fromkeys(frags) if f is not None]
    if not kept:
        return NEVER
    if len(kept) == 1:
        return kept[0]
    return group("|".join(kept))


def seq(*frags: Frag) -> Frag:
    if any(f is None for f in frags):
        return NEVER
    return "".join(frags)  # type: ignore[arg-type]


def opt(frag: Frag) -> str:
    if frag is None or frag == "":
        return ""
    return group(frag) + "?"


def repeat(frag: Frag, lo: int, hi: Optional[int]) -> Frag:
    """`frag` repeated lo..hi times (hi None = unbounded); NEVER allows only zero."""
    if frag is None:
        return "" if lo == 0 else NEVER
    if hi is not None and hi < lo:
        return NEVER
    if hi == 0:
        return ""
    g = group(frag)
    if hi is None:
        if lo == 0:
            return g + "*"
        if lo == 1:
            return g + "+"
        return g + "{%d,}" % lo
    if lo == hi:
        return g if lo == 1 else g + "{%d}" % lo
    if lo == 0 and hi == 1:
        return g + "?"
    return g + "{%d,%d}" % (lo, hi)


def char_class(ranges: list[tuple[int, int]]) -> Frag:
    """A class matching code points in `ranges` (surrogates dropped); NEVER if empty."""
    parts = []
    for lo, hi in ranges:
        hi = min(hi, MAX_CODEPOINT)  # never the reserved marker range
        if lo > hi:
            continue
        for a, b in _minus_surrogates(lo, hi):
            parts.append(esc_char(a) if a == b else esc_char(a) + "-" + esc_char(b))
    if not parts:
        return NEVER
    if len(parts) == 1 and "-" not in parts[0][1:]:
        return parts[0]
    return "[" + "".join(parts) + "]"


def _minus_surrogates(lo: int, hi: int) -> list[tuple[int, int]]:
    s0, s1 = SURROGATES
    if hi < s0 or lo > s1:
        return [(lo, hi)]
    out = []
    if lo < s0:
        out.append((lo, s0 - 1))
    if hi > s1:
        out.append((s1 + 1, hi))
    return out
