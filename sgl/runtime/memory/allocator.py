"""Slot allocator for the token KV pool, and the request -> token table.

Slots are handed out from a free list; slot 0 is reserved (scratch for padded lanes).
`check_invariants(owned)` proves, given every slot the tree and the live requests hold,
that no slot is leaked (neither free nor owned) or double-owned.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError("the KV pool needs at least 2 slots (slot 0 is reserved)")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Usable slots (all but the reserved slot 0)."""
        return self.num_slots - 1

    def alloc(self, n: int) -> list[int] | None:
        """n fresh slots, or None when fewer than n are free (nothing is taken then)."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        return out

    def free(self, slots: Iterable[int]) -> None:
        self._free.extend(slots)

    def check_invariants(self, owned: Iterable[int]) -> None:
        """Free slots and `owned` slots must be disjoint and together cover 1..num_slots-1."""
        free = self._free
        assert len(set(free)) == len(free), "a slot is on the free list twice"
        assert 0 not in set(free), "the reserved slot 0 is on the free list"
        owned_list = list(owned)
        owned_set = set(owned_list)
        assert len(owned_set) == len(owned_list), "a slot is owned twice"
        both = owned_set & set(free)
        assert not both, f"slots both free and owned: {sorted(both)[:10]}"
        missing = set(range(1, self.num_slots)) - owned_set - set(free)
        assert not missing, f"leaked slots (neither free nor owned): {sorted(missing)[:10]}"


class ReqToTokenPool:
    """Rows of slot indices, one row per live request; row i column j = slot of token j."""

    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str = "cpu") -> None:
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.table = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)
        self._free_rows: list[int] = list(range(max_reqs - 1, -1, -1))
        # Writes since the last take_journal(), kept only when record_writes() was called
        # (tensor parallelism: the other ranks replay them on their copy of the table).
        self._journal: list[tuple[int, int, list[int]]] | None = None

    def record_writes(self) -> None:
        self._journal = []

    def take_journal(self) -> list[tuple[int, int, list[int]]]:
        out, self._journal = self._journal, ([] if self._journal is not None else None)
        return out or []

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        if slots:
            self.table[row, start : start + len(slots)] = torch.tensor(slots, dtype=torch.int64)
            if self._journal is not None:
                self._journal.append((row, start, list(slots)))
