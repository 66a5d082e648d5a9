"""Test doubles for the scheduler: a model runner whose next token is a pure function
of (previous token, position), and a tiny character tokenizer. Outputs are therefore
predictable, whatever batching, chunking, eviction or retraction happened."""

from __future__ import annotations

import torch

from sgl.runtime.executor.forward_batch import ForwardBatch

VOCAB = 64
EOS = 2


def next_token(prev: int, pos: int) -> int:
    return 3 + (prev * 31 + pos * 7) % (VOCAB - 3)  # never EOS, never 0..2


def expected_output(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq[-1], len(seq) - 1))
    return seq[len(prompt):]


class FakeRunner:
    """Checks the batch is well formed, then returns one-hot-ish logits."""

    def __init__(self) -> None:
        self.batches: list[ForwardBatch] = []
        self.tokens_computed = 0

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.batches.append(batch)
        self.tokens_computed += batch.num_tokens
        ids = batch.input_ids.tolist()
        pos = batch.positions.tolist()
        assert len(set(batch.out_cache_loc.tolist())) == batch.num_tokens, "two tokens share a KV slot"
        assert 0 not in batch.out_cache_loc.tolist(), "slot 0 is reserved"
        for i, row in enumerate(batch.req_pool_indices.tolist()):
            seq = batch.seq_lens_cpu[i]
            table = batch.req_to_token[row, :seq].tolist()
            s, e = batch.extend_start_loc[i].item(), batch.extend_lens_cpu[i]
            assert table[seq - e:] == batch.out_cache_loc[s:s + e].tolist(), "table does not cover new tokens"
            assert pos[s:s + e] == list(range(seq - e, seq))
        rows = batch.logits_indices.tolist()
        logits = torch.full((len(rows), VOCAB), -10.0)
        for j, r in enumerate(rows):
            logits[j, next_token(ids[r], pos[r])] = 10.0
        return logits


class CharTokenizer:
    """id -> one letter; enough for stop-string and detokenize logic."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if (skip_special_tokens and t < 3) else chr(ord("a") + t % 26) for t in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + (ord(c) - ord("a") - 3) % 26 for c in text]
