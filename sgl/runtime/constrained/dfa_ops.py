"""Operations on trimmed byte DFAs (byte_dfa.ByteDFA): intersection, and dropping the empty match.

A JSON value that must match several regexes at once (a string with a pattern and a
length bound, or a pattern and a format) cannot be spelled as one regex without
blowing up, but the product of the parts' DFAs is cheap when only the reachable pairs
of states are built. Parts are multiplied two at a time (a pair fits one int64 key);
each product is trimmed like every DFA we build (byte_dfa.trim: reachable from the
start, co-reachable to acceptance, start at 0), so "alive" keeps meaning "a match is
still reachable", and the next product starts from the smallest possible table.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .base import GrammarError
from .byte_dfa import ByteDFA
from .byte_dfa import trim


def intersect(dfas: Sequence[ByteDFA]) -> ByteDFA:
    """Trimmed DFA accepting exactly the byte strings every DFA in `dfas` accepts.

    Raises GrammarError ("matches nothing") when the intersection is empty."""
    if not dfas:
        raise ValueError("intersect: no DFAs")
    # Smallest first: every intermediate product is at most as large as its inputs'
    # reachable pairs, and small tables make the per-frontier gathers cheap.
    parts = sorted(dfas, key=lambda d: int(d.trans.shape[0]))
    out = trim(parts[0].trans, parts[0].accept, int(parts[0].initial))
    for other in parts[1:]:
        out = _product(out, other)
    return out


def _product(a: ByteDFA, b: ByteDFA) -> ByteDFA:
    """Trimmed product of `a` and `b` over the pairs reachable from the start pair.

    Breadth-first, one frontier at a time: the 256 successors of every frontier pair
    are gathered at once with numpy; only the distinct new pairs of a frontier go
    through a Python dict (key qa * nb + qb -> dense id, in discovery order), so the
    Python work is per product state, not per byte.
    """
    nb = int(b.trans.shape[0])
    start = int(a.initial) * nb + int(b.initial)
    ids: dict[int, int] = {start: 0}
    keys_in_order = [start]
    rows: list[np.ndarray] = []
    frontier = np.array([start], dtype=np.int64)
    while frontier.size:
        ta = a.trans[frontier // nb].astype(np.int64)
        tb = b.trans[frontier % nb].astype(np.int64)
        nxt = np.where((ta >= 0) & (tb >= 0), ta * nb + tb, -1)
        uniq, inv = np.unique(nxt, return_inverse=True)
        mapped = np.empty(uniq.size, dtype=np.int64)
        fresh: list[int] = []
        for j, k in enumerate(uniq.tolist()):
            if k < 0:
                mapped[j] = -1
                continue
            i = ids.get(k)
            if i is None:
                i = ids[k] = len(keys_in_order)
                keys_in_order.append(k)
                fresh.append(k)
            mapped[j] = i
        rows.append(mapped[inv.reshape(nxt.shape)].astype(np.int32))
        # New pairs were numbered in order, so rows stay in id order frontier by frontier.
        frontier = np.array(fresh, dtype=np.int64)
    trans = np.concatenate(rows)
    keys = np.array(keys_in_order, dtype=np.int64)
    accept = a.accept[keys // nb] & b.accept[keys % nb]
    if not accept.any():
        raise GrammarError("regex: matches nothing")
    return trim(trans, accept, 0)


def drop_empty(dfa: ByteDFA) -> ByteDFA:
    """The same DFA without the empty match: a non-accepting start state, with a copy
    of the old start (accepting) taking every transition that led back to it."""
    if not dfa.accept[dfa.initial]:
        return dfa
    assert dfa.initial == 0
    trans = np.vstack([dfa.trans, dfa.trans[0:1]]).astype(np.int32)
    new = trans.shape[0] - 1
    trans[trans == 0] = new
    accept = np.append(dfa.accept, True)
    accept[0] = False
    return ByteDFA(trans, accept, 0)
