"""Test doubles for the scheduler: a model runner (logits) and an executor (token ids)
whose next token is a pure function of (previous token, position), and a tiny character
tokenizer. Outputs are therefore predictable, whatever batching, chunking, eviction or
retraction happened."""

from __future__ import annotations

import torch

from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.executor.plan import PlanRow, RowResult, StepPlan, StepResult
from sgl.runtime.executor.step import build_forward_batch

VOCAB = 64
EOS = 2


def next_token(prev: int, pos: int) -> int:
    return 3 + (prev * 31 + pos * 7) % (VOCAB - 3)  # never EOS, never 0..2


def expected_output(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq[-1], len(seq) - 1))
    return seq[len(prompt):]


def check_batch(batch: ForwardBatch) -> None:
    """The batch is well formed: distinct fresh slots, the table covers the new tokens."""
    pos = batch.positions.tolist()
    assert len(set(batch.out_cache_loc.tolist())) == batch.num_tokens, "two tokens share a KV slot"
    assert 0 not in batch.out_cache_loc.tolist(), "slot 0 is reserved"
    for i, row in enumerate(batch.req_pool_indices.tolist()):
        seq = batch.seq_lens_cpu[i]
        table = batch.req_to_token[row, :seq].tolist()
        s, e = batch.extend_start_loc[i].item(), batch.extend_lens_cpu[i]
        assert table[seq - e:] == batch.out_cache_loc[s:s + e].tolist(), "table does not cover new tokens"
        assert pos[s:s + e] == list(range(seq - e, seq))


class FakeRunner:
    """Checks the batch is well formed, then returns one-hot-ish logits."""

    def __init__(self) -> None:
        self.batches: list[ForwardBatch] = []
        self.tokens_computed = 0

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.batches.append(batch)
        self.tokens_computed += batch.num_tokens
        check_batch(batch)
        ids = batch.input_ids.tolist()
        pos = batch.positions.tolist()
        rows = batch.logits_indices.tolist()
        logits = torch.full((len(rows), VOCAB), -10.0)
        for j, r in enumerate(rows):
            logits[j, next_token(ids[r], pos[r])] = 10.0
        return logits


class FakeExecutor:
    """The executor seam without logits: checks the plan's batch like FakeRunner, then
    answers each sampled row with next_token(last new token, its position). Prompt
    logprobs are 0.0 where the prompt token is the one the fake model predicts, else -1.0.

    With `track_kv`, it also keeps fake KV: slot -> the tuple of tokens up to and including
    that slot's token, written by the forward, copied device <-> host by the plan's
    hierarchical cache copies like real KV. Every row's context must then be a consistent
    chain, and `attended[uid]` records the token sequence each sampled row attended to, so
    a test can prove that loaded KV is exactly the KV a recompute would have made."""

    def __init__(self, req_to_token: torch.Tensor, track_kv: bool = False) -> None:
        self.req_to_token = req_to_token
        self.batches: list[ForwardBatch] = []
        self.plans: list[StepPlan] = []
        self.tokens_computed = 0
        self.track_kv = track_kv
        self.kv: dict[int, tuple[int, ...]] = {}
        self.host: dict[int, list[tuple[int, ...]]] = {}
        self.attended: dict[int, tuple[int, ...]] = {}
        self.num_stores = self.num_loads = 0  # pages copied device -> host, host -> device

    def _copies(self, plan: StepPlan) -> None:
        self.num_stores += len(plan.kv_stores)
        self.num_loads += len(plan.kv_loads)
        for page, slots in plan.kv_stores:
            self.host[page] = [self.kv[s] for s in slots]
        assert not plan.kv_fills, "the fake executor has no storage bytes"
        for page, first, slots in plan.kv_loads:
            for i, s in enumerate(slots):
                self.kv[s] = self.host[page][first + i]

    def _write_kv(self, plan: StepPlan) -> None:
        for r in plan.rows:
            ctx: tuple[int, ...] = ()
            if r.prefix_len:
                table = self.req_to_token[r.req_pool_idx, : r.prefix_len].tolist()
                ctx = self.kv[table[-1]]
                assert len(ctx) == r.prefix_len, "the context's last slot holds KV of another position"
                for j, s in enumerate(table):
                    assert self.kv[s] == ctx[: j + 1], f"slot {s} at position {j} holds KV of another sequence"
            for tok, s in zip(r.input_ids, r.out_cache_loc):
                ctx = ctx + (tok,)
                self.kv[s] = ctx
            if r.sample is not None:
                self.attended[r.uid] = ctx

    def execute(self, plan: StepPlan) -> StepResult:
        if self.track_kv:
            self._copies(plan)
        if not plan.rows:
            return StepResult([])
        batch = build_forward_batch(plan, self.req_to_token)[0]
        check_batch(batch)
        if self.track_kv:
            self._write_kv(plan)
        self.plans.append(plan)
        self.batches.append(batch)
        self.tokens_computed += batch.num_tokens
        out = []
        for r in plan.rows:
            res = RowResult()
            for k, nxt in enumerate(r.prompt_lp_next_ids):
                p = r.prompt_lp_start + k
                res.prompt_logprobs.append(0.0 if nxt == next_token(r.input_ids[p - r.prefix_len], p) else -1.0)
                res.prompt_top_logprobs.append(None)
            if r.sample is not None:
                res = self._verify(r, res)
            out.append(res)
        return StepResult(out)


    @staticmethod
    def _verify(r: PlanRow, res: RowResult) -> RowResult:
        """The sampled token, after accepting the row's speculative drafts while each is the
        fake model's choice at its position (greedy verification)."""
        assert r.sample is not None
        drafts = r.sample.draft_ids
        first = r.extend_len - 1 - len(drafts)  # the row's index of the last pending token
        accepted: list[RowResult] = []
        for j in range(len(drafts) + 1):
            i = first + j
            choice = next_token(r.input_ids[i], r.prefix_len + i)
            if j == len(drafts) or choice != drafts[j]:
                res.token_id = choice
                res.accepted = accepted
                return res
            accepted.append(RowResult(token_id=choice))
        raise AssertionError("unreachable")


class CharTokenizer:
    """id -> one letter; enough for stop-string and detokenize logic."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if (skip_special_tokens and t < 3) else chr(ord("a") + t % 26) for t in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + (ord(c) - ord("a") - 3) % 26 for c in text]
