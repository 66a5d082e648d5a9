"""llguidance as a grammar backend (`--grammar-backend llguidance`).

llguidance (Microsoft's Rust constrained-decoding engine: an Earley parser over a lexer,
masks from a token trie) compiles regex, JSON Schema, Lark and GBNF (through its own
GBNF -> Lark converter). Its tokenizer is built from our `TokenizerInfo` (token bytes;
ids without bytes become special tokens, spelled with llguidance's 0xFF prefix), once per
vocabulary. Masks come back as a packed bitmask and are unpacked into our bool row.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from .base import GrammarError
from .masks import or_into
from .vocab import TokenizerInfo, greedy_encode


class _Wrapper:
    """The duck-typed tokenizer llguidance.TokenizerWrapper expects."""

    def __init__(self, tok: TokenizerInfo) -> None:
        self.eos_token_id = tok.eos_token_ids[0]
        self.bos_token_id = None
        self.tokens = [b if b is not None else b"\xff<[%d]>" % i for i, b in enumerate(tok.token_bytes)]
        self.special_token_ids = [i for i, b in enumerate(tok.token_bytes) if b is None]
        self._tok = tok

    def __call__(self, s: bytes | str) -> list[int]:
        return greedy_encode(self._tok, s)


def llg_tokenizer(tok: TokenizerInfo) -> Any:
    """The llguidance LLTokenizer for `tok` (built once per vocabulary)."""
    got = tok._memo.get("llg_tokenizer")
    if got is None:
        import llguidance

        got = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapper(tok)),
                                     eos_token=list(tok.eos_token_ids))
        tok._memo["llg_tokenizer"] = got
    return got


def llg_grammar(kind: str, spec: str, json_whitespace: str | None = None) -> str:
    """Our constraint kinds -> an llguidance grammar string. `json_whitespace` (JSON
    Schema only): None llguidance's flexible default, "" compact, else a regex."""
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choices":
        from .regex_grammar import choices_to_regex

        return llguidance.LLMatcher.grammar_from_regex(choices_to_regex(json.loads(spec)))
    if kind == "json_schema":
        if json_whitespace is None:
            return llguidance.LLMatcher.grammar_from_json_schema(spec)
        ws = {"whitespace_pattern": json_whitespace} if json_whitespace else {"whitespace_flexible": False}
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=ws)
    try:
        lark_text = gbnf_to_lark(spec) if kind == "ebnf" else spec
    except Exception as e:  # noqa: BLE001 - its converter's errors are the user's grammar
        raise GrammarError(f"{kind}: invalid grammar ({e})") from None
    return llguidance.LLMatcher.grammar_from_lark(lark_text)


class CompiledLLG:
    """A validated llguidance grammar for one vocabulary; matchers share it."""

    def __init__(self, kind: str, spec: str, tok: TokenizerInfo, json_whitespace: str | None = None) -> None:
        import llguidance

        self.kind, self.tok = kind, tok
        self.lltok = llg_tokenizer(tok)
        self.grammar = llg_grammar(kind, spec, json_whitespace)
        error = llguidance.LLMatcher.validate_grammar(self.grammar, self.lltok)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"{kind}: llguidance refused the grammar ({error[:300]})")

    def new_matcher(self) -> "LLGGrammar":
        return LLGGrammar(self)


class LLGGrammar:
    """One request's position (Grammar protocol) on an llguidance LLMatcher."""

    def __init__(self, compiled: CompiledLLG) -> None:
        import llguidance

        self.compiled = compiled
        self.m = llguidance.LLMatcher(compiled.lltok, compiled.grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(f"{compiled.kind}: {self.m.get_error()}")
        self._eos = set(compiled.tok.eos_token_ids)

    def _mask(self) -> np.ndarray:
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little", count=self.compiled.tok.vocab_size).view(bool)

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        or_into(mask_row, self._mask())

    def allowed_token_ids(self) -> list[int]:
        return np.nonzero(self._mask())[0].tolist()

    def accept_token(self, token_id: int) -> None:
        if self.m.is_stopped() or not self.m.consume_token(int(token_id)) or self.m.is_error():
            raise GrammarError(f"{self.compiled.kind}: token {token_id} not allowed here")

    def accept_bytes(self, data: bytes) -> None:
        ids = greedy_encode(self.compiled.tok, data)
        if self.m.validate_tokens(ids) != len(ids):
            raise GrammarError(f"{self.compiled.kind}: text not allowed here")
        for t in ids:
            self.accept_token(t)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens")

    def is_terminated(self) -> bool:
        return self.m.is_stopped()

    def can_end(self) -> bool:
        return self.m.is_accepting()

    def jump_forward_string(self) -> str | None:
        data = self.m.compute_ff_bytes()
        if not data:
            return None
        text = data.decode("utf-8", errors="ignore")
        return text or None

    def copy(self) -> "LLGGrammar":
        return LLGGrammar(self.compiled)
