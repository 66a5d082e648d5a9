"""GBNF (llama.cpp / xgrammar EBNF): the parser (text -> syntax tree) and a Lark translation.

The syntax tree (`parse_gbnf`) is what the general CFG route compiles (cfg_rewrite.py,
cfg_machines.py). The Lark translation below is the older LALR(1) route, kept as an
independent reading of the same grammar (the grammar tests parse model outputs with Lark
Earley on it).

GBNF is character-level: `name ::= ...` rules with literals, char classes (negation,
ranges, escapes), `.`, grouping, `* + ?`, `{m,n}`, `#` comments, and `root` as start.
Lark's LALR needs a lexer, so rules that are purely lexical (only literals, classes and
other lexical rules, no recursion) become terminals with one regex each; the rest stay
rules. A lexical rule that can match the empty string is emitted as a non-empty
terminal and referenced as optional, since Lark terminals may not match "". Grammars
that are not LALR(1) after this translation are rejected by Lark with its message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .base import GrammarError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_RULE_START = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)\s*::=")


@dataclass(frozen=True)
class Lit:
    text: str


@dataclass(frozen=True)
class Cls:
    ranges: tuple[tuple[int, int], ...]
    negated: bool


@dataclass(frozen=True)
class AnyChar:
    pass


@dataclass(frozen=True)
class Ref:
    name: str


@dataclass(frozen=True)
class Alt:
    options: tuple["Seq", ...]


@dataclass(frozen=True)
class Seq:
    items: tuple["Node", ...]


@dataclass(frozen=True)
class Rep:
    item: "Node"
    lo: int
    hi: int | None


Node = Lit | Cls | AnyChar | Ref | Alt | Seq | Rep


class _Parser:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def err(self, msg: str) -> GrammarError:
        line = self.s.count("\n", 0, self.i) + 1
        return GrammarError(f"ebnf: {msg} at line {line}")

    def skip(self) -> None:
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in " \t\r\n":
                self.i += 1
            elif c == "#":
                j = self.s.find("\n", self.i)
                self.i = len(self.s) if j < 0 else j
            else:
                return

    def rules(self) -> dict[str, Alt]:
        out: dict[str, Alt] = {}
        self.skip()
        while self.i < len(self.s):
            m = _RULE_START.match(self.s, self.i)
            if not m:
                raise self.err("expected `name ::=`")
            self.i = m.end()
            name = m.group(1)
            if name in out:
                raise self.err(f"rule {name!r} defined twice")
            out[name] = self.alt()
            self.skip()
        return out

    def at_rule_start(self) -> bool:
        return bool(_RULE_START.match(self.s, self.i))

    def alt(self) -> Alt:
        opts = [self.seq()]
        while True:
            self.skip()
            if self.i < len(self.s) and self.s[self.i] == "|":
                self.i += 1
                opts.append(self.seq())
            else:
                return Alt(tuple(opts))

    def seq(self) -> Seq:
        items: list[Node] = []
        while True:
            self.skip()
            if self.i >= len(self.s) or self.s[self.i] in "|)" or self.at_rule_start():
                return Seq(tuple(items))
            items.append(self.postfix(self.atom()))

    def atom(self) -> Node:
        c = self.s[self.i]
        if c == '"':
            return Lit(self.string())
        if c == "[":
            return self.char_class()
        if c == ".":
            self.i += 1
            return AnyChar()
        if c == "(":
            self.i += 1
            a = self.alt()
            self.skip()
            if self.i >= len(self.s) or self.s[self.i] != ")":
                raise self.err("missing `)`")
            self.i += 1
            return a
        m = _NAME.match(self.s, self.i)
        if m:
            self.i = m.end()
            return Ref(m.group(0))
        raise self.err(f"unexpected {c!r}")

    def postfix(self, node: Node) -> Node:
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in "*+?":
                self.i += 1
                node = Rep(node, 1 if c == "+" else 0, 1 if c == "?" else None)
            elif c == "{":
                m = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}").match(self.s, self.i)
                if not m:
                    raise self.err("bad repetition `{m,n}`")
                self.i = m.end()
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                if hi is not None and hi < lo:
                    raise self.err("repetition max below min")
                node = Rep(node, lo, hi)
            else:
                return node
        return node

    def char(self, end: str) -> int:
        s = self.s
        if self.i >= len(s):
            raise self.err("unterminated literal")
        c = s[self.i]
        if c != "\\":
            self.i += 1
            return ord(c)
        e = s[self.i + 1: self.i + 2]
        simple = {"n": 10, "t": 9, "r": 13, "\\": 92, '"': 34, "]": 93, "[": 91, "-": 45,
                  "^": 94, "'": 39, "0": 0, "/": 47, "f": 12, "b": 8, "v": 11, "a": 7}
        if e in simple:
            self.i += 2
            return simple[e]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            h = s[self.i + 2: self.i + 2 + width]
            if len(h) != width or not all(ch in "0123456789abcdefABCDEF" for ch in h):
                raise self.err(f"bad escape \\{e}{h}")
            self.i += 2 + width
            return int(h, 16)
        if e:
            self.i += 2
            return ord(e)
        raise self.err("dangling backslash")

    def string(self) -> str:
        self.i += 1
        out: list[str] = []
        while True:
            if self.i >= len(self.s):
                raise self.err("unterminated string literal")
            if self.s[self.i] == '"':
                self.i += 1
                return "".join(out)
            out.append(chr(self.char('"')))

    def char_class(self) -> Cls:
        self.i += 1
        neg = self.s[self.i: self.i + 1] == "^"
        if neg:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.i >= len(self.s):
                raise self.err("unterminated character class")
            if self.s[self.i] == "]" and not first:
                self.i += 1
                return Cls(tuple(ranges), neg)
            first = False
            lo = self.char("]")
            if self.s[self.i: self.i + 1] == "-" and self.s[self.i + 1: self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.char("]")
                if hi < lo:
                    raise self.err("character range out of order")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))


def _rx_char(cp: int, in_class: bool) -> str:
    c = chr(cp)
    special = "\\]^-[" if in_class else "\\.^$*+?{}[]|()/"
    if c in special:
        return "\\" + c
    if cp < 32 or cp == 127 or c == "/" or (0x80 <= cp < 0xA0):
        return f"\\x{cp:02x}"
    return c


class _Translator:
    def __init__(self, rules: dict[str, Alt], char_level: bool = False) -> None:
        self.rules = rules
        self.char_level = char_level
        self.lexical: dict[str, bool] = {}
        self.names: dict[str, str] = {}
        self._nullable: dict[Node, bool] = {}
        for name, body in rules.items():
            self._refs_defined(body)

    def _refs_defined(self, node: Node) -> None:
        if isinstance(node, Ref):
            if node.name not in self.rules:
                raise GrammarError(f"ebnf: rule {node.name!r} is used but not defined")
        for child in children(node):
            self._refs_defined(child)

    def is_lexical(self, name: str, visiting: frozenset[str] = frozenset()) -> bool:
        if self.char_level:
            return False
        if name in self.lexical:
            return self.lexical[name]
        if name in visiting:
            return False
        ok = all(self.is_lexical(r, visiting | {name}) for r in _refs(self.rules[name]))
        if not visiting:
            self.lexical[name] = ok
        return ok

    def nullable(self, node: Node, seen: frozenset[str] = frozenset()) -> bool:
        if isinstance(node, Lit):
            return node.text == ""
        if isinstance(node, (Cls, AnyChar)):
            return False
        if isinstance(node, Ref):
            return node.name not in seen and self.nullable(self.rules[node.name], seen | {node.name})
        if isinstance(node, Alt):
            return any(self.nullable(o, seen) for o in node.options)
        if isinstance(node, Seq):
            return all(self.nullable(i, seen) for i in node.items)
        assert isinstance(node, Rep)
        return node.lo == 0 or self.nullable(node.item, seen)

    # -- regex (lexical rules) ---------------------------------------------------------
    def rx(self, node: Node) -> str:
        if isinstance(node, Lit):
            return "".join(_rx_char(ord(c), False) for c in node.text)
        if isinstance(node, Cls):
            body = "".join(_rx_char(a, True) if a == b else f"{_rx_char(a, True)}-{_rx_char(b, True)}"
                           for a, b in node.ranges)
            return f"[{'^' if node.negated else ''}{body}]"
        if isinstance(node, AnyChar):
            return "(?:.|\\n)"
        if isinstance(node, Ref):
            return f"(?:{self.rx(self.rules[node.name])})"
        if isinstance(node, Alt):
            return "(?:" + "|".join(self.rx(o) for o in node.options) + ")"
        if isinstance(node, Seq):
            return "".join(self.rx(i) for i in node.items)
        assert isinstance(node, Rep)
        return f"(?:{self.rx(node.item)}){_quant(node.lo, node.hi)}"

    def rx_nonempty(self, node: Node) -> str | None:
        """Regex for the non-empty strings of `node` (None if it has none)."""
        if not self.nullable(node):
            return self.rx(node)
        if isinstance(node, Lit):
            return None
        if isinstance(node, Ref):
            return self.rx_nonempty(self.rules[node.name])
        if isinstance(node, Alt):
            parts = [p for p in (self.rx_nonempty(o) for o in node.options) if p is not None]
            return "(?:" + "|".join(parts) + ")" if parts else None
        if isinstance(node, Seq):
            if not node.items:
                return None
            head, rest = node.items[0], Seq(node.items[1:])
            opts = []
            h = self.rx_nonempty(head)
            if h is not None:
                opts.append(h + self.rx(rest))
            r = self.rx_nonempty(rest)  # head is nullable here (node is nullable)
            if r is not None:
                opts.append(r)
            return "(?:" + "|".join(opts) + ")" if opts else None
        assert isinstance(node, Rep)
        inner = self.rx_nonempty(node.item)
        if inner is None or node.hi == 0:
            return None
        tail = "*" if node.hi is None else _quant(0, node.hi - 1)
        return f"(?:{inner}(?:{self.rx(node.item)}){tail})"

    # -- lark rules --------------------------------------------------------------------
    def term_name(self, name: str) -> str:
        return "T_" + re.sub(r"[^A-Za-z0-9_]", "_", name).upper() + f"_{_stable_id(name).upper()}"

    def rule_name(self, name: str) -> str:
        return "r_" + re.sub(r"[^A-Za-z0-9_]", "_", name).lower() + f"_{_stable_id(name)}"

    def expr(self, node: Node, used_terms: set[str]) -> str:
        if isinstance(node, Lit):
            if node.text == "":
                return ""
            return f"/{self.rx(node)}/" if _needs_regex(node.text) else '"' + node.text.replace(
                "\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(node, (Cls, AnyChar)):
            return f"/{self.rx(node)}/"
        if isinstance(node, Ref):
            if self.is_lexical(node.name):
                used_terms.add(node.name)
                t = self.term_name(node.name)
                if self.rx_nonempty(self.rules[node.name]) is None:
                    return ""
                return t + "?" if self.nullable(self.rules[node.name]) else t
            return self.rule_name(node.name)
        if isinstance(node, Alt):
            opts = [self.expr(o, used_terms) for o in node.options]
            nonempty = [o for o in opts if o.strip()]
            if not nonempty:
                return ""
            inner = "(" + " | ".join(nonempty) + ")"
            return inner + "?" if len(nonempty) < len(opts) else inner
        if isinstance(node, Seq):
            parts = [p for p in (self.expr(i, used_terms) for i in node.items) if p.strip()]
            return "(" + " ".join(parts) + ")" if parts else ""
        assert isinstance(node, Rep)
        inner = self.expr(node.item, used_terms)
        if not inner.strip() or node.hi == 0:
            return ""
        lo, hi = node.lo, node.hi
        if (lo, hi) == (0, None):
            return f"({inner})*"
        if (lo, hi) == (1, None):
            return f"({inner})+"
        if (lo, hi) == (0, 1):
            return f"({inner})?"
        if hi is None:
            return f"(({inner}) ~ {lo}) ({inner})*"
        if lo == 0:
            return f"[({inner}) ~ 1..{hi}]"
        return f"({inner}) ~ {lo}..{hi}" if lo != hi else f"({inner}) ~ {lo}"

    def to_lark(self) -> str:
        if "root" not in self.rules:
            raise GrammarError("ebnf: no `root` rule (the start symbol)")
        used_terms: set[str] = set()
        lines = [f"start: {self.expr(Ref('root'), used_terms) or '()'}"]
        for name, body in self.rules.items():
            if self.is_lexical(name) or not self._reachable(name):
                continue
            e = self.expr(body, used_terms)
            lines.append(f"{self.rule_name(name)}: {e if e.strip() else '()'}")
        for name in sorted(used_terms):
            rx = self.rx_nonempty(self.rules[name])
            if rx is not None:
                lines.append(f"{self.term_name(name)}: /{rx}/")
        return "\n".join(lines) + "\n"

    def _reachable(self, name: str) -> bool:
        seen: set[str] = set()
        todo = ["root"]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if not self.is_lexical(n):
                todo.extend(_refs(self.rules[n]))
        return name in seen


def _needs_regex(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _quant(lo: int, hi: int | None) -> str:
    if (lo, hi) == (0, None):
        return "*"
    if (lo, hi) == (1, None):
        return "+"
    if (lo, hi) == (0, 1):
        return "?"
    return f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"


def _stable_id(name: str) -> str:
    import hashlib

    return hashlib.md5(name.encode()).hexdigest()[:6]


def children(node: object) -> tuple:
    """The direct sub-expressions of a rule body node."""
    if isinstance(node, Alt):
        return node.options
    if isinstance(node, Seq):
        return node.items
    if isinstance(node, Rep):
        return (node.item,)
    return ()


def _refs(node: Node) -> set[str]:
    if isinstance(node, Ref):
        return {node.name}
    out: set[str] = set()
    for c in children(node):
        out |= _refs(c)
    return out


def gbnf_to_lark(text: str, char_level: bool = False) -> str:
    """Translate GBNF text to a Lark grammar whose start rule is `start`.

    `char_level=True` keeps every rule a Lark rule (terminals are only literals and
    single-character classes), for Lark's Earley parser: exact GBNF semantics with no
    regex alternation deciding a lexeme's length."""
    return _Translator(parse_gbnf(text), char_level).to_lark()


def parse_gbnf(text: str) -> dict[str, Alt]:
    """GBNF text -> its rules (name -> body), in definition order."""
    rules = _Parser(text).rules()
    if not rules:
        raise GrammarError("ebnf: empty grammar")
    return rules
