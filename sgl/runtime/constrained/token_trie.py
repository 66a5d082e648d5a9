"""The vocabulary as a byte trie, the table the native grammar engine walks for masks.

`TokenTrie.of(tok)` builds the trie once per tokenizer (memoized on it): the distinct
byte strings of the usable tokens (EOS and empty ones left out, as VocabWalker does)
sorted, their prefixes as nodes in preorder with byte, depth and the end of each subtree,
and the token ids ending at each node (several ids may share bytes), and the set of bytes
in each node's subtree (a walk standing in a state that every one of them loops on
allows the whole subtree at once: most of a JSON string body's tokens), and the nodes where
tokens end listed depth by depth in preorder (a subtree's nodes at one depth are one range
there: a walk whose path dies after a few bytes, a counted string near its bound, takes
the subtree's short tokens without visiting its deep nodes). One word per node:
byte | depth << 8 | 1 << 24 where tokens end (native/pushdown_walk.c reads only it and
`next` in its hot loop). A walk steps each node once from its parent's state and skips
the whole subtree of a node whose step dies, so a mask costs the live part of the trie.
"""

from __future__ import annotations

import numpy as np

from .vocab import TokenizerInfo

_MAX_DEPTH = 0xFFFF  # depth bits of a node word


class TokenTrie:
    def __init__(self, tok: TokenizerInfo) -> None:
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
        parent = np.full(n, -1, dtype=np.int64)
        stack: list[int] = []  # open nodes, depths strictly increasing
        for i, d in enumerate(depth):
            while stack and depth[stack[-1]] >= d:
                nxt[stack.pop()] = i
            if stack:
                parent[i] = stack[-1]
            stack.append(i)
        if max(depth, default=0) > _MAX_DEPTH:
            raise ValueError(f"a vocabulary token is longer than {_MAX_DEPTH} bytes")
        self.node = (np.array(byte, dtype=np.uint32) | np.array(depth, dtype=np.uint32) << 8
                     | (np.array(tok_count) > 0).astype(np.uint32) << 24)
        self.next = nxt
        self.tok_start = np.concatenate([[0], np.cumsum(tok_count)]).astype(np.int32)
        self.tok_ids = np.array(tok_ids, dtype=np.int32)
        self.sub_bytes, self.height = _subtrees(np.array(byte, dtype=np.int64), np.array(depth), parent)
        self.vocab_size = tok.vocab_size
        self.num_nodes = n
        self.max_depth = max(depth, default=0)
        self.level_nodes, self.level_off = _levels(np.array(depth, dtype=np.int64), np.array(tok_count) > 0,
                                                   self.max_depth)

    @staticmethod
    def of(tok: TokenizerInfo) -> "TokenTrie":
        return tok.memo("token_trie", lambda: TokenTrie(tok))


def _levels(depth: np.ndarray, has_tokens: np.ndarray, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The nodes where tokens end, by depth and within a depth in preorder (int32), and
    where each depth starts (int32 [max_depth + 2]: depth d is [off[d], off[d + 1]))."""
    idx = np.nonzero(has_tokens)[0]
    order = np.lexsort((idx, depth[idx]))  # stable by depth, then index
    nodes = idx[order].astype(np.int32)
    off = np.searchsorted(depth[nodes], np.arange(max_depth + 2)).astype(np.int32)
    return nodes, off


def _subtrees(byte: np.ndarray, depth: np.ndarray, parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per node: the bytes of its subtree as a 256-bit set, itself included (uint64 [n, 4]),
    and the subtree's height (int32, a leaf: 1); children folded into parents, deepest
    level first."""
    n = byte.size
    bits = np.zeros((n, 4), dtype=np.uint64)
    bits[np.arange(n), byte >> 6] = np.left_shift(np.uint64(1), (byte & 63).astype(np.uint64))
    height = np.ones(n, dtype=np.int32)
    for d in range(int(depth.max(initial=0)), 1, -1):
        idx = np.nonzero(depth == d)[0]
        for w in range(4):
            np.bitwise_or.at(bits[:, w], parent[idx], bits[idx, w])
        np.maximum.at(height, parent[idx], height[idx] + 1)
    return bits, height
