"""Regex-family grammars on numpy: the backend where no C compiler builds the native engine.

Compiling is regex -> trimmed byte-level DFA only (dfa_build.py). A state's mask is
computed the first time a request stands in it: every token's bytes are walked at once
with numpy (`VocabWalker`), a token is allowed iff it is still alive after its last
byte (the DFA is trimmed, so alive = a match is still reachable), and EOS iff the state
accepts. Masks are cached per state (bit-packed, LRU bounded) in `CompiledLazyRegex`,
shared by all matchers; `LazyRegexGrammar` is one request's position (a stack of
states, so rollback is a pop). Same interface as the native engine's grammars
(native/compiled.py), which the registry uses wherever the C library builds.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..lru import LRU
from .base import GrammarError
from .state_stack import TERMINATED, StateStackGrammar
from .byte_dfa import ByteDFA
from .masks import or_into
from .vocab import TokenizerInfo

_MAX_FORCED_BYTES = 1024
_MASK_CACHE_STATES = 2048  # packed masks: ~6 KB each at a 49k vocabulary


class VocabWalker:
    """The vocabulary as a padded byte table, longest tokens first, walked in parallel.

    Because rows are sorted by length, the rows still inside their token at byte k are
    a prefix [0, ends[k]); the walk keeps an index of rows alive so far and trims it
    to that prefix at each step, so its cost falls with the surviving set.
    """

    def __init__(self, tok: TokenizerInfo) -> None:
        ids, lens, mat = tok.byte_table()
        self.ids, self.lens, self.mat = ids, lens, mat
        width = mat.shape[1]
        self.ends = np.array([int((lens > k).sum()) for k in range(width)], dtype=np.int64)
        self.first = np.ascontiguousarray(mat[:, 0])
        self.vocab_size = tok.vocab_size

    @staticmethod
    def of(tok: TokenizerInfo) -> "VocabWalker":
        return tok.memo("lazy_walker", lambda: VocabWalker(tok))

    def allowed(self, trans: np.ndarray, state: int) -> np.ndarray:
        """Bool [vocab_size]: tokens whose bytes all have live transitions from `state`."""
        out = np.zeros(self.vocab_size, dtype=bool)
        nxt = trans[state][self.first]
        act = np.nonzero(nxt >= 0)[0]
        st = nxt[act]
        k = 1
        while act.size and k < self.ends.size:
            # Rows past ends[k] ended at byte k, all alive: allowed. Walk the rest on.
            cut = int(np.searchsorted(act, self.ends[k]))
            out[self.ids[act[cut:]]] = True
            act, st = act[:cut], st[:cut]
            st = trans[st, self.mat[act, k]]
            good = st >= 0
            act, st = act[good], st[good]
            k += 1
        out[self.ids[act]] = True
        return out


class CompiledLazyRegex:
    """A byte DFA plus lazily filled per-state caches (thread-safe), shared by matchers."""

    def __init__(self, dfa: ByteDFA, tok: TokenizerInfo, kind: str = "regex") -> None:
        self.dfa = dfa
        self.tok = tok
        self.kind = kind
        self.initial = int(dfa.initial)
        self.trans = dfa.trans
        self.accept = dfa.accept
        live = dfa.trans >= 0
        self._outdeg = live.sum(axis=1)
        self._only_byte = live.argmax(axis=1)  # meaningful where outdeg == 1
        self._eos = np.array(tok.eos_token_ids, dtype=np.int64)
        self._eos_set = frozenset(tok.eos_token_ids)
        self._masks: LRU[int, np.ndarray] = LRU(_MASK_CACHE_STATES)
        self._forced: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self.mask_computes = 0

    @property
    def num_states(self) -> int:
        return int(self.accept.size)

    num_machines = 1

    def new_matcher(self) -> "LazyRegexGrammar":
        return LazyRegexGrammar(self)

    # -- masks ----------------------------------------------------------------------
    def token_mask(self, state: int) -> np.ndarray:
        """Bool [vocab_size] of allowed non-EOS tokens from `state` (cached, packed)."""
        packed = self._masks.get(state)
        if packed is None:
            m = VocabWalker.of(self.tok).allowed(self.trans, state)
            with self._lock:
                self.mask_computes += 1
            self._masks.put(state, np.packbits(m))
            return m
        return np.unpackbits(packed, count=self.tok.vocab_size).view(bool)

    def mask(self, state: int) -> np.ndarray:
        """Bool [vocab_size]: allowed tokens, EOS included where `state` accepts."""
        m = self.token_mask(state)
        if self.accept[state]:
            m = m.copy()
            m[self._eos] = True
        return m

    def allowed_ids(self, state: int) -> torch.Tensor:
        """Allowed token ids (EOS included in accepting states), like CompiledRegex's."""
        return torch.from_numpy(np.nonzero(self.mask(state))[0].astype(np.int64))

    # -- stepping -------------------------------------------------------------------
    def step_bytes(self, state: int, data: bytes) -> int | None:
        trans = self.trans
        s = state
        for b in data:
            s = int(trans[s, b])
            if s < 0:
                return None
        return s

    def next_state(self, state: int, token_id: int) -> int | None:
        if token_id in self._eos_set:
            return TERMINATED if self.accept[state] else None
        if token_id < 0 or token_id >= self.tok.vocab_size:
            return None
        data = self.tok.token_bytes[token_id]
        return self.step_bytes(state, data) if data else None

    def forced_bytes(self, state: int) -> bytes:
        """Bytes every continuation from `state` starts with: follow the unique live
        out-byte while the state does not accept (accepting = EOS is an alternative)."""
        got = self._forced.get(state)
        if got is not None:
            return got
        out = bytearray()
        s = state
        while not self.accept[s] and self._outdeg[s] == 1 and len(out) < _MAX_FORCED_BYTES:
            b = int(self._only_byte[s])
            out.append(b)
            s = int(self.trans[s, b])
        res = bytes(out)
        with self._lock:
            self._forced[state] = res
        return res


class LazyRegexGrammar(StateStackGrammar):
    """One request's position in a lazily masked regex (implements the Grammar protocol)."""

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        c = self.compiled
        if self.state == TERMINATED:
            mask_row[list(c.tok.eos_token_ids)] = True
            return
        or_into(mask_row, c.token_mask(self.state))
        if c.accept[self.state]:
            mask_row[list(c.tok.eos_token_ids)] = True

    def accept_bytes(self, data: bytes) -> None:
        """Advance by raw bytes; one rollback step in all."""
        nxt = None if self.state == TERMINATED else self.compiled.step_bytes(self.state, data)
        if nxt is None:
            raise GrammarError(f"{self.compiled.kind}: text not allowed here")
        self.states.append(nxt)

    def is_terminated(self) -> bool:
        s = self.state
        if s == TERMINATED:
            return True
        c = self.compiled
        # No live out-byte means no token either; otherwise ask the (cached) mask,
        # since the vocabulary may lack every byte sequence the DFA still allows.
        return bool(c.accept[s]) and (c._outdeg[s] == 0 or not c.token_mask(s).any())

    def can_end(self) -> bool:
        return self.state == TERMINATED or bool(self.compiled.accept[self.state])
