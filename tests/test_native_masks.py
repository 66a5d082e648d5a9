"""The native engine's token masks on JSON Schema and GBNF machines equal a
token-by-token step check: a token is allowed iff stepping its bytes leaves a stack.
This covers what the single-machine walk tests (test_token_trie.py) cannot: calls,
frame walks with a sentinel below, pops where a callee's counted run accepts early and
the caller takes more of the same bytes, and the shortcuts of mask_walk.c (runs that die
near a counted string's bound, token slices) on states reached by real instances.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sgl.runtime.constrained import registry
from sgl.runtime.constrained.native.binding import available
from sgl.runtime.constrained.native.compiled import CompiledNative
from tests.grammar_helpers import compiled

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler: the native engine is off")

CASES = [
    # inline counted strings: a run that dies at maxLength; minLength makes the path accept
    ({"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "string", "maxLength": 25}, "b": {"type": "string", "minLength": 3, "maxLength": 8}}},
     {"a": "hello world, hi", "b": "abcdefg"}),
    # strings in called machines: frame walks with a sentinel below, exits into the caller
    ({"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 6}}, ["ab", "cdefgh", "", "x"]),
    # a pattern of a fixed width (the run dies after it)
    ({"type": "object", "required": ["id"], "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{12}$"}}},
     {"id": "0123456789ab"}),
    # a bound past the inline count: block machines, a pop at each block end
    ({"type": "string", "minLength": 1030, "maxLength": 2100}, "y" * 1020 + "zz wq" * 5 + "a\\\"b"),
]


GBNF_CASES = [
    # a rule whose counted run accepts early, then the caller takes more of the same bytes:
    # a token running past the callee's bound lives through the pop
    ('root ::= "(" x x ")"\nx ::= [a-z] [a-z]? [a-z]? | "(" x ")"', b"(abcde)"),  # recursive: a called machine
    ('root ::= item ("," item)*\nitem ::= [0-9] [0-9]? "x"?', b"1,23,4x,56"),
]


def _greedy_ids(tok, text: bytes) -> list[int]:
    """Longest-match token ids spelling `text` (any spelling does: masks are checked on
    the states it passes through)."""
    eos = set(tok.eos_token_ids)
    by_bytes = {b: t for t, b in enumerate(tok.token_bytes) if b and t not in eos}
    longest = max(len(b) for b in by_bytes)
    ids, i = [], 0
    while i < len(text):
        n = min(longest, len(text) - i)
        while text[i:i + n] not in by_bytes:
            n -= 1
        ids.append(by_bytes[text[i:i + n]])
        i += n
    return ids


def _brute(c: CompiledNative, cfg: bytes) -> np.ndarray:
    out = np.zeros(c.tok.vocab_size, dtype=bool)
    eos = set(c.tok.eos_token_ids)
    for t, b in enumerate(c.tok.token_bytes):
        if b and t not in eos:
            out[t] = c.step_bytes(cfg, b) is not None
    return out


@pytest.mark.parametrize("schema,instance", CASES, ids=["inline", "called", "pattern", "blocks"])
def test_masks_equal_stepping_every_token(tok, monkeypatch, no_grammar_disk_cache, schema, instance) -> None:
    monkeypatch.setenv("SGL_REGEX_BACKEND", "native")
    c = compiled(schema, tok)
    assert isinstance(c, CompiledNative)
    text = json.dumps(instance, separators=(",", ":")).encode()
    ids = _greedy_ids(tok, text)
    cfg, checked = c.initial, 0
    offsets = np.cumsum([0] + [len(tok.token_bytes[t]) for t in ids])
    near_block_end = {i for i, o in enumerate(offsets[:-1]) if 1000 <= o % 1024 <= 1024}  # pops at 1,024 chars
    positions = set(range(0, len(ids), max(1, len(ids) // 10))) | {len(ids) - 1, len(ids) - 2} | near_block_end
    for i, t in enumerate(ids):
        if i in positions:
            got = c.token_mask(cfg)
            want = _brute(c, cfg)
            assert np.array_equal(got, want), (i, np.nonzero(got != want)[0][:10])
            checked += 1
        assert c.token_mask(cfg)[t], i  # the instance's own token is allowed
        cfg = c.next_config(cfg, t)
        assert cfg is not None, i
    assert c.can_end(cfg) and checked >= 5


@pytest.mark.parametrize("grammar,text", GBNF_CASES, ids=["words", "items"])
def test_cfg_masks_equal_stepping_every_token(tok, monkeypatch, no_grammar_disk_cache, grammar, text) -> None:
    monkeypatch.setenv("SGL_REGEX_BACKEND", "native")
    c = registry.compile_tables("ebnf", grammar, tok, use_cache=False)
    assert isinstance(c, CompiledNative)
    cfg = c.initial
    for i, t in enumerate(_greedy_ids(tok, text)):
        got, want = c.token_mask(cfg), _brute(c, cfg)
        assert np.array_equal(got, want), (i, np.nonzero(got != want)[0][:10])
        cfg = c.next_config(cfg, t)
        assert cfg is not None, i
    assert c.can_end(cfg)
