"""Grammars on the native engine: the compiled object every matcher of a spec shares.

`CompiledNative` answers what a matcher asks (token masks, steps, can-end, forced bytes)
for configurations, the flat tuples of native/binding.py; matchers are the pushdown's
(`NativeGrammar`, a history of configurations, so rollback is a pop). Masks are cached
per configuration as the engine packs them (uint64 words, LRU) and OR'd into a bool
row in C. Builders:

  from_regex(regex)        one machine (regex and choices constraints, single-regex schemas)
  from_machines(spec)      a JSON Schema's machines (json_schema/machines.py): root, subs
                           called by marker, Intersect subs as products of hidden parts
  from_cfg(root, subs)     a CFG's machines (cfg_machines.py): callees never match "",
                           ambiguity bounded by folding and by keeping the shortest stacks

A regex the C parser does not read is built by `fallback(regex)` (the outlines-core
route, disk-cached by the registry) and loaded as a table; with call markers, its
marker paths are cut into calls first (pushdown_build.split_calls).
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import numpy as np
import torch

from ...lru import LRU
from ..base import GrammarError
from ..byte_dfa import ByteDFA
from ..dfa_ops import drop_empty
from ..json_schema.machines import Intersect, Sub
from ..pushdown import _TERMINATED, PushdownGrammar
from ..pushdown_build import split_calls
from ..token_trie import TokenTrie
from ..vocab import TokenizerInfo
from .binding import Config, NativeEngine, TokenSlices, bits_or, config_of, words_of
from .shorthand import shorthand_tables

T = TypeVar("T")

_MAX_FORCED_BYTES = 1024
_CONFIG_CACHE = 4096
Fallback = Callable[[str], ByteDFA]


class CompiledNative:
    """One grammar's engine plus the mask cache (thread-safe: the engine locks)."""

    def __init__(self, engine: NativeEngine, tok: TokenizerInfo, kind: str) -> None:
        self.engine = engine
        self.tok = tok
        self.kind = kind
        trie = TokenTrie.of(tok)
        slices = tok.memo("native_token_slices", lambda: TokenSlices(tok.vocab_size))
        engine.set_trie(trie.node, trie.next, trie.tok_start, trie.tok_ids, trie.sub_bytes, trie.height,
                        trie.level_nodes, trie.level_off, slices, trie.max_depth, tok.vocab_size)
        self._trie = trie
        self.initial: Config = config_of([1, 2, 0, 0])
        self._eos = list(tok.eos_token_ids)
        self._eos_set = frozenset(tok.eos_token_ids)
        self._masks: LRU[Config, np.ndarray] = LRU(_CONFIG_CACHE)
        self.mask_computes = 0

    @property
    def num_states(self) -> int:
        """DFA states built so far (they are built as texts reach them)."""
        return self.engine.num_states()

    @property
    def num_machines(self) -> int:
        return self.engine.n_machines

    @property
    def failed(self) -> bool:
        """The engine met a sticky error: new paths fail for every request sharing it."""
        return self.engine.failed()

    def new_matcher(self) -> "NativeGrammar":
        return NativeGrammar(self)

    # -- stepping ---------------------------------------------------------------------
    def step_bytes(self, config: Config, data: bytes) -> Config | None:
        if config is _TERMINATED:
            return None
        return self.engine.step(config, data) if data else config

    def next_config(self, config: Config, token_id: int) -> Config | None:
        if config is _TERMINATED:
            return None
        if token_id in self._eos_set:
            return _TERMINATED if self.can_end(config) else None
        if token_id < 0 or token_id >= self.tok.vocab_size:
            return None
        data = self.tok.token_bytes[token_id]
        return self.engine.step(config, data) if data else None

    def can_end(self, config: Config) -> bool:
        return config is _TERMINATED or self.engine.can_end(config)

    def forced_bytes(self, config: Config) -> bytes:
        """Bytes every continuation starts with, while exactly one byte is possible and
        the configuration cannot end (EOS would be an alternative)."""
        return self.engine.forced(config, _MAX_FORCED_BYTES)

    # -- masks ------------------------------------------------------------------------
    def token_bits(self, config: Config) -> np.ndarray:
        """Allowed non-EOS tokens in `config`, packed (uint64 words; cached).

        With several stacks (JSON mode), the union of each stack's own mask: stacks step
        independently there, and single stacks recur far more often than their sets
        (a value reached inline and through a call). CFG configurations are walked
        whole, because keeping the shortest stacks couples them."""
        got = self._masks.get(config)
        if got is not None:
            return got
        if self.engine.json_mode and config[:4] != _ONE:
            bits = np.zeros((self.tok.vocab_size + 63) // 64, dtype=np.uint64)
            for stack in _stacks(config):
                bits |= self.token_bits(stack)
        else:
            bits = self.engine.mask_bits(config, self.tok.vocab_size)
            self.mask_computes += 1
        self._masks.put(config, bits)
        return bits

    def token_mask(self, config: Config) -> np.ndarray:
        """Bool [vocab_size] of allowed non-EOS tokens in `config`."""
        m = np.zeros(self.tok.vocab_size, dtype=bool)
        bits_or(self.token_bits(config), m)
        return m


_ONE = config_of([1])  # the first word of a one-stack configuration


def _stacks(config: Config) -> list[Config]:
    """The single-stack configurations of a flat configuration."""
    w = words_of(config)
    out, i = [], 1
    for _ in range(w[0]):
        n = w[i]
        out.append(config_of([1, n] + w[i + 1:i + 1 + n]))
        i += 1 + n
    return out


class NativeGrammar(PushdownGrammar):
    """One request's position. A mask, end test or jump-forward that fails (the engine
    passed its state bound) records the error and answers harmlessly (every token
    allowed, not terminated, nothing forced); the next accept_token raises it: only
    this request ends, with the message. (The scheduler calls is_terminated and
    jump_forward_string outside its accept_token guard, so those must not raise.)"""

    def __init__(self, compiled: CompiledNative) -> None:
        super().__init__(compiled)  # type: ignore[arg-type]
        self.error: GrammarError | None = None

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        if self.error is None:
            c: CompiledNative = self.compiled  # type: ignore[assignment]
            try:
                if self.config is _TERMINATED:
                    mask_row[c._eos] = True
                    return
                if mask_row.device.type == "cpu":
                    bits_or(c.token_bits(self.config), mask_row.numpy())
                else:
                    mask_row[: c.tok.vocab_size] |= torch.from_numpy(c.token_mask(self.config)).to(mask_row.device)
                if c.can_end(self.config):
                    mask_row[c._eos] = True
                return
            except GrammarError as e:
                self.error = e
        mask_row.fill_(True)

    def _guarded(self, call: Callable[[], T], harmless: T) -> T:
        """call(), or `harmless` once the engine has failed (the error is kept for accept_token)."""
        if self.error is None:
            try:
                return call()
            except GrammarError as e:
                self.error = e
        return harmless

    def is_terminated(self) -> bool:
        return self._guarded(super().is_terminated, False)

    def jump_forward_string(self) -> str | None:
        return self._guarded(super().jump_forward_string, None)

    def accept_token(self, token_id: int) -> None:
        if self.error is not None:
            raise self.error
        super().accept_token(token_id)

    def stacks(self) -> list[tuple[int, ...]]:
        """The configuration's stacks, bottom frame first: (m0, s0, ..., m, s) each."""
        if self.config is _TERMINATED:
            return []
        return sorted(tuple(words_of(c)[2:]) for c in _stacks(self.config))

    def copy(self) -> "NativeGrammar":
        return NativeGrammar(self.compiled)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- builders
def _uni(regex: str) -> np.ndarray | None:
    return shorthand_tables() if "\\" in regex else None


def _set(eng: NativeEngine, m: int, regex: str, fallback: Fallback, n_subs: int, kind: str, *,
         calls: bool, hidden: bool = False, no_empty: bool = False) -> None:
    if eng.set_regex(m, regex, calls=calls, uni=_uni(regex), hidden=hidden, no_empty=no_empty):
        return
    dfa = fallback(regex)
    if no_empty:
        dfa = drop_empty(dfa)
    if not calls:
        eng.set_table(m, dfa.trans, dfa.accept, hidden=hidden)
        return
    mach = split_calls(dfa, n_subs, kind)
    eng.set_table(m, mach.trans, mach.accept,
                  [(s, j, r) for s, cs in mach.calls.items() for j, r in cs], hidden=hidden)


def from_regex(regex: str, tok: TokenizerInfo, kind: str, fallback: Fallback) -> CompiledNative:
    eng = NativeEngine(1, kind)
    _set(eng, 0, regex, fallback, 0, kind, calls=False)
    _finalize(eng, kind, "regex: matches nothing")
    return CompiledNative(eng, tok, kind)


def from_machines(root: str, subs: Sequence[Sub], tok: TokenizerInfo, kind: str,
                  fallback: Fallback) -> CompiledNative:
    """Machine 0 = root, k + 1 = subs[k] (None: matches nothing); Intersect parts go after."""
    specs: list[Sub] = [root, *subs]
    n_parts = sum(len(s.parts) for s in specs if isinstance(s, Intersect))
    eng = NativeEngine(len(specs) + n_parts, kind, json_mode=True)
    nxt = len(specs)
    for i, sub in enumerate(specs):
        if sub is None:
            continue
        if isinstance(sub, Intersect):
            ids = list(range(nxt, nxt + len(sub.parts)))
            for j, part in zip(ids, sub.parts):
                _set(eng, j, part, fallback, len(subs), kind, calls=True, hidden=True)
            eng.set_intersect(i, ids)
            nxt += len(sub.parts)
        else:
            _set(eng, i, sub, fallback, len(subs), kind, calls=True)
    _finalize(eng, kind, f"{kind}: the schema accepts no instance")
    return CompiledNative(eng, tok, kind)


def from_cfg(root: str, subs: Sequence[str], tok: TokenizerInfo, kind: str,
             fallback: Fallback) -> CompiledNative:
    eng = NativeEngine(1 + len(subs), kind, json_mode=False)
    _set(eng, 0, root, fallback, len(subs), kind, calls=True)
    for k, r in enumerate(subs):
        _set(eng, k + 1, r, fallback, len(subs), kind, calls=True, no_empty=True)
    _finalize(eng, kind, f"{kind}: the grammar derives no string")
    return CompiledNative(eng, tok, kind)


def _finalize(eng: NativeEngine, kind: str, empty_message: str) -> None:
    try:
        eng.finalize(0)
    except GrammarError as e:
        if "matches nothing" in str(e):
            raise GrammarError(empty_message) from None
        raise
