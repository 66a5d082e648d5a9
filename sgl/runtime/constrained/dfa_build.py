"""Regex -> trimmed byte-level DFA, the only compile step of the lazy regex backend.

Two DFA sources produce the same `ByteDFA` (byte_dfa.py): by default Rust's
regex-automata, reached through outlines-core by indexing the regex against a tiny
vocabulary of single bytes and UTF-8 byte pairs (a few ms where the full 49k-token index takes
seconds, and the same Rust regex dialect the outlines backend speaks: `\\p{..}`, `\\d`
as any Unicode digit); or interegular via `regex_to_byte_dfa` (pure Python, 100-1000x
slower on generated JSON Schema regexes, no Unicode classes), picked with
`SGL_LAZY_DFA=interegular`. Either way the result is trimmed: only states reachable
from the start that can still reach an accepting state survive, renumbered densely
with the start at 0, so "alive after a token's last byte" means "allowed".
"""

from __future__ import annotations

import os
from collections import deque

import numpy as np

from .base import GrammarError
from .byte_dfa import ByteDFA, regex_to_byte_dfa

# Part of the disk-cache key: bump when the DFA a regex maps to may change.
DFA_VERSION = "lazy-dfa-1"
_EOS_ID = 256  # the byte vocabulary's EOS id, outside 0..255


def dfa_engine() -> str:
    return os.environ.get("SGL_LAZY_DFA", "rust").lower()


def build_byte_dfa(regex: str, kind: str = "regex", engine: str | None = None) -> ByteDFA:
    """Compile `regex` (full match) to a trimmed ByteDFA; GrammarError if unsupported."""
    engine = engine or dfa_engine()
    if engine == "interegular":
        try:
            dfa = regex_to_byte_dfa(regex)
        except ValueError as e:
            raise GrammarError(f"{kind}: cannot compile regex ({e})") from None
        return trim(dfa.trans, dfa.accept, dfa.initial)
    return _rust_dfa(regex, kind)


def _byte_vocabulary() -> tuple[object, dict[int, tuple[int, int]]]:
    """The probe vocabulary: every single byte, plus every (UTF-8 lead, continuation)
    pair. outlines-core never indexes a lone lead byte (0xC2..0xF4) as a token, so the
    state after a lead byte is rebuilt from the pairs' targets (see `_rust_dfa`)."""
    from outlines_core import Vocabulary

    toks: dict[bytes, list[int]] = {bytes([b]): [b] for b in range(256)}
    pairs: dict[int, tuple[int, int]] = {}
    for lead in range(0xC2, 0xF5):
        for cont in range(0x80, 0xC0):
            tid = _EOS_ID + 1 + len(pairs)
            pairs[tid] = (lead, cont)
            toks[bytes([lead, cont])] = [tid]
    return Vocabulary(_EOS_ID, toks), pairs


def _rust_dfa(regex: str, kind: str) -> ByteDFA:
    from outlines_core import Index

    vocab, pairs = _byte_vocabulary()
    try:
        index = Index(regex, vocab)
    except Exception as e:  # regex syntax errors, DFA size limits
        raise GrammarError(f"{kind}: cannot compile regex ({e})") from None
    table = index.get_transitions()
    finals = set(index.get_final_states())
    names = {index.get_initial_state(): 0}
    for q in list(table) + sorted(finals):
        names.setdefault(q, len(names))
    for out in table.values():
        for q in out.values():
            names.setdefault(q, len(names))
    rows: list[np.ndarray] = []
    # State after a lead byte L from q: defined by its continuation row C -> target(q, LC);
    # identical rows are one state.
    mids: dict[tuple[tuple[int, int], ...], int] = {}
    edges: list[tuple[int, int, int]] = []
    for q, out in table.items():
        by_lead: dict[int, list[tuple[int, int]]] = {}
        for t, q2 in out.items():
            if t < _EOS_ID:
                edges.append((names[q], t, names[q2]))
            elif t > _EOS_ID:
                lead, cont = pairs[t]
                by_lead.setdefault(lead, []).append((cont, names[q2]))
        for lead, row in by_lead.items():
            key = tuple(sorted(row))
            m = mids.get(key)
            if m is None:
                m = mids[key] = len(names) + len(mids)
                rows.append(np.array(key, dtype=np.int64))
            edges.append((names[q], lead, m))
    n = len(names) + len(mids)
    trans = np.full((n, 256), -1, dtype=np.int32)
    if edges:
        e = np.array(edges, dtype=np.int64)
        trans[e[:, 0], e[:, 1]] = e[:, 2]
    for i, row in enumerate(rows):
        trans[len(names) + i, row[:, 0]] = row[:, 1]
    accept = np.zeros(n, dtype=bool)
    accept[[names[q] for q in finals]] = True
    return trim(trans, accept, 0)


def trim(trans: np.ndarray, accept: np.ndarray, initial: int) -> ByteDFA:
    """Keep states reachable from `initial` that can reach acceptance; start becomes 0."""
    n = trans.shape[0]
    src, byte = np.nonzero(trans >= 0)
    dst = trans[src, byte]
    # Co-reachable: breadth-first over reversed edges from the accepting states.
    order = np.argsort(dst, kind="stable")
    rsrc, starts = src[order], np.searchsorted(dst[order], np.arange(n + 1))
    live = accept.copy()
    todo = deque(np.nonzero(accept)[0].tolist())
    while todo:
        j = todo.popleft()
        for i in rsrc[starts[j]:starts[j + 1]].tolist():
            if not live[i]:
                live[i] = True
                todo.append(i)
    if not live[initial]:
        raise GrammarError("regex: matches nothing")
    t = np.where((trans >= 0) & live[np.maximum(trans, 0)], trans, -1)
    # Reachable from the start, in breadth-first order (so the start is state 0).
    new = np.full(n, -1, dtype=np.int64)
    new[initial] = 0
    seen = [initial]
    k = 0
    while k < len(seen):
        for j in np.unique(t[seen[k]][t[seen[k]] >= 0]).tolist():
            if new[j] < 0:
                new[j] = len(seen)
                seen.append(j)
        k += 1
    keep = np.array(seen, dtype=np.int64)
    sub = t[keep]
    out = np.where(sub >= 0, new[np.maximum(sub, 0)], -1).astype(np.int32)
    return ByteDFA(out, accept[keep].copy(), 0)
