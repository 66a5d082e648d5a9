"""Page tracking for KV events (sgl/runtime/kv_events/pages.py) on a bare radix tree:
unit cases for insert / split / evict / reset, and a Hypothesis state machine checking
that the pages a subscriber believes held (replaying the events) always equal the full
pages of the tree's paths, hashed with the shared chain."""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sgl.kv_events.hashing import ROOT_HASH, page_hashes
from sgl.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from sgl.radix import RadixTree, TreeNode
from sgl.runtime.kv_events.pages import PageTracker


def tracked(page_size: int) -> tuple[RadixTree, PageTracker]:
    tree = RadixTree()
    tracker = PageTracker(page_size)
    tree.observer = tracker
    return tree, tracker


def leaf_paths(tree: RadixTree) -> list[list[int]]:
    out = []
    stack: list[tuple[TreeNode, list[int]]] = [(tree.root, [])]
    while stack:
        node, path = stack.pop()
        if not node.children and node is not tree.root:
            out.append(path)
        for child in node.children.values():
            stack.append((child, path + child.key))
    return out


def full_pages(tree: RadixTree, page_size: int) -> set[int]:
    """Brute force: every full page of every path."""
    return {h for path in leaf_paths(tree) for h in page_hashes(path, page_size)}


class Subscriber:
    """What a consumer believes from the events alone, checking each one as it comes."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.held: set[int] = set()

    def apply(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == self.page_size and ev.medium == "CPU" and ev.lora_id is None
                assert len(ev.token_ids) == self.page_size * len(ev.block_hashes)
                parent = ROOT_HASH if ev.parent_block_hash is None else ev.parent_block_hash
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.held, "parent page not held"
                assert ev.block_hashes == page_hashes(ev.token_ids, self.page_size, parent)
                assert not self.held & set(ev.block_hashes), "a held page was announced again"
                self.held |= set(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert ev.block_hashes and set(ev.block_hashes) <= self.held, "removed a page never announced"
                assert len(set(ev.block_hashes)) == len(ev.block_hashes)
                self.held -= set(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.held.clear()


slots = itertools.count()


def insert(tree: RadixTree, key: list[int]) -> None:
    tree.insert(key, [next(slots) for _ in key])


# ---------------------------------------------------------------------------- unit cases


def test_insert_announces_full_pages_only() -> None:
    tree, tr = tracked(4)
    insert(tree, list(range(10)))
    (ev,) = tr.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.token_ids == list(range(8)) and ev.parent_block_hash is None and ev.block_size == 4
    assert ev.block_hashes == page_hashes(list(range(10)), 4)
    assert tr.take_events() == []  # taken once


def test_extension_hashes_only_new_pages_and_names_parent() -> None:
    tree, tr = tracked(4)
    insert(tree, list(range(6)))  # page 0 held, tail 4..5
    insert(tree, list(range(13)))  # a leaf [6..12]: page 1 starts in the parent (4, 5)
    first, second = tr.take_events()
    h = page_hashes(list(range(13)), 4)
    assert first.block_hashes == h[:1]
    assert second.block_hashes == h[1:3] and second.parent_block_hash == h[0]
    assert second.token_ids == list(range(4, 12))


def test_short_leaf_announces_nothing_until_a_page_completes() -> None:
    tree, tr = tracked(4)
    insert(tree, [1, 2])
    insert(tree, [1, 2, 3])
    assert tr.take_events() == []
    insert(tree, [1, 2, 3, 4, 5])
    (ev,) = tr.take_events()
    assert ev.token_ids == [1, 2, 3, 4] and ev.block_hashes == page_hashes([1, 2, 3, 4], 4)


def test_split_moves_pages_without_events_and_evict_removes_them() -> None:
    tree, tr = tracked(4)
    insert(tree, list(range(12)))
    tr.take_events()
    tree.match_prefix(list(range(6)) + [99])  # split at 6: page 0 to the prefix, pages 1, 2 stay
    assert tr.take_events() == []
    insert(tree, list(range(6)) + [50, 51, 52])  # diverges inside page 1: a new chain from page 0
    (ev,) = tr.take_events()
    assert ev.token_ids == [4, 5, 50, 51] and ev.parent_block_hash == page_hashes(list(range(4)), 4)[0]
    h = page_hashes(list(range(12)), 4)
    tree.evict(1, lambda v: None)  # LRU leaf: the old tail [6..11] (pages 1, 2)
    (rm,) = tr.take_events()
    assert isinstance(rm, BlockRemoved) and rm.block_hashes == h[1:]
    assert tr.held_hashes() == {h[0], ev.block_hashes[0]}


def test_evictions_of_one_pass_are_one_event_and_reset_clears() -> None:
    tree, tr = tracked(2)
    insert(tree, [1, 2, 3, 4])
    insert(tree, [5, 6, 7, 8])
    tr.take_events()
    tree.evict(100, lambda v: None)
    (rm,) = tr.take_events()
    assert sorted(rm.block_hashes) == sorted(page_hashes([1, 2, 3, 4], 2) + page_hashes([5, 6, 7, 8], 2))
    insert(tree, [1, 2, 3])
    tree.reset()
    stored, cleared = tr.take_events()
    assert isinstance(stored, BlockStored) and isinstance(cleared, AllBlocksCleared)
    assert tr.held_hashes() == set()
    insert(tree, [1, 2])  # the tree keeps being tracked after a reset (new root)
    assert tr.take_events()[0].block_hashes == page_hashes([1, 2], 2)


def test_no_observer_no_events() -> None:
    tree = RadixTree()
    assert tree.observer is None
    insert(tree, list(range(40)))  # nothing to call: the hook costs one attribute test


# ----------------------------------------------------------------------- state machine


class PagesModel(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 3, 4, 8]))
    def setup(self, page_size: int) -> None:
        self.page_size = page_size
        self.tree, self.tracker = tracked(page_size)
        self.sub = Subscriber(page_size)
        self.locked: list[TreeNode] = []

    keys = st.lists(st.integers(0, 3), min_size=1, max_size=24)

    @rule(key=keys)
    def insert(self, key: list[int]) -> None:
        insert(self.tree, key)

    @rule(key=keys)
    def match(self, key: list[int]) -> None:
        self.tree.match_prefix(key)  # may split an edge

    @rule(key=keys)
    def lock(self, key: list[int]) -> None:
        node = self.tree.match_prefix(key).last_node
        self.tree.inc_lock_ref(node)
        self.locked.append(node)

    @rule()
    def unlock(self) -> None:
        if self.locked:
            self.tree.dec_lock_ref(self.locked.pop())

    @rule(n=st.integers(1, 30))
    def evict(self, n: int) -> None:
        self.tree.evict(n, lambda v: None)

    @rule()
    def reset(self) -> None:
        for node in self.locked:
            self.tree.dec_lock_ref(node)
        self.locked = []
        self.tree.reset()

    @invariant()
    def announced_equals_held_pages(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.sub.apply(self.tracker.take_events())
        truth = full_pages(self.tree, self.page_size)
        assert self.sub.held == truth
        assert self.tracker.held_hashes() == truth
        self.tree.check_invariants()


PagesModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPagesModel = PagesModel.TestCase
