"""Shared pieces of the grammar tests: the embedded model's GGUF (wherever the package is
installed), its tokenizer info, and a cold JSON-schema compile plus a text-level check."""

from __future__ import annotations

import os
from typing import Any

from sgl.runtime.constrained import registry
from sgl.runtime.models.loader import embedded_gguf_path

GGUF = str(embedded_gguf_path())
GGUF_DIR = str(embedded_gguf_path().parent)


def compiled(schema: Any, tok: Any, compact: bool = True) -> Any:
    """Compiled tables for `schema`, bypassing the in-memory cache; compact JSON (the
    converter tests reason about canonical compact text) unless `compact=False` (then the
    server's default whitespace)."""
    var = "SGL_CONSTRAINED_JSON_DISABLE_ANY_WHITESPACE"
    old = os.environ.get(var)
    if compact:
        os.environ[var] = "1"
    try:
        return registry.compile_tables("json_schema", schema, tok, use_cache=False)
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old


def accepts_text(c: Any, text: str) -> bool:
    """Does a fresh matcher of `c` take all of `text` and may end there?"""
    g = c.new_matcher()
    try:
        g.accept_bytes(text.encode())
    except ValueError:
        return False
    return bool(g.can_end())
