"""Draft-model proposer: a smaller model with the target's vocabulary guesses, greedily,
the tokens that follow each request's `fill_ids`.

The draft runs beside the target on the scheduler thread, with its own KV pool, slot
allocator and request -> token table, so it never competes with the target for slots.
Per request (uid) it remembers the tokens whose KV it holds. A call then:

    held:      p p p p a b c        (a b c: its own drafts of last time, KV written)
    fill_ids:  p p p p a x          (target kept `a`, corrected to `x`)
    keep:      p p p p a            longest common prefix, at most len(fill_ids)-1: the last
                                    token is always recomputed, for the logits it gives
    extend:              x          one batched forward over every request's new tokens
    decode:  d_0 -> d_1 -> ...      budget-1 batched greedy steps, writing the drafts' KV

so only tokens the target rejected are recomputed. Drafts are the argmax of the draft's
logits, hence deterministic (the verifier relies on that, proposer.py).

Running out of slots or table rows never fails a request: the least recently proposed
requests outside this call lose their state first; a request that still does not fit
loses its own state and gets no drafts this step (it starts afresh at its next call).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.memory.allocator import ReqToTokenPool, SlotAllocator
from sgl.runtime.memory.kv_pool import KVPool

log = logging.getLogger("sgl.speculative")

DRAFT_KV_TOKENS_CAP = 65536  # the draft pool never takes more slots than this


@dataclass
class _Held:
    """One request's draft-side state: tokens whose KV is in the draft pool, in order."""

    row: int  # its row in the draft's request -> token table
    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


@dataclass
class _Work:
    """One request's share of a propose() call."""

    index: int  # position in the call's reqs
    held: _Held
    new: list[int]  # fill_ids beyond the reused prefix (KV computed in the extend)
    budget: int
    slots: list[int]  # fresh slots: len(new) for `new`, then budget-1 for the drafts
    drafts: list[int] = field(default_factory=list)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of `a` and `b`, at most `limit`. Compared by list
    slices (C speed) rather than token by token: usually the first comparison settles it
    (the target rejected drafts past the end of what it kept), else a binary search."""
    hi = min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class DraftModelProposer:
    """The `draft` proposer over a model runner (`runner.forward(batch) -> logits`) that
    reads and writes `pool`; build one from a model path with `load`."""

    def __init__(self, runner: Any, pool: KVPool, context_length: int, max_requests: int,
                 device: str | torch.device = "cpu") -> None:
        self.runner = runner
        self.pool = pool
        self.allocator = SlotAllocator(pool.num_slots)
        self.table = ReqToTokenPool(max_requests, context_length, device)
        self.context_length = context_length
        self.device = device
        self._held: OrderedDict[int, _Held] = OrderedDict()  # uid -> state, least recently used first
        self.num_dropped = 0  # states dropped for lack of slots or rows (not counting release)

    @classmethod
    def load(cls, path: str | None, dtype: torch.dtype | str, device: str | torch.device, max_tokens: int,
             target_vocab_size: int, cache_dir: str | None = None, *, context_length: int | None = None,
             max_requests: int = 256, attention_backend: str | None = "auto", prepack: bool = True,
             use_cpu_decode_kernel: bool = True, cpu_decode_threads: int | None = None) -> "DraftModelProposer":
        """The draft model at `path` (a GGUF file or a Hugging Face folder; None: the
        embedded SmolLM2) with a pool of `max_tokens` KV slots (at most DRAFT_KV_TOKENS_CAP;
        pass the target's max_total_tokens), rows for `max_requests` requests, and a
        context of `context_length` tokens (default and at most: the draft's own)."""
        from sgl.runtime.attention.registry import create_attention_backend
        from sgl.runtime.executor.model_runner import ModelRunner
        from sgl.runtime.models.loader import load_hf_weights, read_model_config, resolve_dtype, resolve_model_dir
        from sgl.runtime.models.registry import model_class

        # load_model's steps without the tokenizer: a draft needs none, and test drafts ship none.
        hf_dir, shown = resolve_model_dir(path, cache_dir)
        mc = read_model_config(hf_dir)
        if mc.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model {shown!r} has a vocabulary of {mc.vocab_size} tokens but the target has "
                f"{target_vocab_size}: --speculative-draft-model-path needs a model with the target's tokenizer")
        if max_tokens < 1:
            raise ValueError(f"the draft model's KV pool needs at least one token (got {max_tokens})")
        model = model_class(mc.architecture)(mc, resolve_dtype(dtype, device))
        load_hf_weights(model, hf_dir)
        model = model.to(device).eval()
        if prepack:
            model.prepack()
        num_tokens = min(max_tokens, DRAFT_KV_TOKENS_CAP)
        torch_dtype = next(model.parameters()).dtype
        kv_heads = getattr(model, "num_local_kv_heads", mc.num_kv_heads)
        pool = KVPool(num_tokens + 1, mc.num_layers, kv_heads, mc.head_dim, torch_dtype, device)
        runner = ModelRunner(model, create_attention_backend(attention_backend, pool, device),
                             use_cpu_decode_kernel, cpu_decode_threads)
        ctx = min(context_length or mc.max_position_embeddings, mc.max_position_embeddings)
        log.info("draft model %s: %d KV slots, context %d", shown, num_tokens, ctx)
        return cls(runner, pool, ctx, max_requests, device)

    # -- the Proposer protocol -------------------------------------------------------------
    def propose(self, reqs: Sequence[Any], budgets: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        in_call = {r.uid for r in reqs}
        work: list[_Work] = []
        for i, (req, budget) in enumerate(zip(reqs, budgets)):
            if budget > 0:
                w = self._prepare(i, req.uid, req.fill_ids, budget, in_call)
                if w is not None:
                    work.append(w)
        if work:
            try:
                self._run(work)
            except BaseException:  # leave no half-written state behind
                for w in work:
                    self._drop(reqs[w.index].uid)
                raise
            for w in work:
                out[w.index] = w.drafts
        return out

    def release(self, uid: int) -> None:
        self._drop(uid)

    # -- inspection (tests, metrics) -------------------------------------------------------
    def owned_slots(self) -> list[int]:
        """Every slot some request's state holds (for SlotAllocator.check_invariants)."""
        return [s for h in self._held.values() for s in h.slots]

    def held_tokens(self, uid: int) -> list[int]:
        h = self._held.get(uid)
        return list(h.tokens) if h is not None else []

    # -- internals ----------------------------------------------------------------------
    def _prepare(self, index: int, uid: int, fill: list[int], budget: int, in_call: set[int]) -> _Work | None:
        """Reconcile `uid`'s state with `fill` and take its slots, or drop it (None)."""
        n = len(fill)
        budget = min(budget, self.context_length - n + 1)  # drafts' KV stays inside the context
        if n == 0 or budget <= 0:
            self._drop(uid)
            return None
        held = self._held.get(uid)
        if held is None:
            row = self._row(in_call)
            if row is None:
                self.num_dropped += 1
                return None
            held = self._held[uid] = _Held(row)
        else:
            self._held.move_to_end(uid)
        keep = _common_prefix(held.tokens, fill, n - 1)
        self.allocator.free(held.slots[keep:])
        del held.slots[keep:], held.tokens[keep:]
        slots = self._slots(n - keep + budget - 1, in_call)
        if slots is None:
            self._drop(uid)
            self.num_dropped += 1
            return None
        return _Work(index, held, fill[keep:], budget, slots)

    def _evictable(self, in_call: set[int]) -> list[int]:
        return [u for u in self._held if u not in in_call]  # least recently used first

    def _row(self, in_call: set[int]) -> int | None:
        if self.table.num_free == 0:
            victims = self._evictable(in_call)
            if not victims:
                return None
            self._drop(victims[0])
            self.num_dropped += 1
        return self.table.alloc()

    def _slots(self, need: int, in_call: set[int]) -> list[int] | None:
        if need > self.allocator.num_free:
            victims = self._evictable(in_call)
            if need > self.allocator.num_free + sum(len(self._held[u].slots) for u in victims):
                return None  # evicting would not make room: keep the others' state
            for u in victims:
                self._drop(u)
                self.num_dropped += 1
                if need <= self.allocator.num_free:
                    break
        return self.allocator.alloc(need)

    def _drop(self, uid: int) -> None:
        held = self._held.pop(uid, None)
        if held is not None:
            self.allocator.free(held.slots)
            self.table.free(held.row)

    def _run(self, work: list[_Work]) -> None:
        # One extend over every request's new tokens: logits at each one's last token -> d_0.
        ids: list[int] = []
        locs: list[int] = []
        rows: list[int] = []
        prefix: list[int] = []
        lens: list[int] = []
        for w in work:
            k = len(w.new)
            start = len(w.held.tokens)
            self.table.write(w.held.row, start, w.slots[:k])
            ids += w.new
            locs += w.slots[:k]
            rows.append(w.held.row)
            prefix.append(start)
            lens.append(k)
            w.held.tokens += w.new
            w.held.slots += w.slots[:k]
        for w, t in zip(work, self._greedy(ids, locs, rows, prefix, lens)):
            w.drafts.append(t)
        # Then one decode step per further draft, over the requests that want one more.
        step = 1
        while live := [w for w in work if w.budget > step]:
            ids, locs, rows, prefix = [], [], [], []
            for w in live:
                slot = w.slots[len(w.new) + step - 1]
                pos = len(w.held.tokens)
                self.table.write(w.held.row, pos, [slot])
                ids.append(w.drafts[-1])
                locs.append(slot)
                rows.append(w.held.row)
                prefix.append(pos)
                w.held.tokens.append(w.drafts[-1])
                w.held.slots.append(slot)
            for w, t in zip(live, self._greedy(ids, locs, rows, prefix, [1] * len(live))):
                w.drafts.append(t)
            step += 1

    def _greedy(self, ids: list[int], locs: list[int], rows: list[int], prefix: list[int],
                lens: list[int]) -> list[int]:
        """The argmax token after each request's last new token."""
        batch = ForwardBatch.build(ids, locs, rows, prefix, lens, self.table.table, device=self.device)
        logits = self.runner.forward(batch)
        return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
