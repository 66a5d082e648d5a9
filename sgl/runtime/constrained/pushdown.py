"""Pushdown matcher over byte-DFA machines with call edges (pushdown_build.py).

A position is a *configuration*: a set of stacks (usually one). A stack is a flat
tuple (m0, s0, m1, s1, ..., m, s): the top frame (m, s) is the current machine and
state, every frame below holds the state its machine returns to. A byte either moves
the top frame, or calls (push the callee at its start state, the caller waits at the
return state) and moves the callee, or, where the top frame accepts, returns (pop) and
moves the caller; calls and returns chain within one byte (`"}}` closes a string and
two objects). A machine is never pushed twice within one byte's closure, which cuts
only left-recursive loops (JSON values always consume a byte before nesting).

Masks: for a top frame (m, s), the tokens whose bytes never return below (m, s) do not
depend on the rest of the stack (calls they make are pushed and popped within the
token); they are found by a vectorized walk of the whole vocabulary that forks at
calls and returns (`_walk`) and cached per frame, together with the *exits*: (token,
offset) where m accepts mid-token. A configuration's mask adds, per stack, the exits
walked on over the frames below. Masks are cached per configuration (LRU). Rollback
pops a per-token history of configurations.
"""

from __future__ import annotations

import threading
import numpy as np
import torch

from ..lru import LRU
from .base import GrammarError
from .lazy_regex import VocabWalker
from .pushdown_build import PushdownTables
from .state_stack import whole_utf8_prefix
from .vocab import TokenizerInfo

Stack = tuple[int, ...]
Config = frozenset  # frozenset[Stack]
_TERMINATED: Config = frozenset({(-1, -1)})
_MAX_FORCED_BYTES = 1024
_FRAME_CACHE = 4096
_CONFIG_CACHE = 4096
_MAX_STACKS = 256  # ambiguity bound: configurations past this many stacks are refused


def _uniq(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values. np.unique's hash path (numpy >= 2.3) is 10-20x slower
    than a sort on the ~50k-element index arrays a mask walk makes."""
    if a.size < 2:
        return a
    s = np.sort(a)
    return s[np.concatenate(([True], s[1:] != s[:-1]))]


class CompiledPushdown:
    """Machines plus per-frame and per-configuration mask caches (thread-safe)."""

    def __init__(self, tables: PushdownTables, tok: TokenizerInfo, kind: str = "json_schema") -> None:
        self.tables = tables
        self.machines = tables.machines
        self.tok = tok
        self.kind = kind
        self.initial: Config = frozenset({(0, 0)})
        self._eos = list(tok.eos_token_ids)
        self._eos_set = frozenset(tok.eos_token_ids)
        self._frames: LRU[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = LRU(_FRAME_CACHE)
        self._configs: LRU[Config, np.ndarray] = LRU(_CONFIG_CACHE)
        self._lock = threading.Lock()
        self.frame_computes = 0

    @property
    def num_states(self) -> int:
        return self.tables.num_states

    @property
    def num_machines(self) -> int:
        return len(self.machines)

    def new_matcher(self) -> "PushdownGrammar":
        return PushdownGrammar(self)

    # -- byte stepping (Python, exact) ------------------------------------------------
    def _step(self, stack: Stack, b: int, out: set, fresh: frozenset) -> None:
        m, s = stack[-2], stack[-1]
        mach = self.machines[m]
        t = int(mach.trans[s, b])
        if t >= 0:
            out.add(stack[:-1] + (t,))
        for j, r in mach.calls.get(s, ()):
            if j not in fresh:
                self._step(stack[:-1] + (r, j, 0), b, out, fresh | {j})
        if len(stack) > 2 and mach.accept[s]:
            self._step(stack[:-2], b, out, fresh)

    def step_bytes(self, config: Config, data: bytes) -> Config | None:
        cur = config
        for b in data:
            nxt: set = set()
            for st in cur:
                self._step(st, b, nxt, frozenset())
            if not nxt:
                return None
            cur = frozenset(self._bound_stacks(nxt))
        return cur

    def _bound_stacks(self, stacks: set) -> set:
        """The stacks kept after one byte (a general grammar's matcher folds and trims them)."""
        if len(stacks) > _MAX_STACKS:
            raise GrammarError(f"{self.kind}: too many parallel parses (ambiguous schema)")
        return stacks

    def can_end(self, config: Config) -> bool:
        if config is _TERMINATED:
            return True
        return any(all(self.machines[st[i]].accept[st[i + 1]] for i in range(0, len(st), 2))
                   for st in config)

    def next_config(self, config: Config, token_id: int) -> Config | None:
        if config is _TERMINATED:
            return None
        if token_id in self._eos_set:
            return _TERMINATED if self.can_end(config) else None
        if token_id < 0 or token_id >= self.tok.vocab_size:
            return None
        data = self.tok.token_bytes[token_id]
        return self.step_bytes(config, data) if data else None

    # -- masks ----------------------------------------------------------------------
    def _walk(self, items: list, out: np.ndarray, exits: list | None,
              busy: frozenset = frozenset()) -> None:
        """Walk token rows through machines, forking at calls and returns.

        An item is (machine, ctx, k, rows, states, fresh): rows of the vocabulary byte
        table (ascending, so longest tokens first) at byte offset k in `states` of
        `machine`, with `ctx` the flat stack of frames pushed under it. A row alive at
        its end sets out[row]. Where the machine accepts with ctx empty, (k, rows) goes
        to `exits` when given (the caller is not known here), else the rows die
        (nothing below to return to). A call at offset 0 reuses the callee's cached
        frame (`busy` frames are being computed: left recursion walks instead).
        """
        w = VocabWalker.of(self.tok)
        mat, ends = w.mat, w.ends
        n_all = w.ids.size
        while items:
            m, ctx, k, rows, st, fresh = items.pop()
            mach = self.machines[m]
            if k == 0 and rows.size == n_all and (m, int(st[0])) not in busy \
                    and not (st != st[0]).any():
                inside, ek, er = self._frame(m, int(st[0]), busy)
                np.logical_or(out, np.unpackbits(inside, count=n_all).view(bool), out=out)
                for k2 in _uniq(ek).tolist():
                    sel = er[ek == k2]
                    if ctx:
                        items.append((ctx[-2], ctx[:-2], k2, sel,
                                      np.full(sel.size, ctx[-1], dtype=np.int64), frozenset()))
                    elif exits is not None:
                        exits.append((k2, sel))
                continue
            while rows.size:
                cut = int(np.searchsorted(rows, ends[k])) if k < ends.size else 0
                if cut < rows.size:  # rows past ends[k] have no byte k: ended alive
                    out[rows[cut:]] = True
                    rows, st = rows[:cut], st[:cut]
                    if not cut:
                        break
                hc = mach.has_call[st]
                if hc.any():
                    crows, cst = rows[hc], st[hc]
                    for q in _uniq(cst).tolist():
                        sel = crows[cst == q]
                        for j, r in mach.calls[q]:
                            if j not in fresh:
                                items.append((j, ctx + (m, r), k, sel,
                                              np.zeros(sel.size, dtype=np.int64), fresh | {j}))
                ac = mach.accept[st]
                if ac.any():
                    if ctx:
                        items.append((ctx[-2], ctx[:-2], k, rows[ac],
                                      np.full(int(ac.sum()), ctx[-1], dtype=np.int64), fresh))
                    elif exits is not None:
                        exits.append((k, rows[ac]))
                nst = mach.trans[st, mat[rows, k]]
                good = nst >= 0
                rows, st = rows[good], nst[good].astype(np.int64)
                k += 1
                fresh = frozenset()

    def _frame(self, m: int, s: int, busy: frozenset = frozenset()
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(packed row mask of tokens staying above the frame, exit offsets, exit rows)."""
        key = (m, s)
        got = self._frames.get(key)
        if got is not None:
            return got
        w = VocabWalker.of(self.tok)
        n = w.ids.size
        out = np.zeros(n, dtype=bool)
        exits: list = []
        rows = np.arange(n, dtype=np.int64)
        self._walk([(m, (), 0, rows, np.full(n, s, dtype=np.int64), frozenset())], out, exits,
                   busy | {key})
        if exits:
            ek = np.concatenate([np.full(r.size, k, dtype=np.int64) for k, r in exits])
            er = np.concatenate([r for _, r in exits])
            uniq = _uniq(er * 4096 + ek)  # a (row, offset) pair once
            er, ek = uniq // 4096, uniq % 4096
        else:
            ek = er = np.zeros(0, dtype=np.int64)
        got = (np.packbits(out), ek, er)
        with self._lock:
            self.frame_computes += 1
        self._frames.put(key, got)
        return got

    def token_mask(self, config: Config) -> np.ndarray:
        """Bool [vocab_size] of allowed non-EOS tokens in `config` (cached, packed)."""
        packed = self._configs.get(config)
        if packed is None:
            w = VocabWalker.of(self.tok)
            n = w.ids.size
            rows = np.zeros(n, dtype=bool)
            for st in config:
                inside, ek, er = self._frame(st[-2], st[-1])
                rows |= np.unpackbits(inside, count=n).view(bool)
                if len(st) > 2 and er.size:
                    below, m2, r2 = st[:-4], st[-4], st[-3]
                    items = []
                    for k in _uniq(ek).tolist():
                        sel = er[ek == k]
                        items.append((m2, below, k, sel, np.full(sel.size, r2, dtype=np.int64),
                                      frozenset()))
                    self._walk(items, rows, None)
            m = np.zeros(self.tok.vocab_size, dtype=bool)
            m[w.ids[rows]] = True
            self._configs.put(config, np.packbits(m))
            return m
        return np.unpackbits(packed, count=self.tok.vocab_size).view(bool)

    # -- jump-forward -----------------------------------------------------------------
    def _first(self, stack: Stack, fresh: frozenset, acc: set) -> None:
        m, s = stack[-2], stack[-1]
        mach = self.machines[m]
        acc.update(np.nonzero(mach.trans[s] >= 0)[0].tolist())
        for j, r in mach.calls.get(s, ()):
            if j not in fresh and len(acc) < 2:
                self._first(stack[:-1] + (r, j, 0), fresh | {j}, acc)
        if len(stack) > 2 and mach.accept[s] and len(acc) < 2:
            self._first(stack[:-2], fresh, acc)

    def forced_bytes(self, config: Config) -> bytes:
        """Bytes every continuation starts with: while exactly one byte is possible and
        the configuration cannot end (EOS would be an alternative)."""
        out = bytearray()
        cur = config
        while len(out) < _MAX_FORCED_BYTES and not self.can_end(cur):
            acc: set = set()
            for st in cur:
                self._first(st, frozenset(), acc)
                if len(acc) > 1:
                    break
            if len(acc) != 1:
                break
            b = acc.pop()
            nxt = self.step_bytes(cur, bytes([b]))
            if nxt is None:
                break
            out.append(b)
            cur = nxt
        return bytes(out)


class PushdownGrammar:
    """One request's position (Grammar protocol), same surface as LazyRegexGrammar."""

    def __init__(self, compiled: CompiledPushdown) -> None:
        self.compiled = compiled
        self.history: list[Config] = [compiled.initial]

    @property
    def config(self) -> Config:
        return self.history[-1]

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        c = self.compiled
        if self.config is _TERMINATED:
            mask_row[c._eos] = True
            return
        m = c.token_mask(self.config)
        if mask_row.device.type == "cpu":
            row = mask_row.numpy()
            np.logical_or(row[: m.size], m, out=row[: m.size])
        else:
            mask_row[: m.size] |= torch.from_numpy(m).to(mask_row.device)
        if c.can_end(self.config):
            mask_row[c._eos] = True

    def allowed_token_ids(self) -> list[int]:
        c = self.compiled
        if self.config is _TERMINATED:
            return list(c._eos)
        ids = np.nonzero(c.token_mask(self.config))[0].tolist()
        return ids + (list(c._eos) if c.can_end(self.config) else [])

    def accept_token(self, token_id: int) -> None:
        nxt = self.compiled.next_config(self.config, int(token_id))
        if nxt is None:
            raise GrammarError(f"{self.compiled.kind}: token {token_id} not allowed here")
        self.history.append(nxt)

    def accept_bytes(self, data: bytes) -> None:
        """Advance by raw bytes; one rollback step in all."""
        nxt = None if self.config is _TERMINATED else self.compiled.step_bytes(self.config, data)
        if nxt is None:
            raise GrammarError(f"{self.compiled.kind}: text not allowed here")
        self.history.append(nxt)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > len(self.history) - 1:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {len(self.history) - 1} accepted")
        if num_tokens:
            del self.history[-num_tokens:]

    def is_terminated(self) -> bool:
        cfg = self.config
        if cfg is _TERMINATED:
            return True
        c = self.compiled
        return c.can_end(cfg) and not c.token_mask(cfg).any()

    def can_end(self) -> bool:
        return self.compiled.can_end(self.config)

    def jump_forward_string(self) -> str | None:
        if self.config is _TERMINATED:
            return None
        return whole_utf8_prefix(self.compiled.forced_bytes(self.config))

    def num_accepted(self) -> int:
        return len(self.history) - 1

    def stacks(self) -> list[tuple[int, ...]]:
        """The configuration's stacks, bottom frame first: (m0, s0, ..., m, s) each."""
        return [] if self.config is _TERMINATED else sorted(self.config)

    def copy(self) -> "PushdownGrammar":
        return PushdownGrammar(self.compiled)
