"""Regex-family grammars (regex, JSON Schema, choices) on an outlines-core Index.

The Index maps (FSM state, token id) -> next state for the whole vocabulary, built once
per (regex, vocabulary). `CompiledRegex` holds it with per-state caches (allowed-id
tensors, forced strings) shared by every matcher; `RegexGrammar` is one request's
position: a stack of states, so rollback is a pop. EOS is never in the Index's token map
(outlines-core forbids it); we add every EOS id ourselves in final states.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

from .base import GrammarError
from .state_stack import TERMINATED, StateStackGrammar
from .vocab import TokenizerInfo

_MAX_FORCED_BYTES = 1024
# Rust regex meta characters; escaping any other character may change its meaning
# (e.g. `\<` is a word boundary), so `choices` escapes exactly these.
_RUST_META = set("\\.+*?()|[]{}^$#&-~")


def escape_regex_literal(s: str) -> str:
    return "".join("\\" + c if c in _RUST_META else c for c in s)


def choices_to_regex(choices: list[str]) -> str:
    """An alternation matching exactly one of `choices` (longest first, escaped)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choices: expected a non-empty list of strings")
    uniq = sorted(set(choices), key=lambda c: (-len(c), c))
    return "(" + "|".join(escape_regex_literal(c) for c in uniq) + ")"


def json_schema_to_regex(spec: str | dict[str, Any], whitespace: str | None = None,
                        leading: bool = False) -> str:
    """Our converter when present; outlines-core's otherwise. `whitespace`: a regex for
    what may appear between JSON tokens (and before the value with `leading`)."""
    if isinstance(spec, str):
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema: not valid JSON ({e})") from None
    else:
        schema = spec
    try:
        from .json_schema import schema_to_regex  # type: ignore[attr-defined]
    except ImportError:
        schema_to_regex = None
    try:
        if schema_to_regex is not None:
            return schema_to_regex(schema, whitespace=whitespace, leading=leading)
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema), whitespace)
        return f"(?:{whitespace})(?:{regex})" if leading and whitespace else regex
    except GrammarError:
        raise
    except Exception as e:  # converters raise assorted types for unsupported schemas
        raise GrammarError(f"json_schema: cannot convert schema ({e})") from None


def build_index(regex: str, tok: TokenizerInfo, kind: str = "regex") -> Any:
    from outlines_core import Index

    try:
        return Index(regex, tok.to_outlines_vocabulary())
    except Exception as e:
        raise GrammarError(f"{kind}: cannot compile regex ({e})") from None


class CompiledRegex:
    """Immutable compiled tables plus lazily filled per-state caches (thread-safe)."""

    def __init__(self, index: Any, tok: TokenizerInfo, kind: str = "regex") -> None:
        self.index = index
        self.tok = tok
        self.kind = kind
        self.initial = index.get_initial_state()
        self.finals = frozenset(index.get_final_states())
        self._eos = torch.tensor(tok.eos_token_ids, dtype=torch.long)
        self._eos_set = set(tok.eos_token_ids)
        self._allowed: dict[int, torch.Tensor] = {}
        self._forced: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self._first_byte: np.ndarray | None = None
        self._single_byte_id: dict[int, int] = {}

    def new_matcher(self) -> "RegexGrammar":
        return RegexGrammar(self)

    def allowed_ids(self, state: int) -> torch.Tensor:
        """Allowed token ids (EOS included in final states), cached per state."""
        t = self._allowed.get(state)
        if t is None:
            ids = [i for i in (self.index.get_allowed_tokens(state) or []) if i not in self._eos_set]
            t = torch.tensor(ids, dtype=torch.long)
            if state in self.finals:
                t = torch.cat([t, self._eos])
            with self._lock:
                self._allowed[state] = t
        return t

    def next_state(self, state: int, token_id: int) -> int | None:
        if token_id in self._eos_set:
            return TERMINATED if state in self.finals else None
        if token_id < 0 or token_id >= self.tok.vocab_size:
            return None
        return self.index.get_next_state(state, token_id)

    def has_continuation(self, state: int) -> bool:
        ids = self.allowed_ids(state)
        return ids.numel() > (len(self._eos_set) if state in self.finals else 0)

    def forced_bytes(self, state: int) -> bytes:
        """Bytes every continuation from `state` starts with (empty in final states).

        A byte is forced when all allowed tokens start with it; we then step through the
        single-byte token for it and repeat. Exact w.r.t. the Index, which only keeps
        tokens that leave a match reachable.
        """
        got = self._forced.get(state)
        if got is not None:
            return got
        first, single = self._byte_tables()
        out = bytearray()
        s: int | None = state
        while s is not None and s not in self.finals and len(out) < _MAX_FORCED_BYTES:
            ids = self.allowed_ids(s).numpy()
            if ids.size == 0:
                break
            heads = np.unique(first[ids])
            if heads.size != 1 or heads[0] < 0:
                break
            b = int(heads[0])
            tid = single.get(b)
            if tid is None:
                break
            s = self.index.get_next_state(s, tid)
            if s is None:
                break
            out.append(b)
        res = bytes(out)
        with self._lock:
            self._forced[state] = res
        return res

    def _byte_tables(self) -> tuple[np.ndarray, dict[int, int]]:
        if self._first_byte is None:
            first = np.full(self.tok.vocab_size, -1, dtype=np.int16)
            single: dict[int, int] = {}
            for i, b in enumerate(self.tok.token_bytes):
                if b and i not in self._eos_set:
                    first[i] = b[0]
                    if len(b) == 1:
                        single.setdefault(b[0], i)
            self._single_byte_id = single
            self._first_byte = first
        return self._first_byte, self._single_byte_id


class RegexGrammar(StateStackGrammar):
    """One request's position in a compiled regex (implements the Grammar protocol)."""

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        if self.state == TERMINATED:
            mask_row[torch.tensor(self.compiled.tok.eos_token_ids)] = True
            return
        mask_row[self.compiled.allowed_ids(self.state)] = True

    def accept_bytes(self, data: bytes) -> None:
        """Advance by raw bytes (via single-byte tokens); one rollback step in all."""
        _, single = self.compiled._byte_tables()
        s: int | None = self.state
        for b in data:
            tid = single.get(b)
            s = None if tid is None or s in (None, TERMINATED) else self.compiled.index.get_next_state(s, tid)
            if s is None:
                raise GrammarError(f"{self.compiled.kind}: text not allowed here")
        self.states.append(s)  # type: ignore[arg-type]

    def is_terminated(self) -> bool:
        s = self.state
        return s == TERMINATED or (s in self.compiled.finals and not self.compiled.has_continuation(s))

    def can_end(self) -> bool:
        return self.state == TERMINATED or self.state in self.compiled.finals
