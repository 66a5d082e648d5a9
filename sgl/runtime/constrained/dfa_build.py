"""Regex -> trimmed byte-level DFA, the only compile step of the lazy regex backend.

Three builders produce the same `ByteDFA` (byte_dfa.py): by default the native one
(native_dfa.py, regex_dfa.c: parse, Thompson NFA, subset construction, all in C; well
under a millisecond for most schema regexes), which hands syntax it does not read
(look-around, `\\p{..}`, inline flags, ...) to Rust's regex-automata through
outlines-core (dfa_rust.py); or interegular via `regex_to_byte_dfa` (pure Python,
100-1000x slower on generated JSON Schema regexes, no Unicode classes), picked with
`SGL_LAZY_DFA=interegular`, and the Rust route alone with `SGL_LAZY_DFA=rust`. Either
way the result is trimmed: only states reachable from the start that can still reach
an accepting state survive, renumbered densely with the start at 0, so "alive after a
token's last byte" means "allowed". Semantics are Rust's (full match, Unicode-aware
shorthand classes); no builder matches U+10FFFF.
"""

from __future__ import annotations

from ..config import settings
from .base import GrammarError
from .byte_dfa import ByteDFA, regex_to_byte_dfa, trim
from .dfa_rust import build_rust
from .native_dfa import build as build_native

# Part of the disk-cache key: bump when the DFA a regex maps to may change.
DFA_VERSION = "lazy-dfa-4"  # 2: end marker (full-match semantics); 3: start marker; 4: native builder


def dfa_engine() -> str:
    """"native" (default), "rust" or "interegular", the lazy_dfa setting (SGL_LAZY_DFA)."""
    return settings().lazy_dfa


def build_byte_dfa(regex: str, kind: str = "regex", engine: str | None = None) -> ByteDFA:
    """Compile `regex` (full match) to a trimmed ByteDFA; GrammarError if unsupported."""
    engine = engine or dfa_engine()
    if engine == "interegular":
        try:
            dfa = regex_to_byte_dfa(regex)
        except ValueError as e:
            raise GrammarError(f"{kind}: cannot compile regex ({e})") from None
        return trim(dfa.trans, dfa.accept, dfa.initial)
    if engine == "native":
        dfa = build_native(regex, kind)
        if dfa is not None:
            return dfa
    return build_rust(regex, kind)
