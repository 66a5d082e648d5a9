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
completion exists" for the matcher. Only machines on call cycles and intersections can
have an empty language (see `build_tables`), so those are built with the root and every
other machine is built when the matcher first enters it: a schema with a hundred
sub-objects compiles in the time of its root, and an instance pays for what it uses.
An Intersect sub is the product of its parts' DFAs (dfa_ops.intersect).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .base import GrammarError
from .byte_dfa import ByteDFA
from .byte_dfa import coreachable
from .json_schema.machines import _MARKER, Intersect, Sub, sub_texts
from .json_schema._regex import RESERVED_BASE

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


class PushdownTables:
    """Machine 0 is the root; a call names a machine by its index here.

    `machines[i]` may be built on first access (`build_tables`): a schema with a
    hundred sub-objects compiles its root at once and each sub-machine's DFA when a
    walk or a configuration first enters it. Thread-safe."""

    def __init__(self, machines: list[Machine | None],
                 build: Callable[[int], Machine] | None = None) -> None:
        self._machines = machines
        self._build = build
        self._lock = threading.Lock()

    @property
    def machines(self) -> "PushdownTables":
        return self  # indexable like the list it replaces

    def __len__(self) -> int:
        return len(self._machines)

    def __getitem__(self, i: int) -> Machine:
        m = self._machines[i]
        if m is None:
            with self._lock:
                m = self._machines[i]
                if m is None:
                    assert self._build is not None
                    m = self._machines[i] = self._build(i)
        return m

    def built(self) -> list[Machine]:
        return [m for m in self._machines if m is not None]

    @property
    def num_states(self) -> int:
        """States of the machines built so far."""
        return sum(m.num_states for m in self.built())


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


def prune(machines: list[Machine | None], kind: str, root: bool = True,
          empty: frozenset[int] = frozenset()) -> list[bool]:
    """Least-fixpoint productivity over the built machines; cut what cannot complete.
    A None entry (not built yet) is assumed nonempty unless listed in `empty`.
    Returns nonempty per machine."""
    idx = [i for i, m in enumerate(machines) if m is not None]
    live = {i: coreachable(machines[i].trans, machines[i].accept) for i in idx}

    def nonempty(j: int) -> bool:
        lv = live.get(j)
        if lv is None:
            return j not in empty
        return bool(lv.size and lv[0])

    while True:
        changed = False
        for i in idx:
            m = machines[i]
            goal = m.accept.copy()
            for s, cs in m.calls.items():
                if any(nonempty(j) and live[i][r] for j, r in cs):
                    goal[s] = True
            new = coreachable(m.trans, goal)
            if (new != live[i]).any():
                live[i], changed = new, True
        if not changed:
            break
    if root and not nonempty(0):
        raise GrammarError(f"{kind}: the schema accepts no instance")
    for i in idx:
        m, lv = machines[i], live[i]
        t = m.trans
        m.trans = np.where((t >= 0) & lv[np.maximum(t, 0)], t, -1).astype(np.int32)
        kept: dict[int, tuple[tuple[int, int], ...]] = {}
        for s, cs in m.calls.items():
            ok = tuple((j, r) for j, r in cs if lv[s] and nonempty(j) and lv[r])
            if ok:
                kept[s] = ok
        m.calls = kept
        m.has_call = np.zeros(m.num_states, dtype=bool)
        m.has_call[list(kept)] = True
        if i and nonempty(i) and m.accept[0]:
            # A value is never empty; an empty match would let calls loop in place.
            raise GrammarError(f"{kind}: sub-machine {i} matches the empty string")
    return [nonempty(j) for j in range(len(machines))]


def intersect_dfa(sub: Intersect, build: Callable[[str], ByteDFA]) -> ByteDFA:
    """The product DFA of an Intersect sub: the trimmed product of the parts' DFAs
    (dfa_ops.intersect; each part's DFA has full-match semantics, see dfa_build).
    GrammarError "matches nothing" when the intersection is empty."""
    from .dfa_ops import intersect

    return intersect([build(p) for p in sub.parts])


def _empty_machine() -> Machine:
    empty = np.full((1, 256), -1, dtype=np.int32)
    return Machine(empty, np.zeros(1, dtype=bool), {}, np.zeros(1, dtype=bool))


def _callees(sub: Sub) -> set[int]:
    """Machine indexes (sub id + 1) that `sub`'s text calls."""
    return {int(hx, 16) - RESERVED_BASE + 1 for t in sub_texts(sub) for hx in _MARKER.findall(t)}


def _on_cycles(graph: list[set[int]]) -> set[int]:
    """Machines that can reach themselves through calls (recursive $refs, free-form)."""
    out: set[int] = set()
    for i in range(len(graph)):
        seen, todo = set(), list(graph[i])
        while todo:
            j = todo.pop()
            if j == i:
                out.add(i)
                break
            if j not in seen and j < len(graph):
                seen.add(j)
                todo.extend(graph[j])
    return out


def build_tables(root: str, subs: list[Sub], build: Callable[[str], ByteDFA],
                 kind: str = "json_schema",
                 build_intersect: Callable[[Intersect], ByteDFA] | None = None,
                 lazy: bool = True) -> PushdownTables:
    """Machine DFAs from `build(regex)` (the lazy backend's cached builder) and, for an
    Intersect sub, `build_intersect(sub)` (default: `intersect_dfa(sub, build)`).

    Which machines can be empty decides liveness (prune). A regex machine off every
    call cycle whose callees are nonempty is nonempty (the converter never emits a
    regex that matches nothing; such branches are NEVER), so by induction only
    machines on cycles and intersections can be empty. Those are built at once with
    the root (`lazy`), and if they are all nonempty, every other machine is built on
    first use, pruned alone with every callee nonempty; otherwise (a recursion without
    a base case, an empty intersection) all are built and pruned together."""
    specs: list[Sub] = [root] + list(subs)

    def make(i: int) -> Machine:
        sub = specs[i]
        if sub is None:
            return _empty_machine()
        try:
            if isinstance(sub, Intersect):
                dfa = (build_intersect or (lambda x: intersect_dfa(x, build)))(sub)
            else:
                dfa = build(sub)
        except GrammarError as e:
            if "matches nothing" not in str(e):
                raise
            return _empty_machine()
        return split_calls(dfa, len(subs), kind)

    n = len(specs)
    if lazy:
        # An intersection may be empty whatever the converter does: built at once too.
        first = _on_cycles([_callees(sp) for sp in specs]) | {
            i for i, sp in enumerate(specs) if isinstance(sp, Intersect)}
        eager: list[Machine | None] = [make(i) if i == 0 or i in first or specs[i] is None
                                       else None for i in range(n)]
        nonempty = prune(eager, kind)
        if all(nonempty[i] for i in first):
            dead = frozenset(i for i in range(n) if specs[i] is None)

            def build_one(i: int) -> Machine:
                m = make(i)
                view: list[Machine | None] = [None] * n
                view[i] = m
                prune(view, kind, root=False, empty=dead)
                return m

            return PushdownTables(eager, build_one)
        out: list[Machine | None] = [m if m is not None else make(i) for i, m in enumerate(eager)]
    else:
        out = [make(i) for i in range(n)]
    prune(out, kind)
    return PushdownTables(out)
