"""ByteDFA, the table every regex builder produces, its trim, and the interegular builder.

`trim` keeps the states reachable from the start that can still reach acceptance, so
"alive after a byte" means "a match is still reachable" for every matcher.

The interegular builder (regex -> dense byte-level DFA, for walking token bytes through
lexer terminals):

interegular gives a character-level FSM whose alphabet has an `anything_else` class.
Tokens are bytes and may split a UTF-8 character, so we expand it to bytes: a byte
state is (char state, pending bytes of an unfinished character). Pending bytes are kept
exactly while they could still spell a character the regex names explicitly; otherwise
only the count of continuation bytes still due is kept, because such a character can
only fall in `anything_else`. The result is a numpy table [states, 256] with -1 for
dead, trimmed so that every non-dead state can still reach an accepting one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import GrammarError


def _utf8_len(lead: int) -> int:
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0  # continuation byte or invalid lead


@dataclass
class ByteDFA:
    trans: np.ndarray  # int32 [S, 256], -1 = dead
    accept: np.ndarray  # bool [S]
    initial: int

    def live_out(self, state: int) -> np.ndarray:
        """Bytes with a live transition from `state`."""
        return np.nonzero(self.trans[state] >= 0)[0]

    def well_formed(self) -> bool:
        """Shapes and targets a table must have. A DFA read back from the disk cache is
        checked: a foreign or damaged pickle costs a rebuild, not an IndexError in every
        request that uses it (or a read out of bounds in the C engine)."""
        t, a, initial = (getattr(self, k, None) for k in ("trans", "accept", "initial"))  # old pickles may lack one
        if not isinstance(t, np.ndarray) or not isinstance(a, np.ndarray) or t.ndim != 2 or t.shape[1] != 256:
            return False
        n = t.shape[0]
        if a.shape != (n,) or not np.issubdtype(t.dtype, np.integer) or not isinstance(initial, (int, np.integer)):
            return False
        return 0 <= initial < n and bool(((t >= -1) & (t < n)).all())


def regex_to_byte_dfa(regex: str) -> ByteDFA:
    """Compile `regex` (Python syntax, interegular subset); raises ValueError if unsupported."""
    import interegular

    try:
        fsm = interegular.parse_pattern(regex).to_fsm()
    except Exception as e:  # interegular raises its own types for lookarounds etc.
        raise ValueError(f"unsupported regex {regex!r}: {type(e).__name__}: {e}") from None
    return fsm_to_byte_dfa(fsm)


def fsm_to_byte_dfa(fsm: Any) -> ByteDFA:
    from interegular.fsm import anything_else

    mapping = fsm.alphabet._symbol_mapping
    other = mapping.get(anything_else)
    ascii_sym = [mapping.get(chr(b), other) for b in range(128)]
    wide = {c.encode("utf-8"): sym for c, sym in mapping.items()
            if c is not anything_else and ord(c) >= 128}
    prefixes = {w[:i] for w in wide for i in range(1, len(w))}
    fmap = fsm.map
    finals = fsm.finals

    def char_step(q: Any, sym: Any) -> Any:
        return None if sym is None else fmap.get(q, {}).get(sym)

    def step(key: tuple[Any, Any], b: int) -> tuple[Any, Any] | None:
        q, pend = key
        if pend == ():
            n = _utf8_len(b)
            if n == 1:
                q2 = char_step(q, ascii_sym[b])
                return None if q2 is None else (q2, ())
            if n == 0:
                return None
            p = bytes([b])
            return (q, p) if p in prefixes else (q, n - 1)
        if not 0x80 <= b <= 0xBF:
            return None
        if isinstance(pend, int):  # generic: only anything_else can complete it
            if pend > 1:
                return (q, pend - 1)
            q2 = char_step(q, other)
            return None if q2 is None else (q2, ())
        p = pend + bytes([b])
        need = _utf8_len(p[0])
        if len(p) == need:
            q2 = char_step(q, wide.get(p, other))
            return None if q2 is None else (q2, ())
        return (q, p) if p in prefixes else (q, need - len(p))

    start = (fsm.initial, ())
    index: dict[tuple[Any, Any], int] = {start: 0}
    order = [start]
    edges: list[list[tuple[int, int]]] = []
    todo = deque([start])
    while todo:
        key = todo.popleft()
        out: list[tuple[int, int]] = []
        for b in range(256):
            nk = step(key, b)
            if nk is None:
                continue
            j = index.get(nk)
            if j is None:
                j = index[nk] = len(order)
                order.append(nk)
                todo.append(nk)
            out.append((b, j))
        edges.append(out)
    n = len(order)
    accept = np.array([k[1] == () and k[0] in finals for k in order], dtype=bool)
    # Live = can reach an accepting state; walk the reversed edges from accepting ones.
    rev: list[list[int]] = [[] for _ in range(n)]
    for i, out in enumerate(edges):
        for _, j in out:
            rev[j].append(i)
    live = accept.copy()
    todo2 = deque(np.nonzero(accept)[0].tolist())
    while todo2:
        j = todo2.popleft()
        for i in rev[j]:
            if not live[i]:
                live[i] = True
                todo2.append(i)
    trans = np.full((n, 256), -1, dtype=np.int32)
    for i, out in enumerate(edges):
        if live[i]:
            for b, j in out:
                if live[j]:
                    trans[i, b] = j
    return ByteDFA(trans, accept, 0)


def trim(trans: np.ndarray, accept: np.ndarray, initial: int) -> ByteDFA:
    """Keep states reachable from `initial` that can reach acceptance; start becomes 0."""
    n = trans.shape[0]
    live = coreachable(trans, accept)
    if not live[initial]:
        raise GrammarError("regex: matches nothing")
    t = np.where((trans >= 0) & live[np.maximum(trans, 0)], trans, -1)
    # Reachable from the start, numbered in breadth-first order (the start is 0).
    new = np.full(n, -1, dtype=np.int64)
    new[initial] = 0
    seen = [np.array([initial])]
    count = 1
    frontier = seen[0]
    while frontier.size:
        nxt = t[frontier]
        nxt = nxt[nxt >= 0]
        _, first = np.unique(nxt, return_index=True)
        nxt = nxt[np.sort(first)]  # first-seen order, deterministic
        nxt = nxt[new[nxt] < 0]
        new[nxt] = np.arange(count, count + nxt.size)
        count += nxt.size
        seen.append(nxt)
        frontier = nxt
    keep = np.concatenate(seen)
    sub = t[keep]
    out = np.where(sub >= 0, new[np.maximum(sub, 0)], -1).astype(np.int32)
    return ByteDFA(out, accept[keep].copy(), 0)


def coreachable(trans: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """Bool [S]: states from which some byte path reaches a `goal` state."""
    n = trans.shape[0]
    src, byte = np.nonzero(trans >= 0)
    dst = trans[src, byte].astype(np.int64)
    # Frontier by frontier over reversed edges from the goal states.
    live = goal.copy()
    frontier = np.nonzero(goal)[0]
    order = np.argsort(dst, kind="stable")
    rsrc, starts = src[order], np.searchsorted(dst[order], np.arange(n + 1))
    while frontier.size:
        lo, hi = starts[frontier], starts[frontier + 1]
        preds = rsrc[_ranges(lo, hi)]
        preds = np.unique(preds[~live[preds]])
        live[preds] = True
        frontier = preds
    return live


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Concatenation of arange(lo[i], hi[i]) for all i, without a Python loop."""
    lens = hi - lo
    if not lens.sum():
        return np.zeros(0, dtype=np.int64)
    base = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return np.arange(int(lens.sum())) + np.repeat(lo - base, lens)
