"""Page events from the radix tree: which fixed-size token pages the tree holds.

The tree is token-granular; KV events speak of pages of `page_size` tokens cut from each
path's first token (`sgl/kv_events/hashing.py`). A page is *held* while some path of the
tree is at least as deep as its last token, so it belongs to the node holding that last
token; a node is never shallower than its pages' ends, so this is exact under every
change the tree makes::

    path depth:   0 ........ 16 ........ 32 ........ 48 ....
    nodes:        [A: 0..20)      [B: 20..40)     [C: 40..45)
    pages:        p0 ends in A    p1 ends in B    (p2 would end at 48: not held)

- a new leaf (insert): hash the pages ending in it -> one `BlockStored` (its first page
  may start in an ancestor: those tokens are read from the path above);
- a split: the pages are shared out by end depth, no hashing, no event;
- an evicted leaf: its pages lost their last token -> `BlockRemoved`;
- a reset (flush_cache): `AllBlocksCleared`.

Each node's pages and the hash of the last page ending at or above it are cached, so an
insert hashes only its new pages. Events collect here until the worker takes them once
per scheduler iteration (`take_events`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl.kv_events.hashing import ROOT_HASH, page_hashes
from sgl.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from sgl.radix import TreeNode


@dataclass(slots=True)
class _Pages:
    end: int  # tokens from the root to this node's last token
    hashes: list[int]  # pages whose last token is in this node, in path order
    last: int  # hash of the deepest page ending in this node or above it (ROOT_HASH: none)


_ROOT = _Pages(0, [], ROOT_HASH)


class PageTracker:
    """A radix-tree observer (`sgl.radix.TreeObserver`) that emits vLLM page events.

    Install it on an empty tree (`tree.observer = tracker`); it keeps per-node state for
    every node from then on.
    """

    def __init__(self, page_size: int, medium: str = "CPU") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.medium = medium
        self._nodes: dict[TreeNode, _Pages] = {}
        self._events: list[KVEvent] = []

    # -- what the worker reads ------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """Events since the last call, in the order the tree changed."""
        out, self._events = self._events, []
        return out

    def held_hashes(self) -> set[int]:
        """Hashes of every page held now (announced and not removed since)."""
        return {h for p in self._nodes.values() for h in p.hashes}

    # -- TreeObserver -------------------------------------------------------------------------
    def node_added(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        above = self._pages(parent)
        size = self.page_size
        start = above.end - above.end % size  # first token of the page that ends first in node
        end = above.end + len(node.key)
        n = (end - start) // size
        if n == 0:
            self._nodes[node] = _Pages(end, [], above.last)
            return
        head = _path_tail(parent, above.end - start)
        tokens = head + node.key[: n * size - len(head)]
        hashes = page_hashes(tokens, size, above.last)
        self._nodes[node] = _Pages(end, hashes, hashes[-1])
        self._events.append(BlockStored(
            block_hashes=hashes, parent_block_hash=above.last if start else None, token_ids=tokens,
            block_size=size, lora_id=None, medium=self.medium))

    def node_split(self, prefix: TreeNode, tail: TreeNode) -> None:
        pages = self._nodes[tail]
        prefix_end = pages.end - len(tail.key)
        before = prefix_end - len(prefix.key)
        k = prefix_end // self.page_size - before // self.page_size  # pages ending in prefix
        assert prefix.parent is not None
        last = pages.hashes[k - 1] if k else self._pages(prefix.parent).last
        self._nodes[prefix] = _Pages(prefix_end, pages.hashes[:k], last)
        pages.hashes = pages.hashes[k:]

    def node_evicted(self, node: TreeNode, parent: TreeNode) -> None:
        pages = self._nodes.pop(node)
        if not pages.hashes:
            return
        prev = self._events[-1] if self._events else None
        if isinstance(prev, BlockRemoved) and prev.medium == self.medium:
            prev.block_hashes.extend(pages.hashes)  # one event for one eviction pass
        else:
            self._events.append(BlockRemoved(block_hashes=list(pages.hashes), medium=self.medium))

    def tree_reset(self) -> None:
        self._nodes.clear()
        self._events.append(AllBlocksCleared())

    # -- helpers ----------------------------------------------------------------------------------
    def _pages(self, node: TreeNode) -> _Pages:
        return _ROOT if node.parent is None else self._nodes[node]


def _path_tail(node: TreeNode, n: int) -> list[int]:
    """The last `n` tokens of the path from the root to `node` (n < page_size)."""
    parts: list[list[int]] = []
    cur: TreeNode | None = node
    while n > 0 and cur is not None:
        part = cur.key[-n:] if n < len(cur.key) else cur.key
        parts.append(part)
        n -= len(part)
        cur = cur.parent
    return [t for part in reversed(parts) for t in part]
