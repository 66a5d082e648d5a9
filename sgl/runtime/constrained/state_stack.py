"""Shared matcher logic for DFA-backed grammars (regex, JSON Schema, choices).

A matcher is a stack of DFA states, one pushed per accepted token, so rollback is a
pop. The compiled object (shared by every matcher of a spec) answers `next_state`,
`allowed_ids` and `forced_bytes`; subclasses supply the mask fill, byte stepping and
end-state tests that differ between the outlines Index and the lazy byte DFA.
"""

from __future__ import annotations

from typing import Any

from .base import GrammarError

TERMINATED = -1  # pseudo-state pushed when EOS is accepted


def whole_utf8_prefix(raw: bytes) -> str | None:
    """`raw` up to its last whole UTF-8 character (forced bytes may end mid-character;
    the caller appends whole characters), or None if that is empty."""
    for cut in range(len(raw), max(len(raw) - 4, -1), -1):
        try:
            return raw[:cut].decode("utf-8") or None
        except UnicodeDecodeError:
            continue
    return None


class StateStackGrammar:
    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.states: list[int] = [compiled.initial]

    @property
    def state(self) -> int:
        return self.states[-1]

    def allowed_token_ids(self) -> list[int]:
        if self.state == TERMINATED:
            return list(self.compiled.tok.eos_token_ids)
        return self.compiled.allowed_ids(self.state).tolist()

    def accept_token(self, token_id: int) -> None:
        nxt = None if self.state == TERMINATED else self.compiled.next_state(self.state, int(token_id))
        if nxt is None:
            raise GrammarError(f"{self.compiled.kind}: token {token_id} not allowed here")
        self.states.append(nxt)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > len(self.states) - 1:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {len(self.states) - 1} accepted")
        if num_tokens:
            del self.states[-num_tokens:]

    def jump_forward_string(self) -> str | None:
        if self.state == TERMINATED:
            return None
        return whole_utf8_prefix(self.compiled.forced_bytes(self.state))

    def num_accepted(self) -> int:
        return len(self.states) - 1

    def copy(self) -> "StateStackGrammar":
        return type(self)(self.compiled)
