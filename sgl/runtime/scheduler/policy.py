"""Waiting-queue order.

- fcfs: arrival order.
- lpm: longest cached prefix first, so requests that share a hot prefix run together
  while it is still in the tree (falls back to fcfs for very long queues, where
  matching every request each step would cost more than it saves).
- dfs-weight: walk the radix tree depth-first, heaviest subtree (most waiting requests)
  first, emitting requests where their match ends; siblings in the prompt tree run
  back to back, which keeps their shared prefix hot.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sgl.radix import RadixTree
from sgl.radix.tree import TreeNode
from sgl.runtime.scheduler.req import Req

LPM_MAX_QUEUE = 128


def order_waiting(policy: str, waiting: list[Req], tree: RadixTree) -> list[Req]:
    if policy == "fcfs" or tree.disable or len(waiting) <= 1:
        return list(waiting)
    if policy == "lpm":
        if len(waiting) > LPM_MAX_QUEUE:
            return list(waiting)
        hits = {id(r): len(tree.match_prefix(r.fill_ids).values) for r in waiting}
        return sorted(waiting, key=lambda r: -hits[id(r)])  # stable: ties stay fcfs
    if policy == "dfs-weight":
        return _dfs_weight(waiting, tree)
    raise ValueError(f"unknown schedule policy {policy!r}")


def _dfs_weight(waiting: list[Req], tree: RadixTree) -> list[Req]:
    at_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    nodes: dict[int, Any] = {}
    for r in waiting:
        node: TreeNode | None = tree.match_prefix(r.fill_ids).last_node
        at_node[id(node)].append(r)
        while node is not None:  # every ancestor's subtree gains one waiting request
            nodes[id(node)] = node
            weight[id(node)] += 1
            node = node.parent
    out: list[Req] = []
    root = tree.root
    stack = [root]
    while stack:
        node = stack.pop()
        out.extend(at_node.get(id(node), []))
        kids = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
        kids.sort(key=lambda c: weight[id(c)])  # popped heaviest first
        stack.extend(kids)
    return out
