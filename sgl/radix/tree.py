"""Radix tree from token-id sequences to KV slot indices (RadixAttention's prefix cache).

Every edge holds a run of tokens (``key``) and the KV-pool slot of each of those tokens
(``value``, same length). A path from the root spells a cached token prefix; its values,
concatenated, are the slots that already hold that prefix's keys and values, so a new
request sharing the prefix skips recomputing it. Children are indexed by their first
token, so siblings never share a first token and lookup is one dict hit per edge.

A match (or insert) that ends inside an edge splits it, so the returned node covers
exactly the matched tokens. The original node object keeps the *tail*, so any caller
already holding it (e.g. with a lock) still holds the same tokens::

    before: match [1, 2, 9]          after
    root ─ [1,2,3,4] (N)             root ─ [1,2] (P, new) ─ [3,4] (N, same object)
                                     last_node = P, values = slots of [1, 2]

Locks and eviction. ``node.lock_ref`` counts locks taken on the node *or any of its
descendants* (``inc_lock_ref`` walks up to the root), so a locked path can never lose an
ancestor. Every stored token is in exactly one of two counters: ``evictable`` (its node
has lock_ref 0) or ``protected`` (lock_ref > 0); tokens move between them only when a
node's lock_ref crosses 0 <-> 1, which keeps ``evictable_size()`` O(1). Eviction pops
unlocked leaves from a min-heap keyed by ``last_access`` (a logical clock, ticked once per
match/insert). Entries are never removed in place; an entry is stale when its node is
gone, locked, no longer a leaf, or was touched since, and is skipped when popped. When
a leaf is freed and its parent becomes an unlocked leaf, the parent is pushed and may be
evicted in the same call. Nodes are never re-merged after eviction; that only costs a
dict hop.

Observers. ``tree.observer`` (default None) is told of every structural change: a leaf
added by ``insert``, an edge split, a node evicted, the tree reset. It sees nodes, not
slots, and must not change the tree; with no observer the only cost is one attribute
test per change. (The worker's KV-event publisher is one: it turns the token-granular
tree into fixed-size page events.)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["MatchResult", "RadixTree", "TreeNode", "TreeObserver"]

_ids = itertools.count()


@dataclass(eq=False, slots=True)
class TreeNode:
    """One edge of the tree: the tokens ``key`` and their KV slots ``value``.

    Compared by identity (eq=False) so nodes can live in sets and heap entries.
    """

    key: list[int] = field(default_factory=list)
    value: list[int] = field(default_factory=list)
    children: dict[int, TreeNode] = field(default_factory=dict)
    parent: TreeNode | None = None
    lock_ref: int = 0
    last_access: int = 0
    # Tie-breaker for heap entries with equal last_access; never compared as data.
    id: int = field(default_factory=lambda: next(_ids))

    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class MatchResult:
    """Slots of the longest cached prefix of a key and the node that ends it."""

    values: list[int]
    last_node: TreeNode


class TreeObserver(Protocol):
    """Told of each structural change, after it happened (see the module docstring)."""

    def node_added(self, node: TreeNode) -> None:
        """``insert`` attached the new leaf ``node`` under ``node.parent``."""

    def node_split(self, prefix: TreeNode, tail: TreeNode) -> None:
        """An edge was cut: ``prefix`` (new, the head tokens) now has the old node ``tail`` as its child."""

    def node_evicted(self, node: TreeNode, parent: TreeNode) -> None:
        """``node`` (a leaf, now detached) was evicted from under ``parent``; its tokens are no longer cached."""

    def tree_reset(self) -> None:
        """Everything was dropped (``reset``)."""


def _common_len(a: Sequence[int], b: Sequence[int], start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``."""
    n = min(len(a), len(b) - start)
    # Fast path: the whole edge matches (the common case on a cache hit).
    head = b[start : start + n]
    if (head if isinstance(head, list) else list(head)) == a[:n]:
        return n
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class RadixTree:
    """Prefix cache over token ids; see the module docstring for the structure."""

    def __init__(self, disable: bool = False) -> None:
        self.disable = disable
        self.observer: TreeObserver | None = None
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Drop everything. The caller frees the slots first (see ``all_values``)."""
        self.root = TreeNode()
        self._evictable = 0
        self._protected = 0
        self._clock = 0
        self._num_nodes = 0  # excluding the root; bounds the lazy heap's garbage
        self._heap: list[tuple[int, int, TreeNode]] = []
        if self.observer is not None:
            self.observer.tree_reset()

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def all_values(self) -> list[int]:
        out: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.value)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``key``; splits the last edge so ``last_node`` ends the match."""
        if self.disable:
            return MatchResult([], self.root)
        now = self._tick()
        node = self.root
        values: list[int] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            k = _common_len(child.key, key, pos)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            values.extend(child.value)
            node = child
            pos += k
        if node is not self.root and node.is_leaf():
            self._push(node)
        return MatchResult(values, node)

    # ----------------------------------------------------------------- insert
    def prefix_len(self, key: Sequence[int]) -> int:
        """Length of the longest cached prefix of ``key``, read-only: no split, no LRU touch
        (for load estimates and routers, which must not disturb eviction order)."""
        node, pos, n = self.root, 0, len(key)
        while pos < n:
            child = node.children.get(key[pos])
            if child is None:
                break
            k = _common_len(child.key, key, pos)
            pos += k
            if k < len(child.key):
                break
            node = child
        return pos

    def insert(self, key: Sequence[int], value: Sequence[int]) -> int:
        """Store ``key -> value``; return how many leading tokens were already cached.

        The tree keeps its own slots for ``key[:ret]`` and takes ownership of
        ``value[ret:]``. Slots in ``value[:ret]`` that are not the tree's own (the
        caller's freshly computed duplicates) stay the caller's to free.
        """
        if len(key) != len(value):
            raise ValueError(
                f"insert needs one slot per token: got {len(key)} tokens and {len(value)} slots"
            )
        if self.disable:
            return 0
        now = self._tick()
        node = self.root
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(
                    key=list(key[pos:]), value=list(value[pos:]), parent=node, last_access=now
                )
                node.children[leaf.key[0]] = leaf
                self._num_nodes += 1
                self._evictable += len(leaf.key)
                self._push(leaf)
                if self.observer is not None:
                    self.observer.node_added(leaf)
                return pos
            k = _common_len(child.key, key, pos)
            if k < len(child.key) and pos + k < len(key):
                # Diverges inside the edge: split so the new tail hangs off the prefix.
                child = self._split(child, k)
            child.last_access = now
            node = child
            pos += k
            if k < len(child.key):
                break  # key ends inside this edge: all of it is cached, no split needed
        if node is not self.root and node.is_leaf():
            self._push(node)
        return len(key)

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction until ``dec_lock_ref``."""
        self._check_attached(node)
        n: TreeNode | None = node
        while n is not None:
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._protected += len(n.key)
            n.lock_ref += 1
            n = n.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``."""
        self._check_attached(node)
        if node.lock_ref <= 0:
            raise ValueError("dec_lock_ref on a node that is not locked (unbalanced unlock)")
        n: TreeNode | None = node
        while n is not None:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += len(n.key)
                self._protected -= len(n.key)
                if n.is_leaf() and n is not self.root:
                    self._push(n)
            n = n.parent

    # ------------------------------------------------------------------ evict
    def evict(self, num_tokens: int, free_fn: Callable[[list[int]], None]) -> int:
        """Free LRU unlocked leaves until ``num_tokens`` are freed or none is left.

        ``free_fn`` receives each evicted node's slots exactly once. Returns tokens freed
        (may exceed ``num_tokens``: nodes are freed whole).
        """
        freed = 0
        while freed < num_tokens and self._heap:
            entry = heapq.heappop(self._heap)
            node = entry[2]
            if not self._is_candidate(node, entry[0]):
                continue
            try:
                free_fn(node.value)
            except BaseException:
                heapq.heappush(self._heap, entry)  # tree unchanged; keep it evictable
                raise
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.parent = None  # marks the node detached for stale heap entries
            self._num_nodes -= 1
            self._evictable -= len(node.key)
            freed += len(node.key)
            if self.observer is not None:
                self.observer.node_evicted(node, parent)
            if parent is not self.root and parent.lock_ref == 0 and parent.is_leaf():
                self._push(parent)
        return freed

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Recount everything and raise AssertionError on any inconsistency."""
        root = self.root
        assert root.key == [] and root.value == [] and root.parent is None, "bad root"
        assert root.lock_ref >= 0, "root lock_ref < 0"
        evictable = protected = nodes = 0
        seen: set[int] = set()
        unlocked_leaves: set[TreeNode] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for first, child in node.children.items():
                assert child.parent is node, "child.parent does not point at its parent"
                assert child.key, "empty key on a non-root node"
                assert child.key[0] == first, "child indexed under the wrong first token"
                assert len(child.key) == len(child.value), "len(key) != len(value)"
                assert child.lock_ref >= 0, "lock_ref < 0"
                assert child.lock_ref <= node.lock_ref, "child lock_ref > parent lock_ref"
                child_locks += child.lock_ref
                nodes += 1
                if child.lock_ref:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
                    if child.is_leaf():
                        unlocked_leaves.add(child)
                for v in child.value:
                    assert v not in seen, f"slot {v} stored twice"
                    seen.add(v)
                stack.append(child)
            # lock_ref = own locks + children's lock_refs, and own locks >= 0.
            assert node.lock_ref >= child_locks, "lock_ref below the sum of its children's"
        assert evictable == self._evictable, f"evictable {self._evictable} != recount {evictable}"
        assert protected == self._protected, f"protected {self._protected} != recount {protected}"
        assert nodes == self._num_nodes, f"node count {self._num_nodes} != recount {nodes}"
        live = {e[2] for e in self._heap if self._is_candidate(e[2], e[0])}
        assert unlocked_leaves <= live, "an unlocked leaf has no live heap entry"

    # --------------------------------------------------------------- helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut ``node`` after ``k`` tokens; return the new prefix node (node keeps the tail)."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.key)
        prefix = TreeNode(
            key=node.key[:k],
            value=node.value[:k],
            parent=parent,
            # Every lock counted on node is on node or below, hence below prefix too.
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        node.key = node.key[k:]
        node.value = node.value[k:]
        node.parent = prefix
        prefix.children[node.key[0]] = node
        parent.children[prefix.key[0]] = prefix
        self._num_nodes += 1
        if self.observer is not None:
            self.observer.node_split(prefix, node)
        return prefix

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        # Lazy deletion leaves garbage; compact when it dominates so memory stays O(nodes).
        if len(self._heap) > 2 * self._num_nodes + 64:
            live: dict[int, tuple[int, int, TreeNode]] = {}
            for e in self._heap:
                if self._is_candidate(e[2], e[0]):
                    live[e[1]] = e
            self._heap = list(live.values())
            heapq.heapify(self._heap)

    def _is_candidate(self, node: TreeNode, stamp: int) -> bool:
        return (
            node.parent is not None
            and node.lock_ref == 0
            and not node.children
            and node.last_access == stamp
        )

    def _check_attached(self, node: TreeNode) -> None:
        n = node
        while n.parent is not None:
            if n.parent.children.get(n.key[0]) is not n:
                break
            n = n.parent
        if n is not self.root:
            raise ValueError("node is not in this tree (evicted, reset, or from another tree)")
