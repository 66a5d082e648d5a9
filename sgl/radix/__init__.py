"""Prefix cache: a radix tree from token ids to KV slots, pure Python (no torch, no sgl imports)."""

from __future__ import annotations

from sgl.radix.tree import MatchResult, RadixTree, TreeNode, TreeObserver

__all__ = ["MatchResult", "RadixTree", "TreeNode", "TreeObserver"]
