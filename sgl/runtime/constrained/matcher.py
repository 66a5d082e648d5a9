"""Public grammar matcher, usable without the engine (benchmarks, tests, users).

`GrammarMatcher(kind, spec, tokenizer_info)` wraps a compiled grammar with a
forgiving interface: `accept_token` answers False instead of raising, `accept_string`
advances by text (one rollback step per call), and `allowed_token_ids` lists the mask.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import GrammarError
from .registry import compile_grammar
from .vocab import TokenizerInfo


class GrammarMatcher:
    def __init__(self, kind: str, spec: Any, tokenizer_info: TokenizerInfo) -> None:
        self.kind = kind
        self.tokenizer_info = tokenizer_info
        self._g: Any = compile_grammar(kind, spec, tokenizer_info)

    @classmethod
    def _wrap(cls, g: Any, kind: str, tok: TokenizerInfo) -> "GrammarMatcher":
        m = cls.__new__(cls)
        m.kind, m.tokenizer_info, m._g = kind, tok, g
        return m

    @property
    def grammar(self) -> Any:
        """The underlying Grammar-protocol object (what the scheduler holds)."""
        return self._g

    def allowed_token_ids(self) -> list[int]:
        return self._g.allowed_token_ids()

    def fill_mask(self, row: torch.Tensor) -> None:
        """Set True for allowed tokens in a bool row of width >= vocab_size."""
        self._g.fill_mask(row)

    def new_mask(self) -> torch.Tensor:
        row = torch.zeros(self.tokenizer_info.vocab_size, dtype=torch.bool)
        self._g.fill_mask(row)
        return row

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the token is not allowed."""
        try:
            self._g.accept_token(token_id)
            return True
        except GrammarError:
            return False

    def accept_string(self, s: str | bytes) -> bool:
        """Advance by text; False (state unchanged) if not a viable continuation."""
        data = s.encode("utf-8") if isinstance(s, str) else s
        try:
            self._g.accept_bytes(data)
            return True
        except GrammarError:
            return False

    def rollback(self, n: int) -> None:
        self._g.rollback(n)

    def is_terminated(self) -> bool:
        return self._g.is_terminated()

    def can_end(self) -> bool:
        """True where EOS would be accepted now."""
        return self._g.can_end()

    def jump_forward_string(self) -> str | None:
        return self._g.jump_forward_string()

    def copy(self) -> "GrammarMatcher":
        """A fresh matcher at the start state sharing compiled tables."""
        return GrammarMatcher._wrap(self._g.copy(), self.kind, self.tokenizer_info)
