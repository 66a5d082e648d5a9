"""Counting limits per backend (json_schema/context.Limits): the native engine counts
more (long strings inline as shared machines, big blocks, item counts past 64), and the
languages stay exact either way."""

from __future__ import annotations

import pytest

from sgl.runtime.constrained.json_schema import (LAZY_DFA, WHOLE_DFA, UnsupportedSchemaError,
                                                 schema_to_machines)
from tests.grammar_helpers import accepts_text, compiled

pytestmark = pytest.mark.usefixtures("no_grammar_disk_cache")


def test_item_counts_past_64_only_where_states_are_built_lazily() -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 100}
    with pytest.raises(UnsupportedSchemaError, match="maxItems"):
        schema_to_machines(schema, limits=WHOLE_DFA)
    schema_to_machines(schema, limits=LAZY_DFA)


def test_item_counts_are_exact_on_the_native_engine(tok, monkeypatch) -> None:
    monkeypatch.setenv("SGL_REGEX_BACKEND", "native")
    item = {"type": "object", "properties": {"k": {"type": "string", "enum": ["alpha", "beta", "gamma"]}},
            "required": ["k"], "additionalProperties": False}
    c = compiled({"type": "array", "items": item, "minItems": 2, "maxItems": 100}, tok)
    one = '{"k":"beta"}'
    for n, ok in [(0, False), (1, False), (2, True), (99, True), (100, True), (101, False)]:
        assert accepts_text(c, "[" + ",".join([one] * n) + "]") == ok, n


def test_long_strings_are_shared_machines(tok, monkeypatch) -> None:
    monkeypatch.setenv("SGL_REGEX_BACKEND", "native")
    props = {f"p{i}": {"type": "string", "maxLength": 3000} for i in range(6)}
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    spec = schema_to_machines(schema, limits=LAZY_DFA)
    assert len(spec.root) < 5000  # six properties, one counted-string machine between them
    c = compiled(schema, tok)
    assert accepts_text(c, '{"p0":"' + "é" * 3000 + '","p5":"x"}')
    assert not accepts_text(c, '{"p0":"' + "é" * 3001 + '"}')


@pytest.mark.parametrize("n", [0, 1023, 1024, 1025, 2047, 2048, 5000])
def test_block_counts_on_the_native_engine(tok, monkeypatch, n: int) -> None:
    """Past 4096 the native engine counts in blocks of 1024: exact at and around block
    boundaries, for a bound that is not a multiple of the block."""
    monkeypatch.setenv("SGL_REGEX_BACKEND", "native")
    c = compiled({"type": "string", "minLength": 1024, "maxLength": 5000}, tok)
    assert accepts_text(c, '"' + "a" * n + '"') == (1024 <= n <= 5000)
    assert not accepts_text(c, '"' + "a" * 5001 + '"')
