"""Radix tree: unit tests plus a Hypothesis state machine against a brute-force prefix model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from sgl.radix import MatchResult, RadixTree, TreeNode


def path_key(node: TreeNode) -> list[int]:
    """Tokens spelled from the root down to ``node``."""
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def collect(tree: RadixTree) -> dict[tuple[int, ...], int]:
    """Every stored prefix -> slot of its last token (read-only walk, no LRU effects)."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            p = prefix
            for tok, slot in zip(child.key, child.value):
                p = p + (tok,)
                out[p] = slot
            stack.append((child, p))
    return out


class Freed:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, values: list[int]) -> None:
        self.calls.append(list(values))

    @property
    def flat(self) -> list[int]:
        return [v for c in self.calls for v in c]


# ---------------------------------------------------------------------------- unit tests


def test_empty_match_returns_root() -> None:
    t = RadixTree()
    r = t.match_prefix([1, 2, 3])
    assert isinstance(r, MatchResult)
    assert r.values == [] and r.last_node is t.root
    assert t.match_prefix([]).last_node is t.root
    t.check_invariants()


def test_match_splits_inside_edge() -> None:
    t = RadixTree()
    assert t.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    tail = t.root.children[1]
    r = t.match_prefix([1, 2, 9])
    assert r.values == [10, 11]
    assert r.last_node.key == [1, 2] and r.last_node.value == [10, 11]
    assert r.last_node.children == {3: tail}  # original node object keeps the tail
    assert tail.key == [3, 4] and tail.value == [12, 13] and tail.parent is r.last_node
    assert t.total_size() == 4
    t.check_invariants()
    # Full and over-long matches.
    assert t.match_prefix([1, 2, 3, 4, 5]).values == [10, 11, 12, 13]
    assert t.match_prefix([1, 2, 3, 4]).last_node is tail
    t.check_invariants()


def test_insert_returns_already_cached_prefix_len() -> None:
    t = RadixTree()
    assert t.insert([1, 2, 3], [10, 11, 12]) == 0
    assert t.insert([1, 2, 3, 4], [20, 21, 22, 23]) == 3
    assert t.insert([1, 2], [30, 31]) == 2  # ends inside an edge: nothing new
    assert t.insert([1, 5], [40, 41]) == 1
    assert t.insert([1, 2, 3, 4], [50, 51, 52, 53]) == 4
    assert t.insert([], []) == 0
    # The tree kept its own slots, took only value[ret:].
    assert t.match_prefix([1, 2, 3, 4]).values == [10, 11, 12, 23]
    assert t.match_prefix([1, 5]).values == [10, 41]
    assert sorted(t.all_values()) == [10, 11, 12, 23, 41]
    assert t.total_size() == 5 and t.evictable_size() == 5 and t.protected_size() == 0
    t.check_invariants()


def test_insert_length_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        RadixTree().insert([1, 2], [1])


def test_lock_protects_from_evict() -> None:
    t = RadixTree()
    t.insert([1, 2, 3], [10, 11, 12])
    t.insert([1, 2, 4], [20, 21, 22])  # shares [1,2] -> stores slot 22 only
    t.insert([7, 8], [30, 31])
    node = t.match_prefix([1, 2, 3]).last_node
    t.inc_lock_ref(node)
    assert t.protected_size() == 3 and t.evictable_size() == 3
    t.check_invariants()
    freed = Freed()
    assert t.evict(100, freed) == 3
    assert sorted(freed.flat) == [22, 30, 31]
    assert t.match_prefix([1, 2, 3]).values == [10, 11, 12]
    assert t.evictable_size() == 0 and t.protected_size() == 3
    t.check_invariants()
    t.dec_lock_ref(node)
    assert t.evictable_size() == 3 and t.protected_size() == 0
    assert t.evict(1, freed) == 1  # leaf [3] goes first; parent [1,2] stays
    assert freed.flat[-1:] == [12]
    assert t.evict(100, freed) == 2  # parent became a leaf and is evicted too
    assert t.total_size() == 0 and t.all_values() == []
    assert sorted(freed.flat) == [10, 11, 12, 22, 30, 31]
    t.check_invariants()


def test_lock_counts_and_unbalanced_unlock() -> None:
    t = RadixTree()
    t.insert([1, 2, 3, 4], [10, 11, 12, 13])
    leaf = t.match_prefix([1, 2, 3, 4]).last_node
    t.inc_lock_ref(leaf)
    t.inc_lock_ref(leaf)
    # Splitting a locked node keeps both halves locked with the same count.
    mid = t.match_prefix([1, 2]).last_node
    assert mid.lock_ref == 2 and leaf.lock_ref == 2 and leaf.parent is mid
    t.check_invariants()
    t.dec_lock_ref(leaf)
    assert t.protected_size() == 4
    t.dec_lock_ref(leaf)
    assert t.protected_size() == 0 and t.evictable_size() == 4
    assert mid.lock_ref == 0 and t.root.lock_ref == 0
    with pytest.raises(ValueError):
        t.dec_lock_ref(leaf)
    t.check_invariants()


def test_lock_on_evicted_or_foreign_node_raises() -> None:
    t = RadixTree()
    t.insert([1], [10])
    node = t.match_prefix([1]).last_node
    t.evict(1, Freed())
    with pytest.raises(ValueError):
        t.inc_lock_ref(node)
    other = RadixTree()
    other.insert([1], [10])
    with pytest.raises(ValueError):
        t.inc_lock_ref(other.match_prefix([1]).last_node)


def test_evict_lru_order() -> None:
    t = RadixTree()
    t.insert([1, 1], [10, 11])  # a
    t.insert([2, 2], [20, 21])  # b
    t.insert([3, 3], [30, 31])  # c
    t.match_prefix([1, 1])  # a is now the most recent
    freed = Freed()
    assert t.evict(2, freed) == 2
    assert freed.calls == [[20, 21]]  # b was least recently used
    t.insert([2, 2], [22, 23])  # b back, most recent
    assert t.evict(4, freed) == 4
    assert freed.calls[1:] == [[30, 31], [10, 11]]
    assert t.match_prefix([2, 2]).values == [22, 23]
    assert t.evict(0, freed) == 0
    t.check_invariants()


def test_match_touches_whole_path() -> None:
    # Matching a deep leaf refreshes its ancestors; a partially matched sibling does not.
    t = RadixTree()
    t.insert([1, 2], [10, 11])
    t.insert([1, 3], [12, 13])  # splits: [1] -> {[2], [3]}
    t.insert([4], [40])
    t.match_prefix([1, 2])
    freed = Freed()
    t.evict(2, freed)
    assert freed.calls == [[13], [40]]
    t.evict(1, freed)
    assert freed.calls[2] == [11]
    t.check_invariants()


def test_disable_mode() -> None:
    t = RadixTree(disable=True)
    assert t.insert([1, 2, 3], [10, 11, 12]) == 0
    r = t.match_prefix([1, 2, 3])
    assert r.values == [] and r.last_node is t.root
    assert t.total_size() == 0 and t.all_values() == []
    assert t.evict(10, Freed()) == 0
    t.check_invariants()


def test_reset_and_all_values() -> None:
    t = RadixTree()
    t.insert([1, 2, 3], [10, 11, 12])
    t.insert([1, 4], [13, 14])
    assert sorted(t.all_values()) == [10, 11, 12, 14]
    t.reset()
    assert t.all_values() == [] and t.total_size() == 0
    assert t.match_prefix([1, 2, 3]).values == []
    t.check_invariants()


def test_heap_stays_bounded_under_repeated_hits() -> None:
    t = RadixTree()
    t.insert([1, 2, 3], [10, 11, 12])
    for _ in range(10_000):
        t.match_prefix([1, 2, 3])
    assert len(t._heap) <= 2 * t._num_nodes + 65
    t.check_invariants()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda t: setattr(t, "_evictable", t._evictable + 1),
        lambda t: t.root.children[1].value.append(99),
        lambda t: t.root.children[1].children[2].value.__setitem__(0, 10),
        lambda t: setattr(t.root.children[1], "lock_ref", -1),
        lambda t: setattr(t.root.children[1].children[2], "lock_ref", 1),
        lambda t: t.root.children.__setitem__(5, t.root.children.pop(1)),
    ],
)
def test_check_invariants_detects_corruption(corrupt) -> None:  # type: ignore[no-untyped-def]
    t = RadixTree()
    t.insert([1, 2], [10, 11])
    t.insert([1, 3], [12, 13])
    t.check_invariants()
    corrupt(t)
    with pytest.raises(AssertionError):
        t.check_invariants()


# ------------------------------------------------------------------- property test

ALPHABET = st.integers(0, 2)
KEYS = st.lists(ALPHABET, max_size=6)


class RadixModel(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / evict against ``facts``: prefix -> slot.

    Stored content is prefix-closed, so a dict of every stored prefix (each mapping to
    the slot of its last token) is the whole truth about what the tree should hold.
    """

    locks = Bundle("locks")

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree()
        self.facts: dict[tuple[int, ...], int] = {}
        self.next_slot = 0
        self.given: set[int] = set()
        self.caller_freed: set[int] = set()
        self.tree_freed: set[int] = set()
        self.held: list[tuple[TreeNode, tuple[int, ...]]] = []

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        self.given.update(out)
        return out

    def cached_len(self, key: list[int]) -> int:
        n = 0
        while n < len(key) and tuple(key[: n + 1]) in self.facts:
            n += 1
        return n

    def store(self, key: list[int], value: list[int], ret: int) -> None:
        for i in range(ret, len(key)):
            self.facts[tuple(key[: i + 1])] = value[i]

    def free_fn(self, values: list[int]) -> None:
        for v in values:
            assert v in self.given and v not in self.tree_freed and v not in self.caller_freed
            self.tree_freed.add(v)

    @rule(key=KEYS)
    def insert_fresh(self, key: list[int]) -> None:
        value = self.fresh(len(key))
        expected = self.cached_len(key)
        ret = self.tree.insert(key, value)
        assert ret == expected
        self.caller_freed.update(value[:ret])  # duplicates the tree already had
        self.store(key, value, ret)

    @rule(key=KEYS, tail=st.lists(ALPHABET, max_size=3))
    def insert_after_match(self, key: list[int], tail: list[int]) -> None:
        # The scheduler's pattern: reuse the matched slots, compute the rest, insert all.
        m = self.tree.match_prefix(key)
        full = key[: len(m.values)] + tail
        value = m.values + self.fresh(len(tail))
        ret = self.tree.insert(full, value)
        assert ret == self.cached_len(full) >= len(m.values)
        self.caller_freed.update(value[len(m.values) : ret])
        self.store(full, value, ret)

    @rule(key=KEYS)
    def match(self, key: list[int]) -> None:
        n = self.cached_len(key)
        r = self.tree.match_prefix(key)
        assert r.values == [self.facts[tuple(key[: i + 1])] for i in range(n)]
        assert path_key(r.last_node) == key[:n]
        assert (r.last_node is self.tree.root) == (n == 0)

    @rule(target=locks, key=KEYS)
    def lock(self, key: list[int]) -> tuple[TreeNode, tuple[int, ...]]:
        r = self.tree.match_prefix(key)
        self.tree.inc_lock_ref(r.last_node)
        handle = (r.last_node, tuple(key[: len(r.values)]))
        self.held.append(handle)
        return handle

    @rule(handle=consumes(locks))
    def unlock(self, handle: tuple[TreeNode, tuple[int, ...]]) -> None:
        node, prefix = handle
        assert tuple(path_key(node)) == prefix  # splits never move a held node
        self.tree.dec_lock_ref(node)
        self.held.remove(handle)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        before = len(self.tree_freed)
        calls: list[list[int]] = []

        def free_fn(values: list[int]) -> None:
            calls.append(list(values))
            self.free_fn(values)

        freed = self.tree.evict(n, free_fn)
        assert freed == sum(len(c) for c in calls) == len(self.tree_freed) - before
        assert freed >= n or self.tree.evictable_size() == 0
        gone = {v for c in calls for v in c}
        self.facts = {p: s for p, s in self.facts.items() if s not in gone}
        for _, prefix in self.held:
            for i in range(len(prefix)):
                assert prefix[: i + 1] in self.facts, "locked content was evicted"

    @precondition(lambda self: not self.held)
    @rule()
    def reset(self) -> None:
        self.caller_freed.update(self.tree.all_values())
        self.tree.reset()
        self.facts.clear()

    @invariant()
    def consistent(self) -> None:
        t = self.tree
        t.check_invariants()
        assert collect(t) == self.facts
        # Facts stay prefix-closed (eviction only removes leaves).
        for p in self.facts:
            assert p[:-1] == () or p[:-1] in self.facts
        locked = {p[: i + 1] for _, p in self.held for i in range(len(p))}
        assert t.protected_size() == len(locked)
        assert t.total_size() == len(self.facts)
        assert t.evictable_size() == len(self.facts) - len(locked)
        # Every slot ever handed out is in exactly one place.
        held = t.all_values()
        assert len(held) == len(set(held))
        assert set(held) | self.caller_freed | self.tree_freed == self.given
        assert not (set(held) & (self.caller_freed | self.tree_freed))
        assert not (self.caller_freed & self.tree_freed)


RadixModel.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestRadixModel = RadixModel.TestCase
