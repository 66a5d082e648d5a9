"""Shared pieces of the grammar tests: the embedded model's GGUF (wherever the package is
installed), its tokenizer info, and a cold JSON-schema compile plus a text-level check."""

from __future__ import annotations

from typing import Any

from sgl.runtime.constrained import registry
from sgl.runtime.models.loader import embedded_gguf_path

GGUF = str(embedded_gguf_path())
GGUF_DIR = str(embedded_gguf_path().parent)


def compiled(schema: Any, tok: Any) -> Any:
    """Compiled tables for `schema`, bypassing the in-memory cache."""
    return registry.compile_tables("json_schema", schema, tok, use_cache=False)


def accepts_text(c: Any, text: str) -> bool:
    """Does a fresh matcher of `c` take all of `text` and may end there?"""
    g = c.new_matcher()
    try:
        g.accept_bytes(text.encode())
    except ValueError:
        return False
    return bool(g.can_end())
