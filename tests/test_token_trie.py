"""The C trie walk (token_trie.py / trie_walk.c) gives exactly the numpy walk's masks."""

from __future__ import annotations

import numpy as np
import pytest

from sgl.runtime.constrained import token_trie
from sgl.runtime.constrained.lazy_regex import VocabWalker
from sgl.runtime.constrained.registry import compile_tables
from sgl.runtime.constrained.token_trie import TokenTrie
from sgl.runtime.constrained.vocab import TokenizerInfo
from sgl.runtime.models.loader import embedded_gguf_path


@pytest.fixture(scope="module")
def real_tok() -> TokenizerInfo:
    return TokenizerInfo.from_gguf(str(embedded_gguf_path()))


def _brute(tok: TokenizerInfo, trans: np.ndarray, state: int) -> np.ndarray:
    out = np.zeros(tok.vocab_size, dtype=bool)
    for i, b in enumerate(tok.token_bytes):
        if not b or i in tok.eos_token_ids:
            continue
        s = state
        for c in b:
            s = int(trans[s, c])
            if s < 0:
                break
        out[i] = s >= 0
    return out


REGEXES = [
    r'\{"name": "[^"\\]{0,40}", "age": [0-9]{1,3}, "bio": "([^"\\]|\\.)*"\}',
    r"[-+]?[0-9]+[ \n]*",
    r"(yes|no|maybe)",
    r"[a-z ]{3,12}\.",
    r"(\w+@\w+\.com)",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_trie_walk_equals_numpy_walk_on_every_state(real_tok: TokenizerInfo, regex: str) -> None:
    c = compile_tables("regex", regex, real_tok, use_cache=False)
    w = VocabWalker.of(real_tok)
    trie = TokenTrie.of(real_tok)
    assert trie is not None and w.trie is trie
    nonempty = 0
    for s in range(c.num_states):
        a = w.allowed_numpy(c.trans, s)
        b = trie.allowed(c.trans, s)
        assert np.array_equal(a, b), (regex, s, np.nonzero(a != b)[0][:10])
        nonempty += bool(b.any())
    assert nonempty > 0


def test_small_vocabulary_with_duplicates_prefixes_and_specials() -> None:
    # ids: 0 eos, 1 special (None), two ids share "ab", "a" is a prefix of "ab" / "abc", "" is dropped
    tokens = ["</s>", None, "a", "ab", "ab", "abc", "b", "ba", "c", "cab", "", "bb"]
    tok = TokenizerInfo.from_tokens(tokens, kind="raw", special_ids=[0], eos_token_ids=[0])
    c = compile_tables("regex", r"(ab|ba)*c?", tok, use_cache=False)
    trie = TokenTrie.of(tok)
    assert trie is not None
    for s in range(c.num_states):
        got = trie.allowed(c.trans, s)
        assert np.array_equal(got, _brute(tok, c.trans, s)), s
    start = trie.allowed(c.trans, c.initial)
    assert set(np.nonzero(start)[0].tolist()) == {2, 3, 4, 5, 6, 7, 8}  # not "cab", "bb", eos, specials


def test_without_a_compiler_the_numpy_walk_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = TokenizerInfo.from_tokens(["</s>", "x", "xy"], kind="raw", special_ids=[0], eos_token_ids=[0])
    token_trie._lib.clear()
    try:
        monkeypatch.setenv("CC", "/nonexistent/cc")  # a compiler that cannot run: no library
        assert TokenTrie.of(tok) is None
        w = VocabWalker(tok)
        c = compile_tables("regex", r"xy?", tok, use_cache=False)
        assert w.trie is None
        assert w.allowed(c.trans, c.initial).tolist() == [False, True, True]
    finally:
        token_trie._lib.clear()
