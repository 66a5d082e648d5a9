"""A Lark grammar as character-level rules for the general CFG route (cfg_machines.py).

Used when Lark cannot build an LALR(1) table for a grammar (a conflict). Lark itself
loads the grammar (parser="earley" accepts any CFG) and hands over its expanded rules
(EBNF operators already turned into helper rules, left-recursive ones included) and its
terminals. Each terminal becomes a lexical rule: the terminal's regex, preceded by any
number of %ignore'd lexemes; the start rule is followed by them too. The result is the
language of the grammar read at the character level: the same as Lark's Earley parser
with a complete dynamic lexer; a string that only a longest-match lexer would split
differently may be accepted here where LALR's contextual lexer would refuse it.
"""

from __future__ import annotations

from typing import Any

from .base import GrammarError
from .cfg_rewrite import Raw
from .gbnf import Alt, Lit, Ref, Rep, Seq

ROOT = "$root"  # not a Lark rule name, so it never collides

# Lark's common.lark spells these with lookbehinds, which a DFA cannot express.
_LOOKAROUND_FREE = {
    r'".*?(?<!\\)(\\\\)*?"': r'"(?:[^"\\\n]|\\[^\n])*"',
    r"'.*?(?<!\\)(\\\\)*?'": r"'(?:[^'\\\n]|\\[^\n])*'",
}
_NOT_RESERVED = r"\U0010f000-\U0010ffff"


def lark_rules(text: str, start: str = "start") -> dict[str, Any]:
    """Lark grammar text -> rules (name -> body) with `ROOT` as the start rule."""
    import lark
    from lark.lexer import PatternStr

    try:
        lk = lark.Lark(text, parser="earley", lexer="dynamic", start=start)
    except Exception as e:  # noqa: BLE001 - any load failure is the user's grammar
        raise GrammarError(f"lark: invalid grammar ({type(e).__name__}: {e})") from None
    terms = {t.name: t for t in lk.terminals}
    ign = [Raw(_terminal_regex(terms[n])) for n in lk.ignore_tokens if n in terms]
    skip: Any = Rep(Alt(tuple(Seq((r,)) for r in ign)), 0, None) if ign else Seq(())
    rules: dict[str, Any] = {}
    options: dict[str, list[Seq]] = {}
    for r in lk.rules:
        items = tuple(Ref("T:" + s.name) if s.is_term else Ref(s.name) for s in r.expansion)
        options.setdefault(r.origin.name, []).append(Seq(items))
    for name, opts in options.items():
        rules[name] = Alt(tuple(opts))
    for name, t in terms.items():
        body = Lit(t.pattern.value) if isinstance(t.pattern, PatternStr) and not t.pattern.flags \
            else Raw(_terminal_regex(t))
        rules["T:" + name] = Seq((skip, body))
    if start not in rules:
        raise GrammarError(f"lark: no rule {start!r} (the start symbol)")
    rules[ROOT] = Seq((Ref(start), skip))
    return rules


def _terminal_regex(t: Any) -> str:
    rx = t.pattern.to_regexp()
    return _exclude_reserved(_LOOKAROUND_FREE.get(rx, rx))


def _exclude_reserved(rx: str) -> str:
    """Keep a terminal regex off the call-marker code points: negated classes, `.` and
    the negated shorthands (\\S \\W \\D) leave out U+10F000..U+10FFFF."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(rx):
        c = rx[i]
        if c == "\\" and i + 1 < len(rx):
            e = rx[i + 1]
            if not in_class and e in "SWD":
                out.append(f"[^\\{e.lower()}{_NOT_RESERVED}]")
            else:
                out.append(rx[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "]" and out[-1] not in ("[", "[^"):
                in_class = False
            out.append(c)
        elif c == "[":
            in_class = True
            if rx[i + 1:i + 2] == "^":
                out.append("[^" + _NOT_RESERVED)
                i += 2
                # a leading ']' is a literal in the class
                continue
            out.append("[")
        elif c == ".":
            out.append(f"[^\\n{_NOT_RESERVED}]")
        else:
            out.append(c)
        i += 1
    return "".join(out)
