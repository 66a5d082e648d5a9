"""The native engine's trie walk (native/pushdown_walk.c over token_trie.py) gives exactly
the numpy walk's masks, state by state; without a C compiler the numpy backend serves."""

from __future__ import annotations

import numpy as np
import pytest

from sgl.runtime.constrained import registry
from sgl.runtime.constrained.lazy_regex import CompiledLazyRegex, VocabWalker
from sgl.runtime.constrained.native import binding
from sgl.runtime.constrained.native.binding import NativeEngine, config_of
from sgl.runtime.constrained.native.compiled import CompiledNative
from sgl.runtime.constrained.native.shorthand import shorthand_tables
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


def _engine(regex: str, tok: TokenizerInfo) -> tuple[NativeEngine, np.ndarray]:
    """A one-machine engine with every state expanded, and its table."""
    eng = NativeEngine(1, "regex")
    assert eng.set_regex(0, regex, calls=False, uni=shorthand_tables())
    eng.finalize(0)
    CompiledNative(eng, tok, "regex")  # hands the engine the trie
    trans, _ = eng.export(0)
    return eng, trans


def _mask(eng: NativeEngine, tok: TokenizerInfo, state: int) -> np.ndarray:
    out = np.zeros(tok.vocab_size, dtype=bool)
    eng.mask_into(config_of([1, 2, 0, state]), out)
    return out


REGEXES = [
    r'\{"name": "[^"\\]{0,40}", "age": [0-9]{1,3}, "bio": "([^"\\]|\\.)*"\}',
    r"[-+]?[0-9]+[ \n]*",
    r"(yes|no|maybe)",
    r"[a-z ]{3,12}\.",
    r"(\w+@\w+\.com)",
    r"(?:[^\x00-\x1f]|\\n){0,24}!",  # counted runs: subtrees allowed whole up to the count
    # runs that die after a few bytes (a counted string near its bound): short tokens taken by
    # depth and by the run's token slice, the rest never walked
    r'"[a-z]{0,5}"',
    r"[0-9a-f]{40}",
    r'(?:[^"\\]|\\.){2,30}"x',
    r"[a-z]{2,9}(?:ab|\.c)",  # the run forks (b, c after a-z) instead of dying
    r"[ab]{0,3}[a-z]{0,3}q",  # a run whose last bytes live in a narrower class
]


@pytest.mark.parametrize("regex", REGEXES)
def test_native_walk_equals_numpy_walk_on_every_state(real_tok: TokenizerInfo, regex: str) -> None:
    eng, trans = _engine(regex, real_tok)
    w = VocabWalker.of(real_tok)
    nonempty = 0
    for s in range(trans.shape[0]):
        a = w.allowed(trans, s)
        b = _mask(eng, real_tok, s)
        assert np.array_equal(a, b), (regex, s, np.nonzero(a != b)[0][:10])
        nonempty += bool(b.any())
    assert nonempty > 0


def test_small_vocabulary_with_duplicates_prefixes_and_specials() -> None:
    # ids: 0 eos, 1 special (None), two ids share "ab", "a" is a prefix of "ab" / "abc", "" is dropped
    tokens = ["</s>", None, "a", "ab", "ab", "abc", "b", "ba", "c", "cab", "", "bb"]
    tok = TokenizerInfo.from_tokens(tokens, kind="raw", special_ids=[0], eos_token_ids=[0])
    eng, trans = _engine(r"(ab|ba)*c?", tok)
    for s in range(trans.shape[0]):
        assert np.array_equal(_mask(eng, tok, s), _brute(tok, trans, s)), s
    start = _mask(eng, tok, 0)
    assert set(np.nonzero(start)[0].tolist()) == {2, 3, 4, 5, 6, 7, 8}  # not "cab", "bb", eos, specials


def test_subtree_tables(real_tok: TokenizerInfo) -> None:
    """Every node's byte set and height cover exactly its subtree (what lets a walk
    allow a subtree at once)."""
    t = TokenTrie.of(real_tok)
    depth = (t.node >> 8) & 0xFFFF
    rng = np.random.default_rng(0)
    for i in rng.choice(t.num_nodes, 300, replace=False).tolist() + [0]:
        sub = range(i, int(t.next[i]))
        bits = [0, 0, 0, 0]
        for j in sub:
            b = int(t.node[j] & 0xFF)
            bits[b >> 6] |= 1 << (b & 63)
        assert [int(x) for x in t.sub_bytes[i]] == bits, i
        assert int(t.height[i]) == max(int(depth[j]) for j in sub) - int(depth[i]) + 1, i


def test_level_lists(real_tok: TokenizerInfo) -> None:
    """Nodes where tokens end, by depth and in preorder within a depth: every such node
    once, at its own depth (a subtree's tokens of one depth are then one range)."""
    t = TokenTrie.of(real_tok)
    depth = (t.node >> 8) & 0xFFFF
    has = (t.node >> 24) & 1
    assert t.level_off[0] == 0 and t.level_off[-1] == t.level_nodes.size == int(has.sum())
    for d in range(t.max_depth + 1):
        level = t.level_nodes[t.level_off[d]:t.level_off[d + 1]]
        assert np.all(np.diff(level) > 0), d
        assert np.all(depth[level] == d) and np.all(has[level] == 1), d
        assert level.size == int(((depth == d) & (has == 1)).sum()), d


def test_without_a_compiler_the_numpy_backend_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = TokenizerInfo.from_tokens(["</s>", "x", "xy"], kind="raw", special_ids=[0], eos_token_ids=[0])
    binding._lib.clear()
    try:
        monkeypatch.setenv("CC", "/nonexistent/cc")  # a compiler that cannot run: no library
        monkeypatch.setenv("SGL_CACHE_DIR", "/nonexistent-cache-dir")  # no library built earlier
        monkeypatch.setenv("SGL_GRAMMAR_DISK_CACHE", "0")
        assert not binding.available() and registry.regex_backend() == "lazy"
        c = registry.compile_tables("regex", r"xy?", tok, use_cache=False)
        assert isinstance(c, CompiledLazyRegex)
        assert c.new_matcher().allowed_token_ids() == [1, 2]
    finally:
        binding._lib.clear()
