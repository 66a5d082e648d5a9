"""Test doubles for the scheduler: a model runner (logits) and an executor (token ids)
whose next token is a pure function of (previous token, position), and a tiny character
tokenizer. Outputs are therefore predictable, whatever batching, chunking, eviction or
retraction happened."""

from __future__ import annotations

import torch

from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.executor.plan import RowResult, StepPlan, StepResult
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
    logprobs are 0.0 where the prompt token is the one the fake model predicts, else -1.0."""

    def __init__(self, req_to_token: torch.Tensor) -> None:
        self.req_to_token = req_to_token
        self.batches: list[ForwardBatch] = []
        self.plans: list[StepPlan] = []
        self.tokens_computed = 0

    def execute(self, plan: StepPlan) -> StepResult:
        batch = build_forward_batch(plan, self.req_to_token)[0]
        check_batch(batch)
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
                res.token_id = next_token(r.input_ids[-1], r.prefix_len + r.extend_len - 1)
            out.append(res)
        return StepResult(out)


class CharTokenizer:
    """id -> one letter; enough for stop-string and detokenize logic."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if (skip_special_tokens and t < 3) else chr(ord("a") + t % 26) for t in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + (ord(c) - ord("a") - 3) % 26 for c in text]
