"""The native byte-DFA builder: regex text -> whole trimmed ByteDFA through the native
grammar engine (native/), for callers that want a table (tests, tools, the Lark
backend's terminals).

`build(regex)` returns the DFA, or None where the regex uses syntax the C parser leaves
to the other builders (look-around, backreferences, `\\b`, `\\p{..}`, inline flags,
anchors inside the pattern, nested or set-operation classes; see native/regex_nfa.c),
or where no C compiler is present. Semantics are Rust `regex`'s, as on the outlines-core
route (dfa_rust.py): full match, `.` is any scalar value but newline, `\\d`, `\\s`,
`\\w` are Unicode-aware, U+10FFFF is never matched. Every reachable state is expanded,
so a regex whose DFA is huge costs its full size here; the engine's matchers expand
only the states a text visits.
"""

from __future__ import annotations

from .base import GrammarError
from .byte_dfa import ByteDFA
from .native.binding import NativeEngine, available
from .native.shorthand import shorthand_tables

# A regex whose whole DFA passes this is refused here (1 KB of table per state), as is one
# whose states' NFA member sets pass the engine's byte budget (binding.MAX_SET_BYTES).
MAX_DFA_STATES = 200_000


def build(regex: str, kind: str = "regex") -> ByteDFA | None:
    """Trimmed byte DFA of `regex` (full match), or None where this builder does not
    apply. GrammarError when the regex matches nothing or its DFA is too large."""
    if not available():
        return None
    eng = NativeEngine(1, kind, max_states=MAX_DFA_STATES)
    if not eng.set_regex(0, regex, calls=False, uni=shorthand_tables() if "\\" in regex else None):
        return None
    try:
        eng.finalize(0)
    except GrammarError as e:
        if "matches nothing" in str(e):
            raise GrammarError(f"{kind}: regex matches nothing") from None
        raise
    trans, accept = eng.export(0)
    return ByteDFA(trans, accept, 0)
