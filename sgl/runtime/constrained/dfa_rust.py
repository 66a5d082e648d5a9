"""Regex -> trimmed byte DFA through Rust's regex-automata (outlines-core): the fallback
builder for syntax the native one (native_dfa.py) leaves alone.

outlines-core is reached by indexing the regex against a tiny vocabulary of single bytes
and UTF-8 byte pairs (a few ms where the full 49k-token index takes seconds; the Rust
regex dialect: `\\p{..}`, `\\d` as any Unicode digit).

The Rust DFA keeps leftmost-first match semantics: once an alternative has matched, the
threads of lower-priority alternatives that would go on are dropped, so `(?:a|ab)`
never accepts "ab". We therefore build `(?:regex)` followed by an end marker (the
code point U+10FFFF, a noncharacter): no match can happen before the marker, so no
thread is dropped, and the states from which the marker leads to a match are the
accepting ones. The marker is then cut out by a small product with "no U+10FFFF in the
text" (`_cut_end_marker`), so a regex never matches U+10FFFF itself. A regex that
asserts the end of text (`$`) matches nothing with the marker after it; it is built
without one (leftmost-first semantics again).
"""

from __future__ import annotations

import numpy as np

from .base import GrammarError
from .byte_dfa import ByteDFA, trim

_EOS_ID = 256  # the byte vocabulary's EOS id, outside 0..255


def build_rust(regex: str, kind: str = "regex") -> ByteDFA:
    """Compile `regex` (full match) to a trimmed ByteDFA; GrammarError if unsupported."""
    try:
        return _cut_end_marker(_after_start_marker(_rust_dfa(START_MARKER + "(?:" + regex + ")" + END_MARKER, kind)))
    except GrammarError:
        # `$` before the marker can never hold; the plain build decides (its errors are
        # the regex's own).
        return _rust_dfa(regex, kind)


END_MARKER = "\\U0010ffff"
_END = (0xF4, 0x8F, 0xBF, 0xBF)  # U+10FFFF in UTF-8
# The Rust builder also determinizes an unanchored start (a match may begin anywhere),
# which for counted repeats that can restart mid-text (a string body after an escaped
# quote) grows exponentially. A leading code point the text never spells kills every
# restart: the build stays linear, and the DFA proper starts after the marker.
START_MARKER = "\\U0010fffe"
_START = (0xF4, 0x8F, 0xBF, 0xBE)


def _after_start_marker(dfa: ByteDFA) -> ByteDFA:
    s = dfa.initial
    for b in _START:
        s = int(dfa.trans[s, b]) if s >= 0 else -1
    if s < 0:
        raise GrammarError("regex: the start marker was not accepted")
    return ByteDFA(dfa.trans, dfa.accept, s)


def _cut_end_marker(dfa: ByteDFA) -> ByteDFA:
    """`dfa` was built from `(?:R)` + END_MARKER: return R's DFA. A state accepts iff
    the marker's bytes lead from it to an accepting state; the text may not spell
    U+10FFFF. The latter is a product with a 4-state automaton tracking how much of
    the marker the text has just spelled: copies (q, k) for k = 1..3 exist only for
    states reached right after F4, F4 8F, F4 8F BF, so the table grows by a few rows.
    """
    t, acc = dfa.trans, dfa.accept
    n = t.shape[0]

    def follow(states: np.ndarray, byte: int) -> np.ndarray:
        out = np.full(states.shape, -1, dtype=np.int64)
        ok = states >= 0
        out[ok] = t[states[ok], byte]
        return out

    s = np.arange(n, dtype=np.int64)
    for b in _END:
        s = follow(s, b)
    accept = np.zeros(n, dtype=bool)
    accept[s >= 0] = acc[s[s >= 0]]
    # copy k holds the states reached right after the marker's first k bytes
    copies, ids, base = [], [], n
    prev = np.arange(n, dtype=np.int64)
    for k in range(3):
        nxt = follow(prev, _END[k])
        c = np.unique(nxt[nxt >= 0])
        idk = np.full(n, -1, dtype=np.int64)
        idk[c] = base + np.arange(c.size)
        copies.append(c)
        ids.append(idk)
        base += c.size
        prev = c

    def remap(targets: np.ndarray, idk: np.ndarray) -> np.ndarray:
        return np.where(targets >= 0, idk[np.maximum(targets, 0)], -1)

    out = np.concatenate([t] + [t[c] for c in copies]).astype(np.int64)
    out[:, _END[0]] = remap(out[:, _END[0]], ids[0])  # F4 starts the marker anywhere
    lo = n
    for k, c in enumerate(copies):
        hi = lo + c.size
        byte = _END[k + 1]
        out[lo:hi, byte] = remap(t[c, byte], ids[k + 1]) if k < 2 else -1
        lo = hi
    accept = np.concatenate([accept, np.zeros(base - n, dtype=bool)])
    return trim(out.astype(np.int32), accept, dfa.initial)


# UTF-8 lead bytes that behave alike unless the regex names a code point inside their
# range: same sequence length, same continuation-byte ranges. Each class is probed
# through its first member only.
_LEAD_CLASSES = {0xC2: range(0xC2, 0xE0), 0xE0: [0xE0], 0xE1: range(0xE1, 0xED),
                 0xED: [0xED], 0xEE: [0xEE], 0xEF: [0xEF], 0xF0: [0xF0],
                 0xF1: range(0xF1, 0xF4), 0xF4: [0xF4]}
_ALL_LEADS = {lead: [lead] for lead in range(0xC2, 0xF5)}
# Code points whose lead byte is a class of its own: a regex may name these (the
# converter's complement classes end at U+D7FF, restart at U+E000, end at U+10FFFF)
# without splitting a multi-lead class.
_SINGLE_LEAD_CPS = ((0x800, 0xFFF), (0xD000, 0xFFFF), (0x10000, 0x3FFFF), (0x100000, 0x10FFFF))
# Escapes that classify code points (Unicode-aware in Rust's regex).
_CLASS_ESCAPES = set("pPwWdDsSbB")
_HEX = set("0123456789abcdefABCDEF")


def ascii_uniform(regex: str) -> bool:
    """True when `regex` treats every multi-lead class of `_LEAD_CLASSES` uniformly:
    ASCII text, every escaped code point >= 0x80 inside a single-lead range, no
    classifying escape, no inline flags (Unicode case folding maps ASCII letters to
    e.g. U+212A). Then every range or literal covers a multi-lead class wholly or not
    at all. Conservative: False may be wrong, True never is."""
    if not regex.isascii() or "(?" in regex.replace("(?:", ""):
        return False
    i, n = 0, len(regex)
    while i < n:
        if regex[i] != "\\" or i + 1 >= n:
            i += 1
            continue
        c = regex[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(c)
        if width is not None:
            hx = regex[i + 2:i + 2 + width]
            if len(hx) < width or not set(hx) <= _HEX:
                return False
            cp = int(hx, 16)
            if cp >= 0x80 and not any(lo <= cp <= hi for lo, hi in _SINGLE_LEAD_CPS):
                return False
            i += 2 + width
            continue
        if c in _CLASS_ESCAPES:
            return False
        i += 2
    return True


def _byte_vocabulary(leads: dict[int, object], uniform: frozenset[int] = frozenset()
                     ) -> tuple[object, list[tuple[int, int]]]:
    """The probe vocabulary: every byte that can be a whole character or continue one
    (0x00..0xBF), plus (UTF-8 lead, continuation) pairs for the probed `leads`.
    outlines-core never indexes a lone lead byte (0xC2..0xF4) as a token, so the state
    after a lead byte is rebuilt from the pairs' targets (see `_rust_dfa`). Its
    indexing cost is per state times per token, so probing 9 lead classes instead of
    51 leads cuts it ~4x, and a `uniform` lead (every code point it starts is treated
    alike) is probed with one continuation byte instead of 64. Returns the
    vocabulary and the (lead, continuation) of each pair token, in token-id order."""
    from outlines_core import Vocabulary

    toks: dict[bytes, list[int]] = {bytes([b]): [b] for b in range(0xC0)}
    pairs: list[tuple[int, int]] = []
    for lead in leads:
        for cont in ([0x80] if lead in uniform else range(0x80, 0xC0)):
            toks[bytes([lead, cont])] = [_EOS_ID + 1 + len(pairs)]
            pairs.append((lead, cont))
    return Vocabulary(_EOS_ID, toks), pairs


# Multi-lead classes whose code points an ascii_uniform regex cannot tell apart at all
# (no escape may name a code point inside them): the continuation byte never matters.
_UNIFORM = frozenset({0xC2, 0xE1, 0xF1})


def _rust_dfa(regex: str, kind: str) -> ByteDFA:
    from outlines_core import Index

    uniform = ascii_uniform(regex)
    leads = _LEAD_CLASSES if uniform else _ALL_LEADS
    vocab, pairs = _byte_vocabulary(leads, _UNIFORM if uniform else frozenset())
    try:
        index = Index(regex, vocab)
    except Exception as e:  # regex syntax errors, DFA size limits
        raise GrammarError(f"{kind}: cannot compile regex ({e})") from None
    table = index.get_transitions()
    finals = np.fromiter(index.get_final_states(), dtype=np.int64)
    # Flatten {state: {token: state}} into edge arrays, then rename states densely.
    srcs, toks, dsts = [], [], []
    for q, out in table.items():
        t = np.fromiter(out.keys(), dtype=np.int64, count=len(out))
        srcs.append(np.full(t.size, q, dtype=np.int64))
        toks.append(t)
        dsts.append(np.fromiter(out.values(), dtype=np.int64, count=len(out)))
    src = np.concatenate(srcs) if srcs else np.zeros(0, np.int64)
    tok = np.concatenate(toks) if toks else np.zeros(0, np.int64)
    dst = np.concatenate(dsts) if dsts else np.zeros(0, np.int64)
    keep = tok != _EOS_ID
    src, tok, dst = src[keep], tok[keep], dst[keep]
    ids = np.unique(np.concatenate([src, dst, finals, [index.get_initial_state()]]))
    src, dst = np.searchsorted(ids, src), np.searchsorted(ids, dst)
    n = ids.size
    single = tok < 256
    # State after lead byte L from q: defined by its row cont -> target(q, L cont);
    # identical rows are one state.
    p = tok[~single] - (_EOS_ID + 1)
    pair_arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    psrc, lead, cont, pdst = src[~single], pair_arr[p, 0], pair_arr[p, 1] - 0x80, dst[~single]
    groups, gi = np.unique(psrc * 256 + lead, return_inverse=True)
    rows = np.full((groups.size, 64), -1, dtype=np.int64)
    rows[gi, cont] = pdst
    if uniform:  # a uniform lead was probed with continuation 0x80 only: all alike
        same = np.isin(groups % 256, list(_UNIFORM))
        rows[same] = rows[same, :1]
    mids, mi = np.unique(rows, axis=0, return_inverse=True) if groups.size else (rows, np.zeros(0, np.int64))
    trans = np.full((n + len(mids), 256), -1, dtype=np.int32)
    trans[src[single], tok[single]] = dst[single]
    trans[groups // 256, groups % 256] = n + mi.reshape(-1)
    for rep, members in leads.items():  # class members share the probed lead's row
        for m in members:
            if m != rep:
                trans[:n, m] = trans[:n, rep]
    trans[n:, 0x80:0xC0] = mids
    accept = np.zeros(n + len(mids), dtype=bool)
    accept[np.searchsorted(ids, finals)] = True
    return trim(trans, accept, int(np.searchsorted(ids, index.get_initial_state())))
