"""The vocabulary as a byte trie, walked against a byte DFA in C (trie_walk.c) for masks.

`TokenTrie.of(tok)` builds the trie once per tokenizer (memoized on it): the distinct
byte strings of the usable tokens (EOS and empty ones left out, as VocabWalker does)
sorted, their prefixes as nodes in preorder with byte, depth and the end of each subtree,
and the token ids ending at each node (several ids may share bytes). `allowed(trans,
state)` gives the same bool mask as VocabWalker.allowed: a token is allowed iff every
one of its bytes has a live transition. Where the C library cannot be built, `of`
returns None and callers keep the numpy walk.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from sgl.runtime.native.build import build_library

from .vocab import TokenizerInfo

_SRC = Path(__file__).with_name("trie_walk.c")
_lib: list[ctypes.CDLL | None] = []
_P = ctypes.c_void_p
_MAX_DEPTH = 0xFFFF  # depth bits of a node word (trie_walk.c)


def _library() -> ctypes.CDLL | None:
    if not _lib:
        lib = build_library("trie_walk", [_SRC])
        if lib is not None:
            lib.sgl_trie_walk.restype = ctypes.c_int64
            lib.sgl_trie_walk.argtypes = [_P, ctypes.c_int32, _P, _P, _P, _P, ctypes.c_int32, ctypes.c_int32, _P]
        _lib.append(lib)
    return _lib[0]


class TokenTrie:
    def __init__(self, tok: TokenizerInfo, lib: ctypes.CDLL) -> None:
        eos = set(tok.eos_token_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(tok.token_bytes):
            if b and i not in eos:
                by_bytes.setdefault(b, []).append(i)
        byte: list[int] = []
        depth: list[int] = []
        tok_count: list[int] = []
        tok_ids: list[int] = []
        prev = b""
        for s in sorted(by_bytes):
            lcp = 0
            for a, c in zip(prev, s):
                if a != c:
                    break
                lcp += 1
            for k in range(lcp, len(s)):  # new nodes: the prefixes of s longer than the common part
                byte.append(s[k])
                depth.append(k + 1)
                tok_count.append(0)
            tok_count[-1] = len(by_bytes[s])  # sorted order: s's last node is always new
            tok_ids += by_bytes[s]
            prev = s
        n = len(byte)
        nxt = np.full(n, n, dtype=np.int32)
        stack: list[int] = []  # open nodes, depths strictly increasing
        for i, d in enumerate(depth):
            while stack and depth[stack[-1]] >= d:
                nxt[stack.pop()] = i
            stack.append(i)
        if max(depth, default=0) > _MAX_DEPTH:
            raise ValueError(f"a vocabulary token is longer than {_MAX_DEPTH} bytes")
        # One word per node (trie_walk.c): byte | depth << 8 | 1 << 24 where tokens end.
        self.node = (np.array(byte, dtype=np.uint32) | np.array(depth, dtype=np.uint32) << 8
                     | (np.array(tok_count) > 0).astype(np.uint32) << 24)
        self.next = nxt
        self.tok_start = np.concatenate([[0], np.cumsum(tok_count)]).astype(np.int32)
        self.tok_ids = np.array(tok_ids, dtype=np.int32)
        self.vocab_size = tok.vocab_size
        self.num_nodes = n
        self.max_depth = max(depth, default=0)
        self._lib = lib

    @staticmethod
    def of(tok: TokenizerInfo) -> "TokenTrie | None":
        def build() -> "TokenTrie | None":
            lib = _library()
            return TokenTrie(tok, lib) if lib is not None else None

        return tok.memo("token_trie", build)

    def allowed(self, trans: np.ndarray, state: int) -> np.ndarray:
        """Bool [vocab_size]: tokens whose bytes all have live transitions from `state`."""
        if trans.dtype != np.int32 or not trans.flags.c_contiguous or trans.shape[1] != 256:
            trans = np.ascontiguousarray(trans, dtype=np.int32)
        out = np.zeros(self.vocab_size, dtype=bool)
        self._lib.sgl_trie_walk(trans.ctypes.data, int(state), self.node.ctypes.data, self.next.ctypes.data,
                                self.tok_start.ctypes.data, self.tok_ids.ctypes.data, self.num_nodes, self.max_depth,
                                out.ctypes.data)
        return out
