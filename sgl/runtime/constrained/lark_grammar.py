"""Context-free grammars (Lark, and GBNF via translation) with precomputed token masks.

Lark builds the LALR(1) table and the terminal regexes; we run both ourselves so a
state is plain hashable data: (parser stack, lexer candidates, fresh). The lexer is
contextual (candidates = terminals the parser accepts here, plus %ignore ones) and
longest-match: a lexeme grows while any candidate can still grow; when none can, the
highest-priority candidate that has fully matched is handed to the parser.

Masks never try tokens one by one through a parser copy. Each terminal is a byte-level
DFA; all vocabulary tokens are walked through the candidates' DFAs at once with numpy
(per (terminal, DFA state) results are cached and shared by every parser state). Only
tokens that cross a terminal boundary recurse, grouped by the terminal they complete.
The finished mask is cached per lexer/parser state, so repeated states cost one OR.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..lru import LRU
from .base import GrammarError
from .byte_dfa import ByteDFA, regex_to_byte_dfa
from .vocab import TokenizerInfo

Stack = tuple[int, ...]
Cands = tuple[tuple[int, int], ...]  # (terminal index, byte-DFA state), priority order
State = tuple[Stack, Cands, bool]  # bool: lexeme still empty
_END = "$END"
_MAX_FORCED = 256

# Lark's common.lark spells these with lookbehinds, which a DFA cannot express.
_LOOKAROUND_FREE = {
    r'".*?(?<!\\)(\\\\)*?"': r'"(?:[^"\\\n]|\\[^\n])*"',
    r"'.*?(?<!\\)(\\\\)*?'": r"'(?:[^'\\\n]|\\[^\n])*'",
}


class CompiledLark:
    """Tables for one grammar x vocabulary, shared by all its matchers."""

    def __init__(self, grammar: str, tok: TokenizerInfo, kind: str = "lark") -> None:
        import lark

        self.kind, self.tok = kind, tok
        try:
            lk = lark.Lark(grammar, parser="lalr", lexer="contextual", start="start")
        except Exception as e:
            raise GrammarError(f"{kind}: invalid grammar ({type(e).__name__}: {e})") from None
        self.source = grammar
        self._load_terminals(lk)
        self._load_table(lk)
        self._eos = list(tok.eos_token_ids)
        self._feed_memo: dict[tuple[Stack, str], Stack | None] = {}
        self._accepts_memo: dict[Stack, tuple[Cands, bool]] = {}
        self._walk_memo: LRU[tuple[int, int], tuple[np.ndarray, np.ndarray]] = LRU(512)
        self._mask_memo: LRU[State, np.ndarray] = LRU(1024)  # 49 KB each at a 49k vocab
        ids, lens, mat = tok.byte_table()
        self._ids, self._lens, self._mat = ids, lens, mat
        self._initial: State = (self.start_stack, self.start_cands(self.start_stack), True)

    def new_matcher(self) -> "LarkGrammar":
        return LarkGrammar(self)

    # -- construction ---------------------------------------------------------------
    def _load_terminals(self, lk: Any) -> None:
        from lark.lexer import PatternStr

        terms = list(lk.terminals)
        # Priority order for ties between fully matched candidates: declared priority,
        # then literals over regexes (lark retypes keyword matches the same way).
        terms.sort(key=lambda t: (-t.priority, not isinstance(t.pattern, PatternStr),
                                  -len(t.pattern.value), t.name))
        self.term_names = [t.name for t in terms]
        self.term_index = {n: i for i, n in enumerate(self.term_names)}
        self.literal: list[str | None] = [t.pattern.value if isinstance(t.pattern, PatternStr)
                                          and not t.pattern.flags else None for t in terms]
        self.dfas: list[ByteDFA] = []
        for t in terms:
            rx = t.pattern.to_regexp()
            rx = _LOOKAROUND_FREE.get(rx, rx)
            try:
                self.dfas.append(regex_to_byte_dfa(rx))
            except ValueError as e:
                raise GrammarError(f"{self.kind}: terminal {t.name} is not supported ({e})") from None
        self.ignore = frozenset(self.term_index[n] for n in lk.ignore_tokens if n in self.term_index)

    def _load_table(self, lk: Any) -> None:
        from lark.parsers.lalr_analysis import Shift

        table = lk.parser.parser.parser.parse_table
        self.start_stack: Stack = (table.start_states["start"],)
        self.end_state = table.end_states["start"]
        self.actions: dict[int, dict[str, tuple[bool, Any]]] = {}
        self.goto: dict[int, dict[str, int]] = {}
        for st, acts in table.states.items():
            a: dict[str, tuple[bool, Any]] = {}
            g: dict[str, int] = {}
            for sym, (act, arg) in acts.items():
                if act is Shift:
                    if sym.isupper() or sym == _END:
                        a[sym] = (True, arg)
                    else:
                        g[sym] = arg
                else:
                    a[sym] = (False, (arg.origin.name, len(arg.expansion)))
            self.actions[st], self.goto[st] = a, g

    # -- parser ---------------------------------------------------------------------
    def feed(self, stack: Stack, term: str) -> Stack | None:
        key = (stack, term)
        if key in self._feed_memo:
            return self._feed_memo[key]
        st = list(stack)
        out: Stack | None = None
        while True:
            act = self.actions[st[-1]].get(term)
            if act is None:
                break
            shift, arg = act
            if shift:
                st.append(arg)
                out = tuple(st)
                break
            origin, size = arg
            if size:
                del st[-size:]
            st.append(self.goto[st[-1]][origin])
            if term == _END and st[-1] == self.end_state:
                out = tuple(st)
                break
        self._feed_memo[key] = out
        return out

    def start_cands(self, stack: Stack) -> Cands:
        return self._accepts(stack)[0]

    def end_ok(self, stack: Stack) -> bool:
        return self._accepts(stack)[1]

    def _accepts(self, stack: Stack) -> tuple[Cands, bool]:
        got = self._accepts_memo.get(stack)
        if got is None:
            names = self.actions[stack[-1]]
            idx = [i for i, n in enumerate(self.term_names)
                   if i in self.ignore or (n in names and self.feed(stack, n) is not None)]
            cands = tuple((i, self.dfas[i].initial) for i in idx
                          if (self.dfas[i].trans[self.dfas[i].initial] >= 0).any())
            got = (cands, _END in names and self.feed(stack, _END) is not None)
            self._accepts_memo[stack] = got
        return got

    def complete(self, stack: Stack, cands: Cands) -> Stack | None:
        """Parser stack after the lexeme ends now (None if no candidate fully matched)."""
        for t, s in cands:
            if self.dfas[t].accept[s]:
                return stack if t in self.ignore else self.feed(stack, self.term_names[t])
        return None

    # -- scalar stepping (accept_token, jump-forward) -------------------------------
    def step_byte(self, state: State, b: int) -> State | None:
        stack, cands, fresh = state
        nxt = tuple((t, int(self.dfas[t].trans[s, b])) for t, s in cands if self.dfas[t].trans[s, b] >= 0)
        if nxt:
            return (stack, nxt, False)
        if fresh:
            return None
        stack2 = self.complete(stack, cands)
        if stack2 is None:
            return None
        nxt = tuple((t, int(self.dfas[t].trans[s, b])) for t, s in self.start_cands(stack2)
                    if self.dfas[t].trans[s, b] >= 0)
        return (stack2, nxt, False) if nxt else None

    def step_bytes(self, state: State, data: bytes) -> State | None:
        s: State | None = state
        for b in data:
            s = self.step_byte(s, b)
            if s is None:
                return None
        return s

    def can_end(self, state: State) -> bool:
        stack, cands, fresh = state
        if fresh:
            return self.end_ok(stack)
        stack2 = self.complete(stack, cands)
        return stack2 is not None and self.end_ok(stack2)

    def forced_next_byte(self, state: State) -> int | None:
        stack, cands, fresh = state
        if len(cands) != 1:
            return None
        t, s = cands[0]
        dfa = self.dfas[t]
        outs = dfa.live_out(s)
        if dfa.accept[s] and not fresh:
            if outs.size:
                return None  # the lexeme may grow or end here
            stack2 = self.complete(stack, cands)
            if stack2 is None or self.end_ok(stack2):
                return None
            c2 = self.start_cands(stack2)
            if len(c2) != 1:
                return None
            outs = self.dfas[c2[0][0]].live_out(c2[0][1])
        elif fresh and self.end_ok(stack):
            return None
        return int(outs[0]) if outs.size == 1 else None

    # -- masks ----------------------------------------------------------------------
    def mask(self, state: State) -> np.ndarray:
        """Bool [vocab_size] of allowed tokens (EOS where the grammar may end), cached."""
        m = self._mask_memo.get(state)
        if m is None:
            n = len(self._ids)
            ok = self._walk(state, np.arange(n), np.zeros(n, dtype=np.int64), top=True)
            m = np.zeros(self.tok.vocab_size, dtype=bool)
            m[self._ids[ok]] = True
            if self.can_end(state):
                m[self._eos] = True
            self._mask_memo.put(state, m)
        return m

    def _dfa_walk(self, t: int, s: int, rows: np.ndarray, offs: np.ndarray,
                  top: bool, first: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(bytes consumed while alive, last live state) for each row from state s."""
        key = (t, s)
        if top:
            hit = self._walk_memo.get(key)
            if hit is not None:
                return hit
        trans = self.dfas[t].trans
        rem = self._lens[rows] - offs
        n = rows.size
        state = np.full(n, s, dtype=np.int32)
        used = np.zeros(n, dtype=np.int32)
        if top:
            act = np.nonzero(rem > 0)[0]
        else:  # most candidates die on the first byte; skip them without a walk
            act = np.nonzero(trans[s, first] >= 0)[0]
            if not act.size:
                return used, state
        k = 0
        mat = self._mat
        while act.size:
            b = mat[rows[act], offs[act] + k]
            nxt = trans[state[act], b]
            good = nxt >= 0
            act = act[good]
            state[act] = nxt[good]
            used[act] += 1
            k += 1
            act = act[rem[act] > k]
        res = (used, state)
        if top:
            self._walk_memo.put(key, res)
        return res

    def _walk(self, state: State, rows: np.ndarray, offs: np.ndarray, top: bool = False) -> np.ndarray:
        """Which of `rows` (token-table rows, from byte `offs`) are viable from `state`."""
        stack, cands, fresh = state
        n = rows.size
        rem = self._lens[rows] - offs
        if not cands:
            return np.zeros(n, dtype=bool)
        first = None if top else self._mat[rows, offs]  # offs < length here
        walks = [self._dfa_walk(t, s, rows, offs, top, first) for t, s in cands]
        used = np.stack([w[0] for w in walks])  # [C, n]
        allowed = (used == rem).any(axis=0)  # some candidate survives the whole token
        j = used.max(axis=0)
        rest = ~allowed if not fresh else ~allowed & (j > 0)
        if not rest.any():
            return allowed
        chosen = np.full(n, -1, dtype=np.int64)
        for c, (t, _) in enumerate(cands):
            acc = self.dfas[t].accept[walks[c][1]]
            pick = rest & (chosen < 0) & (used[c] == j) & acc
            chosen[pick] = c
        for c in set(chosen[chosen >= 0].tolist()):
            t = cands[c][0]
            stack2 = stack if t in self.ignore else self.feed(stack, self.term_names[t])
            if stack2 is None:
                continue
            sel = np.nonzero(chosen == c)[0]
            sub = (stack2, self.start_cands(stack2), True)
            allowed[sel] = self._walk(sub, rows[sel], offs[sel] + j[sel])
        return allowed


class LarkGrammar:
    """One request's position in a CFG (implements the Grammar protocol)."""

    def __init__(self, compiled: CompiledLark) -> None:
        self.compiled = compiled
        self.states: list[State | None] = [compiled._initial]  # None = EOS accepted

    @property
    def state(self) -> State | None:
        return self.states[-1]

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        s = self.state
        if s is None:
            mask_row[self.compiled._eos] = True
            return
        m = self.compiled.mask(s)
        if not m.any():  # dead end (lexer ambiguity the grammar allows): let it stop
            mask_row[self.compiled._eos] = True
            return
        if mask_row.device.type == "cpu":
            # numpy view: single-threaded OR, no intra-op thread-pool wakeups
            row = mask_row.numpy()
            np.logical_or(row[: m.size], m, out=row[: m.size])
        else:
            mask_row[: m.size] |= torch.from_numpy(m).to(mask_row.device)

    def allowed_token_ids(self) -> list[int]:
        row = torch.zeros(self.compiled.tok.vocab_size, dtype=torch.bool)
        self.fill_mask(row)
        return torch.nonzero(row).flatten().tolist()

    def accept_token(self, token_id: int) -> None:
        s = self.state
        c = self.compiled
        tid = int(token_id)
        if s is not None and tid in c.tok.eos_token_ids and c.can_end(s):
            self.states.append(None)
            return
        data = c.tok.token_bytes[tid] if 0 <= tid < c.tok.vocab_size else None
        nxt = c.step_bytes(s, data) if s is not None and data else None
        if nxt is None:
            raise GrammarError(f"{c.kind}: token {tid} not allowed here")
        self.states.append(nxt)

    def accept_bytes(self, data: bytes) -> None:
        s = self.state
        nxt = self.compiled.step_bytes(s, data) if s is not None else None
        if nxt is None:
            raise GrammarError(f"{self.compiled.kind}: text not allowed here")
        self.states.append(nxt)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > len(self.states) - 1:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {len(self.states) - 1} accepted")
        if num_tokens:
            del self.states[-num_tokens:]

    def can_end(self) -> bool:
        s = self.state
        return s is None or self.compiled.can_end(s)

    def is_terminated(self) -> bool:
        s = self.state
        if s is None:
            return True
        if not self.compiled.can_end(s):
            return False
        m = self.compiled.mask(s).copy()
        m[self.compiled._eos] = False
        return not m.any()

    def jump_forward_string(self) -> str | None:
        s = self.state
        if s is None:
            return None
        out = bytearray()
        while len(out) < _MAX_FORCED:
            b = self.compiled.forced_next_byte(s)
            if b is None:
                break
            nxt = self.compiled.step_byte(s, b)
            if nxt is None:
                break
            out.append(b)
            s = nxt
        for cut in range(len(out), max(len(out) - 4, -1), -1):
            try:
                return bytes(out[:cut]).decode("utf-8") or None
            except UnicodeDecodeError:
                continue
        return None

    def copy(self) -> "LarkGrammar":
        return LarkGrammar(self.compiled)

