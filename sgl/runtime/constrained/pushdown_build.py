"""Machine regexes -> byte DFAs with call edges: the compile step of the pushdown backend.

Each machine regex (json_schema/machines.py) is built into a trimmed `ByteDFA` exactly
like a lazy regex (dfa_build.py, disk-cached by regex text). A call marker for machine
i is the code point U+10F000+i, i.e. the UTF-8 bytes F4 8F xx yy, and the converter
never lets text use that range; so every path F4 8F xx yy from a state s to a state r
is a call edge s --call i--> r. The marker bytes are cut out of the table afterwards,
and liveness is recomputed over the whole machine set: a state is productive if it
accepts, or a byte leads to a productive state, or it calls a machine whose language is
not empty and returns to a productive state (a least fixpoint across machines).
Transitions and calls into unproductive states are removed, so "alive" still means "a
completion exists" for the matcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .base import GrammarError
from .byte_dfa import ByteDFA
from .dfa_build import coreachable
from .json_schema.machines import Intersect, Sub

_LEAD, _MARK = 0xF4, 0x8F  # U+10F000..U+10FFFF = F4 8F [80-BF] [80-BF]


@dataclass
class Machine:
    """One byte DFA whose states may call other machines. Start state is 0."""

    trans: np.ndarray  # int32 [S, 256], -1 = dead; marker bytes removed
    accept: np.ndarray  # bool [S]
    calls: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)  # s -> ((callee, ret), ...)
    has_call: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    @property
    def num_states(self) -> int:
        return int(self.accept.size)


@dataclass
class PushdownTables:
    """Machine 0 is the root; a call names a machine by its index here."""

    machines: list[Machine]

    @property
    def num_states(self) -> int:
        return sum(m.num_states for m in self.machines)


def split_calls(dfa: ByteDFA, num_subs: int, kind: str) -> Machine:
    """Cut marker paths out of `dfa` into call edges (callee index = sub id + 1)."""
    trans = dfa.trans.copy()
    accept = dfa.accept.copy()
    calls: dict[int, list[tuple[int, int]]] = {}
    src = np.nonzero(trans[:, _LEAD] >= 0)[0]
    mids = trans[src, _LEAD]
    marks = trans[mids, _MARK]
    for s, t, u in zip(src.tolist(), mids.tolist(), marks.tolist()):
        if u < 0:
            continue
        for x in np.nonzero(trans[u, 0x80:0xC0] >= 0)[0].tolist():
            v = int(trans[u, 0x80 + x])
            for y in np.nonzero(trans[v, 0x80:0xC0] >= 0)[0].tolist():
                sub = x * 64 + y
                if sub >= num_subs:
                    raise GrammarError(f"{kind}: reserved code point U+{0x10F000 + sub:X} in text")
                calls.setdefault(s, []).append((sub + 1, int(trans[v, 0x80 + y])))
    for t in set(mids[marks >= 0].tolist()):
        trans[t, _MARK] = -1
    has = np.zeros(trans.shape[0], dtype=bool)
    has[list(calls)] = True
    return Machine(trans, accept, {s: tuple(c) for s, c in calls.items()}, has)


def prune(machines: list[Machine], kind: str) -> None:
    """Least-fixpoint productivity over all machines; cut what cannot complete."""
    n = len(machines)
    live = [coreachable(m.trans, m.accept) for m in machines]
    while True:
        nonempty = [bool(lv[0]) if lv.size else False for lv in live]
        changed = False
        for i, m in enumerate(machines):
            goal = m.accept.copy()
            for s, cs in m.calls.items():
                if any(nonempty[j] and live[i][r] for j, r in cs):
                    goal[s] = True
            new = coreachable(m.trans, goal)
            if (new != live[i]).any():
                live[i], changed = new, True
        if not changed:
            break
    if not live[0].size or not live[0][0]:
        raise GrammarError(f"{kind}: the schema accepts no instance")
    nonempty = [bool(lv[0]) if lv.size else False for lv in live]
    for i, m in enumerate(machines):
        lv = live[i]
        t = m.trans
        m.trans = np.where((t >= 0) & lv[np.maximum(t, 0)], t, -1).astype(np.int32)
        kept: dict[int, tuple[tuple[int, int], ...]] = {}
        for s, cs in m.calls.items():
            ok = tuple((j, r) for j, r in cs if lv[s] and nonempty[j] and lv[r])
            if ok:
                kept[s] = ok
        m.calls = kept
        m.has_call = np.zeros(m.num_states, dtype=bool)
        m.has_call[list(kept)] = True
    for j in range(1, n):
        if nonempty[j] and machines[j].accept[0]:
            # A value is never empty; an empty match would let calls loop in place.
            raise GrammarError(f"{kind}: sub-machine {j} matches the empty string")


def intersect_dfa(sub: Intersect, build: Callable[[str], ByteDFA]) -> ByteDFA:
    """The product DFA of an Intersect sub: the trimmed product of the parts' DFAs
    (dfa_ops.intersect; each part's DFA has full-match semantics, see dfa_build).
    GrammarError "matches nothing" when the intersection is empty."""
    from .dfa_ops import intersect

    return intersect([build(p) for p in sub.parts])


def _empty_machine() -> Machine:
    empty = np.full((1, 256), -1, dtype=np.int32)
    return Machine(empty, np.zeros(1, dtype=bool), {}, np.zeros(1, dtype=bool))


def build_tables(root: str, subs: list[Sub], build: Callable[[str], ByteDFA],
                 kind: str = "json_schema",
                 build_intersect: Callable[[Intersect], ByteDFA] | None = None) -> PushdownTables:
    """Build every machine DFA with `build(regex)` (the lazy backend's cached builder)
    and every Intersect sub with
    `build_intersect(sub)` (default: `intersect_dfa(sub, build)`)."""
    out: list[Machine] = []
    for sub in [root] + subs:
        if sub is None:
            out.append(_empty_machine())
            continue
        try:
            if isinstance(sub, Intersect):
                dfa = (build_intersect or (lambda x: intersect_dfa(x, build)))(sub)
            else:
                dfa = build(sub)
        except GrammarError as e:
            if "matches nothing" not in str(e):
                raise
            out.append(_empty_machine())
            continue
        out.append(split_calls(dfa, len(subs), kind))
    prune(out, kind)
    return PushdownTables(out)
