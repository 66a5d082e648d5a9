"""Any context-free grammar as pushdown machines: the general route for GBNF and Lark.

Why this route: the JSON-schema pushdown backend (pushdown.py) already parses a
character-level CFG with ambiguity (a configuration is a set of stacks), with masks cached
per frame and per configuration and walked over the vocabulary with numpy. A CFG in the
normal form of cfg_rewrite.py (no left recursion, no empty machines) maps onto it
directly: each non-lexical rule is a machine whose regex is its body over characters and
call markers (U+10F000+i), lexical rules are inlined into those regexes, and the root's
body is machine 0. The alternative, an Earley parser over a lexer (what llguidance
does), was not built: llguidance itself is available as `--grammar-backend llguidance`
and serves as the yardstick. Measured with benchmarks/bench_cfg_masks.py on the
JSON-like tests/data/gbnf/json.gbnf at the 49k vocabulary (211 states of 5 documents,
fresh tables, a shared 2-core machine): this route masks at p50 0.24-0.34 ms (cached frames
and configurations), p90 29-57 ms and p99 53-95 ms (first visits walk the vocabulary in
numpy), compile 0.5-2 s; the old GBNF -> LALR translation p50 29-35 ms, p99 138-170 ms;
llguidance p50 0.4-0.5 ms, p99 0.7-3.5 ms, compile 8-18 ms. The route keeps GBNF's character-level
semantics exactly (no lexer, no longest-match rule in the way) and reuses every cache of
the JSON-schema pushdown. Ambiguity costs stacks: repeated idempotent frames are folded
(see `CompiledCfg`), and a configuration keeps at most `_MAX_STACKS` stacks, the
shortest first; dropping parses never admits an invalid string (every stack left is a
live parse), it can only narrow which valid strings remain reachable.

Machines are built eagerly at compile (a GBNF file has a handful), each DFA disk-cached
like a lazy regex's; a callee machine's DFA has its empty match removed (`drop_empty`)
so that a call always consumes a byte.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .base import GrammarError
from .byte_dfa import ByteDFA
from .dfa_ops import drop_empty
from .cfg_rewrite import Call, CfgRewriter, Raw
from .gbnf import Alt, AnyChar, Cls, Lit, Ref, Rep, Seq
from .json_schema._regex import (MAX_CODEPOINT, ReservedCodePoint, call_marker, char_class,
                                 group, literal, repeat)
from .pushdown import CompiledPushdown
from .pushdown_build import PushdownTables, prune, split_calls
from .vocab import TokenizerInfo

_MAX_STACKS = 256


def rules_to_regexes(rw: CfgRewriter) -> tuple[str, list[str]]:
    """(machine 0's regex, callee regexes) of a rewritten grammar; callee k is machine
    k+1, called by marker k. Machine 0 matches "" exactly when the root is nullable."""
    ids = {name: k for k, name in enumerate(rw.machines)}
    lexical: dict[str, str | None] = {}

    def rx(node: Any) -> str | None:
        if node is None:
            return None
        if isinstance(node, Lit):
            try:
                return literal(node.text)
            except ReservedCodePoint:
                raise GrammarError(f"{rw.kind}: literal {node.text!r} uses a reserved code point "
                                   "(U+10F000..U+10FFFF)") from None
        if isinstance(node, Cls):
            return char_class(_complement(node.ranges) if node.negated else list(node.ranges))
        if isinstance(node, AnyChar):
            return char_class([(0, MAX_CODEPOINT)])
        if isinstance(node, Raw):
            return group(node.regex)
        if isinstance(node, Call):
            return call_marker(ids[node.name])
        if isinstance(node, Ref):
            if node.name not in lexical:
                lexical[node.name] = None
                lexical[node.name] = rx(rw.eform(rw.rules[node.name]))
            body = lexical[node.name]
            return None if body is None else group(body)
        if isinstance(node, Alt):
            parts = [p for p in (rx(o) for o in node.options) if p is not None]
            if not parts:
                return None
            parts = list(dict.fromkeys(parts))
            return parts[0] if len(parts) == 1 else group("|".join(parts))
        if isinstance(node, Seq):
            parts = [rx(i) for i in node.items]
            return None if any(p is None for p in parts) else "".join(parts)  # type: ignore[arg-type]
        assert isinstance(node, Rep), node
        return repeat(rx(node.item), node.lo, node.hi)

    if len(rw.machines) > 0x1000:
        raise GrammarError(f"{rw.kind}: more than 4096 recursive rules")
    root = rx(rw.root_body)
    if root is None:
        raise GrammarError(f"{rw.kind}: the grammar derives no string")
    if rw.root in rw.nullable and rw.nullable_node(rw.root_body) is False:
        root = group(root) + "?"
    subs = []
    for name in rw.machines:
        r = rx(rw.bodies[name])
        if r is None:
            raise GrammarError(f"{rw.kind}: rule {name!r} derives no string")
        subs.append(r)
    return root, subs


def _complement(ranges: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for a, b in sorted(ranges):
        if a > lo:
            out.append((lo, a - 1))
        lo = max(lo, b + 1)
    if lo <= MAX_CODEPOINT:
        out.append((lo, MAX_CODEPOINT))
    return out


def build_cfg_tables(root: str, subs: list[str], build: Callable[[str], ByteDFA],
                     kind: str) -> PushdownTables:
    """All machines at once (machine 0 = root, k+1 = subs[k]), pruned together."""
    machines: list[Any] = [split_calls(build(root), len(subs), kind)]
    for r in subs:
        machines.append(split_calls(drop_empty(build(r)), len(subs), kind))
    try:
        prune(machines, kind)
    except GrammarError as e:
        raise GrammarError(str(e).replace("the schema accepts no instance",
                                          "the grammar derives no string")) from None
    return PushdownTables(machines)


class CompiledCfg(CompiledPushdown):
    """A pushdown grammar for any CFG: configurations keep at most `_MAX_STACKS` parses,
    and stacks are folded where two frames below the top are the same idempotent frame.

    Folding: if frame (m, r) sits directly on an identical frame, and every accepting
    state reachable from r is the same state as r (same transitions, calls, accept),
    then L(r) is closed under concatenation and contains "", so L(r) L(r) = L(r) and one
    copy describes the same continuations. This is what keeps an ambiguous `e ::= e "+" e`
    (rewritten `e ::= num ("+" e)*`) at two stacks instead of one per "+" so far."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._idem: dict[tuple[int, int], bool] = {}

    def _bound_stacks(self, stacks: set) -> set:
        nxt = {self._fold(st) for st in stacks}
        if len(nxt) > _MAX_STACKS:
            nxt = set(sorted(nxt, key=lambda s: (len(s), s))[:_MAX_STACKS])
        return nxt

    def _fold(self, st: tuple) -> tuple:
        if len(st) < 6:
            return st
        out: list[int] = [st[0], st[1]]
        for i in range(2, len(st) - 2, 2):  # frames below the top
            m, r = st[i], st[i + 1]
            if out[-2] == m and out[-1] == r and self._idempotent(m, r):
                continue
            out += (m, r)
        out += st[-2:]
        return tuple(out) if len(out) < len(st) else st

    def _idempotent(self, m: int, r: int) -> bool:
        key = (m, r)
        got = self._idem.get(key)
        if got is None:
            got = self._idem[key] = _closed_under_concat(self.machines[m], r)
        return got


def _closed_under_concat(mach: Any, r: int) -> bool:
    """Every accepting state reachable from r (bytes or call returns) equals r."""
    if not mach.accept[r]:
        return False
    row, calls = mach.trans[r], mach.calls.get(r, ())
    seen, todo = {r}, [r]
    while todo:
        q = todo.pop()
        if mach.accept[q] and q != r and not (
                np.array_equal(mach.trans[q], row) and mach.calls.get(q, ()) == calls):
            return False
        nxt = set(mach.trans[q][mach.trans[q] >= 0].tolist())
        nxt.update(ret for _, ret in mach.calls.get(q, ()))
        for t in nxt - seen:
            seen.add(t)
            todo.append(t)
    return True


def compile_cfg(rules: dict[str, Any], tok: TokenizerInfo, kind: str,
                build: Callable[[str], ByteDFA], root: str = "root", native: bool = False) -> Any:
    """Rules (gbnf syntax tree, name -> body) -> compiled machines for `tok`: on the
    native engine (`native`; `build` only for regexes its parser does not read), else
    whole DFAs from `build` on the numpy pushdown."""
    rw = CfgRewriter(rules, kind, root)
    root_rx, subs = rules_to_regexes(rw)
    if native:
        from .native.compiled import from_cfg

        return from_cfg(root_rx, subs, tok, kind, build)
    return CompiledCfg(build_cfg_tables(root_rx, subs, build, kind), tok, kind)
