"""The grammar seam: what the decode loop needs from a constraint.

A grammar object tracks one request's position in its constraint. The scheduler calls
`fill_mask` before sampling, `accept_token` after, and `jump_forward_string` to learn a
string the constraint forces (so it can be appended without sampling). Backends
(outlines-core regex/JSON, lark CFG) live beside this file; `compile_grammar` in the
registry picks one by kind.
"""

from __future__ import annotations

from typing import Protocol

import torch


class GrammarError(ValueError):
    """An invalid or unsupported constraint spec; the message is shown to the user."""


class Grammar(Protocol):
    def fill_mask(self, mask_row: torch.Tensor) -> None:
        """Set True in `mask_row` (bool, width >= vocab) for every allowed next token.

        The row arrives all False. EOS is allowed only where the constraint may end.
        """

    def accept_token(self, token_id: int) -> None:
        """Advance by one token. Raises GrammarError if the token is not allowed."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (used by jump-forward retokenizing)."""

    def is_terminated(self) -> bool:
        """True once EOS was accepted, or the constraint can accept nothing more."""

    def jump_forward_string(self) -> str | None:
        """The longest string every continuation must start with from here, if any."""

    def copy(self) -> "Grammar":
        """A fresh matcher at the start state, sharing the compiled tables (n>1, forks)."""
