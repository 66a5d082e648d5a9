"""Prompt-lookup proposer: the request's own history predicts its continuation.

Outputs that copy from their context (rewriting a JSON object, editing code, quoting a
document) repeat long runs of it. Match the last tokens of `fill_ids` (prompt + output)
against earlier positions and propose what followed there:

    fill_ids:  a b c d e f ........ x c d e      <- suffix "c d e" ends the history
                   ^^^^^ match ends at e (pos 4) -> propose f ...

The longest match wins (compared up to `max_window` tokens, at least `min_window`), the
most recent among equals. Per request, an index token -> positions (ascending) is kept and
extended as tokens arrive, so a step looks at no more than `MAX_CANDIDATES` recent
occurrences of the last token instead of scanning the history.
"""

from __future__ import annotations

from typing import Any, Sequence

MAX_CANDIDATES = 64  # most recent occurrences of the last token compared per step
RESYNC_WINDOW = 64  # a rewritten tail (jump-forward) is found by scanning back this far


class _History:
    """One request's tokens as indexed so far, and where each token occurs."""

    __slots__ = ("tokens", "where")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}

    def truncate(self, n: int) -> None:
        while len(self.tokens) > n:
            t = self.tokens.pop()
            self.where[t].pop()

    def sync(self, fill: Sequence[int]) -> None:
        """Make `tokens` equal `fill` (usually: append what is new)."""
        n = len(self.tokens)
        if n > len(fill) or (n and fill[n - 1] != self.tokens[-1]):
            keep = min(n, len(fill))
            lo = max(0, keep - RESYNC_WINDOW)
            while keep > lo and fill[keep - 1] != self.tokens[keep - 1]:
                keep -= 1
            if keep == lo and lo > 0:  # diverged further back than a tail rewrite: start over
                keep = 0
            self.truncate(keep)
            n = keep
        for i in range(n, len(fill)):
            t = fill[i]
            self.tokens.append(t)
            self.where.setdefault(t, []).append(i)


class NgramProposer:
    def __init__(self, min_window: int = 1, max_window: int = 12) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"speculative_ngram_min_match_window_size ({min_window}) must be >= 1 and <= "
                             f"speculative_ngram_max_match_window_size ({max_window})")
        self.min_window, self.max_window = min_window, max_window
        self._hist: dict[int, _History] = {}

    def propose(self, reqs: Sequence[Any], budgets: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = []
        for req, budget in zip(reqs, budgets):
            h = self._hist.get(req.uid)
            if h is None:
                h = self._hist[req.uid] = _History()
            h.sync(req.fill_ids)
            out.append(self._lookup(h.tokens, h.where, budget) if budget > 0 else [])
        return out

    def release(self, uid: int) -> None:
        self._hist.pop(uid, None)

    def _lookup(self, toks: list[int], where: dict[int, list[int]], budget: int) -> list[int]:
        n = len(toks)
        if n < 2:
            return []
        occ = where.get(toks[-1], [])
        best_len, best_end = 0, -1
        # occ[-1] is the last position itself; walk earlier occurrences, newest first.
        for j in range(len(occ) - 2, max(-1, len(occ) - 2 - MAX_CANDIDATES), -1):
            p = occ[j]
            m = 1
            while m < self.max_window and m <= p and toks[p - m] == toks[n - 1 - m]:
                m += 1
            if m > best_len:
                best_len, best_end = m, p
                if m == self.max_window:
                    break
        if best_len < self.min_window:
            return []
        return toks[best_end + 1 : best_end + 1 + budget]
