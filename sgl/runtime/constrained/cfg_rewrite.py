"""Rewrite a character-level CFG (the GBNF syntax tree) so every rule can be a pushdown machine.

A pushdown machine (pushdown.py) must consume a byte before it calls itself again, and
never matches the empty string. So before machines are emitted the grammar is put in a
normal form over the same syntax nodes (gbnf.py), with two new leaves: `Call(B)`, a
reference to rule B's machine, whose language is L(B) minus the empty string, and
`Raw(rx)`, a terminal regex (Lark terminals, never empty). The steps:

1. Lexical rules (no recursion, only lexical references) stay `Ref`s and are inlined as
   regexes later. Rules that derive nothing (no base case) are cut, and so are their
   references; a root that derives nothing is an error.
2. Epsilon: a reference to a non-lexical rule B becomes `Call(B)`, or `Call(B)?` when B
   is nullable, so a machine never needs to accept "" (the machine drops "" itself).
3. Left recursion: within each strongly connected group of the left-corner graph, in rule
   order, earlier rules are substituted into later rules' leading positions (Paull's
   algorithm), and direct left recursion `A = A X | Y` becomes `A = Y X*`. The
   substitution works on regular right-hand sides through two derivatives: `lead(R, A)`
   (words w with A w in R) and `nonempty(R, drop=A)` (non-empty words of R not starting
   with A), so hidden left recursion (behind nullable prefixes or inside `*`) is removed
   too. A rewrite that grows past `_MAX_NODES` is refused with the rules named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import GrammarError
from .gbnf import Alt, Cls, Lit, Ref, Rep, Seq, children

_MAX_NODES = 200_000


@dataclass(frozen=True)
class Call:
    """A machine reference: one non-empty string of rule `name`."""

    name: str


@dataclass(frozen=True)
class Raw:
    """A terminal given as a regex (Rust/Python common dialect); never matches ""."""

    regex: str


N = Optional[object]  # a node, or None for the empty language
EPS = Seq(())


def alt(*opts: N) -> N:
    kept = [o for o in opts if o is not None]
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else Alt(tuple(kept))  # type: ignore[arg-type]


def seq(*items: N) -> N:
    if any(i is None for i in items):
        return None
    flat = [i for i in items if i != EPS]
    return flat[0] if len(flat) == 1 else Seq(tuple(flat))  # type: ignore[arg-type]


def star(item: N, lo: int = 0, hi: int | None = None) -> N:
    if item is None or hi == 0:
        return EPS if lo == 0 else None
    if item == EPS:
        return EPS
    return Rep(item, lo, hi)  # type: ignore[arg-type]


def size(node: object) -> int:
    return 1 + sum(size(c) for c in children(node))


class CfgRewriter:
    """Normal form of `rules` (name -> body). `bodies` maps every machine rule to its
    rewritten body; `lexical` the rules inlined as regexes; `nullable` the rules that
    derive ""; `machines` lists machine rules in definition order."""

    def __init__(self, rules: dict[str, object], kind: str = "ebnf", root: str = "root") -> None:
        self.rules, self.kind, self.root = rules, kind, root
        if root not in rules:
            raise GrammarError(f"{kind}: no `{root}` rule (the start symbol)")
        for name, body in rules.items():
            self._check_refs(name, body)
        self.lexical = {n for n in rules if self._is_lexical(n, frozenset())}
        self.productive = self._fix(self._productive)
        if root not in self.productive:
            raise GrammarError(f"{kind}: the grammar derives no string: rule {root!r} never "
                               "reaches an end (recursion without a base case)")
        self.nullable = self._fix(self._null)
        self.solid = self._fix(self._solid)  # rules deriving some non-empty string
        self.machines = [n for n in rules if n not in self.lexical and n in self.productive
                         and n in self.solid]
        self.bodies: dict[str, N] = {n: self.eform(rules[n]) for n in self.machines}
        self.root_body: N = self.eform(rules[root])
        self._left_recursion()
        if root in self.bodies:
            self.root_body = self.bodies[root]

    # -- analysis ------------------------------------------------------------------------
    def _check_refs(self, name: str, node: object) -> None:
        if isinstance(node, Ref) and node.name not in self.rules:
            raise GrammarError(f"{self.kind}: rule {node.name!r} is used in {name!r} but not defined")
        for c in children(node):
            self._check_refs(name, c)

    def _refs(self, node: object) -> set[str]:
        if isinstance(node, Ref):
            return {node.name}
        out: set[str] = set()
        for c in children(node):
            out |= self._refs(c)
        return out

    def _is_lexical(self, name: str, visiting: frozenset[str]) -> bool:
        if name in visiting:
            return False
        return all(self._is_lexical(r, visiting | {name}) for r in self._refs(self.rules[name]))

    def _fix(self, pred) -> set[str]:
        got: set[str] = set()
        while True:
            new = {n for n, body in self.rules.items() if n not in got and pred(body, got)}
            if not new:
                return got
            got |= new

    def _productive(self, node: object, ok: set[str]) -> bool:
        if isinstance(node, Ref):
            return node.name in ok
        if isinstance(node, Cls):
            return bool(node.ranges) or node.negated
        if isinstance(node, Alt):
            return any(self._productive(o, ok) for o in node.options)
        if isinstance(node, Seq):
            return all(self._productive(i, ok) for i in node.items)
        if isinstance(node, Rep):
            return node.lo == 0 or self._productive(node.item, ok)
        return True

    def _null(self, node: object, ok: set[str]) -> bool:
        if isinstance(node, Lit):
            return node.text == ""
        if isinstance(node, Ref):
            return node.name in ok
        if isinstance(node, Alt):
            return any(self._null(o, ok) for o in node.options)
        if isinstance(node, Seq):
            return all(self._null(i, ok) for i in node.items)
        if isinstance(node, Rep):
            return node.lo == 0 or node.hi == 0 or self._null(node.item, ok)
        return False

    def _solid(self, node: object, ok: set[str]) -> bool:
        """Derives a non-empty string (given rules `ok` do); productive parts only."""
        if isinstance(node, Lit):
            return node.text != ""
        if isinstance(node, Ref):
            return node.name in ok and node.name in self.productive
        if isinstance(node, Alt):
            return any(self._solid(o, ok) for o in node.options)
        if isinstance(node, Seq):
            return all(self._productive(i, self.productive) for i in node.items) and any(
                self._solid(i, ok) for i in node.items)
        if isinstance(node, Rep):
            return node.hi != 0 and self._solid(node.item, ok)
        return self._productive(node, self.productive)

    def nullable_node(self, node: object) -> bool:
        """Of a normal-form node (Call never nullable, Ref = lexical rule)."""
        if isinstance(node, Call):
            return False
        return self._null(node, self.nullable)

    # -- normal form ---------------------------------------------------------------------
    def eform(self, node: object) -> N:
        """`node` in normal form: machine references as Call (optional where nullable),
        lexical references kept, parts that derive nothing as None."""
        if isinstance(node, Ref):
            n = node.name
            if n not in self.productive:
                return None
            if n in self.lexical:
                return node
            if n not in self.solid:
                return EPS
            return star(Call(n), 0, 1) if n in self.nullable else Call(n)
        if isinstance(node, Cls) and not node.ranges and not node.negated:
            return None
        if isinstance(node, Alt):
            return alt(*(self.eform(o) for o in node.options))
        if isinstance(node, Seq):
            return seq(*(self.eform(i) for i in node.items))
        if isinstance(node, Rep):
            return star(self.eform(node.item), node.lo, node.hi)
        return node

    def corners(self, node: N) -> set[str]:
        """Machine rules that can come first in `node`."""
        if isinstance(node, Call):
            return {node.name}
        if isinstance(node, Alt):
            return set().union(*(self.corners(o) for o in node.options))
        if isinstance(node, Seq):
            out: set[str] = set()
            for i in node.items:
                out |= self.corners(i)
                if not self.nullable_node(i):
                    break
            return out
        if isinstance(node, Rep) and node.hi != 0:
            return self.corners(node.item)
        return set()

    def lead(self, node: N, a: str) -> N:
        """Words w such that Call(a) w is in `node`."""
        if isinstance(node, Call):
            return EPS if node.name == a else None
        if isinstance(node, Alt):
            return alt(*(self.lead(o, a) for o in node.options))
        if isinstance(node, Seq):
            opts = []
            for k, i in enumerate(node.items):
                opts.append(seq(self.lead(i, a), *node.items[k + 1:]))
                if not self.nullable_node(i):
                    break
            return alt(*opts)
        if isinstance(node, Rep) and node.hi != 0:
            rest = star(node.item, max(node.lo - 1, 0), None if node.hi is None else node.hi - 1)
            return seq(self.lead(node.item, a), rest)
        return None

    def nonempty(self, node: N, drop: str | None = None) -> N:
        """Non-empty words of `node`, leaving out those that start with Call(drop)."""
        if node is None:
            return None
        if isinstance(node, Call):
            return None if node.name == drop else node
        if isinstance(node, Lit):
            return node if node.text else None
        if isinstance(node, Ref):
            return self.nonempty(self.eform(self.rules[node.name]), drop) if node.name in self.nullable else node
        if isinstance(node, Alt):
            return alt(*(self.nonempty(o, drop) for o in node.options))
        if isinstance(node, Seq):
            if not node.items:
                return None
            head, rest = node.items[0], Seq(node.items[1:])
            first = seq(self.nonempty(head, drop), rest if rest.items else EPS)
            if not self.nullable_node(head):
                return first
            return alt(first, self.nonempty(rest, drop))
        if isinstance(node, Rep):
            if node.hi == 0:
                return None
            rest = star(node.item, max(node.lo - 1, 0), None if node.hi is None else node.hi - 1)
            return seq(self.nonempty(node.item, drop), rest)
        return node

    def _left_recursion(self) -> None:
        graph = {a: self.corners(self.bodies[a]) & set(self.bodies) for a in self.machines}
        order = {a: k for k, a in enumerate(self.machines)}
        for group in _sccs(self.machines, graph):
            if len(group) == 1 and group[0] not in graph[group[0]]:
                continue
            group.sort(key=order.__getitem__)
            for i, ai in enumerate(group):
                for aj in group[:i]:
                    body = self.bodies[ai]
                    if aj in self.corners(body):
                        sub = seq(self.nonempty(self.bodies[aj]), self.lead(body, aj))
                        nd = alt(self.nonempty(body, aj), EPS if self.nullable_node(body) else None)
                        self.bodies[ai] = alt(sub, nd)
                body = self.bodies[ai]
                if ai in self.corners(body):
                    base = self.nonempty(body, ai)
                    if base is None:
                        raise GrammarError(f"{self.kind}: rule {ai!r} is left-recursive with no "
                                           "non-recursive alternative")
                    self.bodies[ai] = seq(base, star(self.lead(body, ai)))
                if size(self.bodies[ai]) > _MAX_NODES:
                    raise GrammarError(f"{self.kind}: removing the left recursion through rules "
                                       f"{', '.join(map(repr, group))} makes the grammar too large")
            for ai in group:
                if self._left_reaches(ai, ai, set()):
                    raise GrammarError(f"{self.kind}: cannot remove the left recursion of rule {ai!r}")

    def _left_reaches(self, a: str, goal: str, seen: set[str]) -> bool:
        for b in self.corners(self.bodies.get(a)):
            if b == goal:
                return True
            if b not in seen and b in self.bodies:
                seen.add(b)
                if self._left_reaches(b, goal, seen):
                    return True
        return False


def _sccs(nodes: list[str], graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out
