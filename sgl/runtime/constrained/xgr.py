"""xgrammar as a grammar backend (`--grammar-backend xgrammar`; SGLang's default engine).

Optional: `pip install xgrammar` (a CPU wheel exists). Its tokenizer info is built from
our `TokenizerInfo` as a raw byte vocabulary (ids without bytes get an empty entry and
are never allowed), once per vocabulary together with one compiler (xgrammar caches
compiled grammars itself). GBNF goes to `compile_grammar` (xgrammar's EBNF is GBNF),
Lark to `compile_lark`. Masks come back as an int32 bitmask row and are unpacked into
our bool row.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from .base import GrammarError
from .masks import or_into
from .vocab import TokenizerInfo


def _module() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise GrammarError("grammar backend 'xgrammar' is not installed (pip install xgrammar), "
                           "or pick another with --grammar-backend") from None
    return xgrammar


def xgr_compiler(tok: TokenizerInfo) -> Any:
    """One xgrammar GrammarCompiler per vocabulary."""
    got = tok._memo.get("xgr_compiler")
    if got is None:
        xgr = _module()
        vocab = [b if b is not None else b"" for b in tok.token_bytes]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                                 stop_token_ids=list(tok.eos_token_ids))
        got = tok._memo["xgr_compiler"] = xgr.GrammarCompiler(info, max_threads=1)
    return got


class CompiledXGR:
    """An xgrammar CompiledGrammar for one vocabulary; matchers share it."""

    def __init__(self, kind: str, spec: str, tok: TokenizerInfo, any_whitespace: bool = True) -> None:
        self.kind, self.tok = kind, tok
        comp = xgr_compiler(tok)
        try:
            if kind == "regex":
                self.compiled = comp.compile_regex(spec)
            elif kind == "choices":
                from .regex_grammar import choices_to_regex

                self.compiled = comp.compile_regex(choices_to_regex(json.loads(spec)))
            elif kind == "json_schema":
                # Compact is compact: xgrammar's default fixed separators are json.dumps's ", " / ": ".
                ws = {} if any_whitespace else {"any_whitespace": False, "separators": (",", ":")}
                self.compiled = comp.compile_json_schema(spec, **ws)
            elif kind == "ebnf":
                self.compiled = comp.compile_grammar(spec)
            else:
                self.compiled = comp.compile_lark(spec)
        except Exception as e:  # noqa: BLE001 - xgrammar raises its own types for bad specs
            raise GrammarError(f"{kind}: xgrammar refused the spec ({str(e)[:300]})") from None

    def new_matcher(self) -> "XGRGrammar":
        return XGRGrammar(self)


class XGRGrammar:
    """One request's position (Grammar protocol) on an xgrammar GrammarMatcher."""

    def __init__(self, compiled: CompiledXGR) -> None:
        xgr = _module()
        self.compiled = compiled
        self.m = xgr.GrammarMatcher(compiled.compiled)
        self._bits = xgr.allocate_token_bitmask(1, compiled.tok.vocab_size)

    def _mask(self) -> np.ndarray:
        self.m.fill_next_token_bitmask(self._bits, 0)
        words = self._bits[0].numpy().view(np.uint8)
        return np.unpackbits(words, bitorder="little", count=self.compiled.tok.vocab_size).view(bool)

    def fill_mask(self, mask_row: torch.Tensor) -> None:
        or_into(mask_row, self._mask())

    def allowed_token_ids(self) -> list[int]:
        return np.nonzero(self._mask())[0].tolist()

    def accept_token(self, token_id: int) -> None:
        if not self.m.accept_token(int(token_id)):
            raise GrammarError(f"{self.compiled.kind}: token {token_id} not allowed here")

    def accept_bytes(self, data: bytes) -> None:
        if not self.m.accept_string(data):
            raise GrammarError(f"{self.compiled.kind}: text not allowed here")

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def can_end(self) -> bool:
        if self.m.is_terminated():
            return True
        m = self._mask()
        return bool(m[list(self.compiled.tok.eos_token_ids)].any())

    def jump_forward_string(self) -> str | None:
        return self.m.find_jump_forward_string() or None

    def copy(self) -> "XGRGrammar":
        return XGRGrammar(self.compiled)
