"""Sampling with speculation keeps the target distribution, end to end on a tiny model:
the real scheduler, executor and verifier over a random-weight 2-layer model, drafts from a
proposer that is often wrong, many seeds. The first decode step's token (verified against
a draft) and, after an accepted draft, the next token (the second verified row) must each
follow the model's own softmax (chi-square)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sgl.radix import RadixTree
from sgl.runtime.attention.torch_backend import TorchAttentionBackend
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.executor.model_runner import ModelRunner
from sgl.runtime.memory.allocator import ReqToTokenPool, SlotAllocator
from sgl.runtime.memory.kv_pool import KVPool
from sgl.runtime.models.llama import tiny_config, tiny_random_model
from sgl.runtime.sampling_params import SamplingParams
from sgl.runtime.scheduler.kv_cache import KVCache
from sgl.runtime.scheduler.req import Req, ReqOutput
from sgl.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from sgl.runtime.scheduler.speculate import Speculator
from sgl.runtime.speculative.proposer import SpecOptions
from tests.fakes import CharTokenizer

V = 12
PROMPT = [5, 7, 3, 9]
DRAFTS = [4, 6]  # fixed guesses: accepted sometimes, rejected often


class FixedProposer:
    def propose(self, reqs: Sequence[Any], budgets: Sequence[int]) -> list[list[int]]:
        return [DRAFTS[:b] for b in budgets]

    def release(self, uid: int) -> None:
        pass


def target_probs(model: Any, ids: list[int]) -> torch.Tensor:
    """softmax of the model's next-token logits after `ids` (a plain forward, no cache)."""
    pool = KVPool(64, 2, 2, 16, torch.float32)
    table = torch.zeros((1, 64), dtype=torch.int64)
    table[0, : len(ids)] = torch.arange(1, len(ids) + 1)
    batch = ForwardBatch.build(ids, list(range(1, len(ids) + 1)), [0], [0], [len(ids)], table)
    with torch.inference_mode():
        logits = ModelRunner(model, TorchAttentionBackend(pool), use_cpu_decode_kernel=False).forward(batch)
    return torch.softmax(logits[0].float(), dim=-1)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    keep = probs * n >= 5  # pool the rare cells into one
    exp = torch.cat([probs[keep] * n, (probs[~keep] * n).sum().unsqueeze(0)])
    obs = torch.cat([counts[keep], counts[~keep].sum().unsqueeze(0)]).float()
    ok = exp > 0
    return float((((obs - exp) ** 2)[ok] / exp[ok]).sum()), int(ok.sum()) - 1


# chi-square critical values at p = 0.001 by degrees of freedom
CRIT = {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5, 6: 22.5, 7: 24.3, 8: 26.1, 9: 27.9, 10: 29.6, 11: 31.3}


def test_sampled_tokens_keep_the_target_distribution() -> None:
    torch.manual_seed(0)
    model = tiny_random_model(tiny_config(vocab_size=V), dtype=torch.float32, seed=5)
    pool = KVPool(4096, 2, 2, 16, torch.float32)
    runner = ModelRunner(model, TorchAttentionBackend(pool), use_cpu_decode_kernel=False)
    kv = KVCache(RadixTree(), SlotAllocator(4096), ReqToTokenPool(64 + Scheduler.REQ_TABLE_SLACK, 64))
    spec = Speculator(SpecOptions("ngram", num_draft_tokens=2), FixedProposer())
    s = Scheduler(SchedulerConfig(max_running_requests=64), runner, kv, CharTokenizer(), {2}, speculator=spec)
    results: dict[str, ReqOutput] = {}
    n = 3000
    for i in range(n):
        p = SamplingParams.from_dict({"max_new_tokens": 3, "temperature": 1.0, "seed": 1000 + i, "ignore_eos": True})
        s.submit(Req(rid=f"r{i}", input_ids=list(PROMPT), params=p, on_output=lambda o: results.__setitem__(o.rid, o)))
    for _ in range(100000):
        if not s.step() and not s.has_work():
            break
    assert len(results) == n
    outs = [results[f"r{i}"].output_ids for i in range(n)]
    assert spec.stats["spec_accepted_tokens_total"] > 0
    assert spec.stats["spec_accepted_tokens_total"] < spec.stats["spec_draft_tokens_total"]
    # Condition on the most frequent first token t1 (sampled at prefill, no draft), then:
    # token 2 was verified against draft 4; token 3, when token 2 == 4, against draft 6.
    firsts = torch.tensor([o[0] for o in outs])
    t1 = int(torch.bincount(firsts, minlength=V).argmax())
    seconds = [o[1] for o in outs if o[0] == t1]
    counts2 = torch.bincount(torch.tensor(seconds), minlength=V)
    chi2, dof = chi_square(counts2, target_probs(model, PROMPT + [t1]))
    assert len(seconds) > 300 and chi2 < CRIT[dof], (chi2, dof)
    thirds = [o[2] for o in outs if o[0] == t1 and o[1] == DRAFTS[0]]
    if len(thirds) >= 100:
        chi2, dof = chi_square(torch.bincount(torch.tensor(thirds), minlength=V), target_probs(model, PROMPT + [t1, 4]))
        assert chi2 < CRIT[dof], (chi2, dof)
