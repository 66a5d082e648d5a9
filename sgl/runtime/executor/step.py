"""The executor: one `StepPlan` through the model, out comes a `StepResult`.

It builds the ForwardBatch, runs the model runner, fills grammar masks, samples, and
computes prompt and output logprobs. It keeps the only per-request state that lives on
this side of the seam: each sampled request's torch.Generator, created from the seed
the plan carries and dropped when the plan lists the request as released.

Logits rows requested per plan row, in this order (the sampler wants them so):
prompt-logprob positions first, then the sampled position (see executor/plan.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from sgl.runtime.constrained.masks import allocate_masks
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.executor.plan import RowResult, SampleSpec, StepPlan, StepResult
from sgl.runtime.executor.sampler import prompt_logprobs, sample


class ModelRunner(Protocol):
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [len(batch.logits_indices), vocab]."""


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step; the result's rows align with plan.rows."""


def build_forward_batch(plan: StepPlan, req_to_token: torch.Tensor, device: str | torch.device = "cpu"
                        ) -> tuple[ForwardBatch, list[int], list[int]]:
    """(batch, first prompt-logprob logits row per plan row, sampled logits row or -1)."""
    input_ids: list[int] = []
    out_loc: list[int] = []
    logits_idx: list[int] = []
    lp_rows: list[int] = []
    sample_rows: list[int] = []
    for r in plan.rows:
        start = len(input_ids)  # this row's offset on the token axis
        input_ids.extend(r.input_ids)
        out_loc.extend(r.out_cache_loc)
        lp_rows.append(len(logits_idx))
        lo = start + r.prompt_lp_start - r.prefix_len
        logits_idx.extend(range(lo, lo + len(r.prompt_lp_next_ids)))
        sample_rows.append(len(logits_idx) if r.sample is not None else -1)
        if r.sample is not None:
            logits_idx.append(start + r.extend_len - 1)
    fb = ForwardBatch.build(input_ids, out_loc, [r.req_pool_idx for r in plan.rows],
                            [r.prefix_len for r in plan.rows], [r.extend_len for r in plan.rows],
                            req_to_token, logits_indices=logits_idx, device=device)
    return fb, lp_rows, sample_rows


class StepExecutor:
    """The in-process executor over a model runner (`runner.forward(batch) -> logits`)."""

    def __init__(self, runner: ModelRunner, req_to_token: torch.Tensor, device: str | torch.device = "cpu") -> None:
        self.runner = runner
        self.req_to_token = req_to_token
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        self._masks: torch.Tensor | None = None  # grammar mask buffer, reused across steps

    def execute(self, plan: StepPlan) -> StepResult:
        for uid in plan.released_uids:
            self._generators.pop(uid, None)
        fb, lp_rows, sample_rows = build_forward_batch(plan, self.req_to_token, self.device)
        logits = self.runner.forward(fb)
        out = [RowResult() for _ in plan.rows]
        for i, r in enumerate(plan.rows):
            if r.prompt_lp_next_ids:
                lo = lp_rows[i]
                out[i].prompt_logprobs, out[i].prompt_top_logprobs = prompt_logprobs(
                    logits[lo : lo + len(r.prompt_lp_next_ids)], r.prompt_lp_next_ids, r.prompt_top_logprobs_num)
        picked = [i for i, j in enumerate(sample_rows) if j >= 0]
        if picked:
            specs = [s for i in picked if (s := plan.rows[i].sample) is not None]
            idx = [sample_rows[i] for i in picked]
            # Usually every logits row is sampled, in order: skip the gather copy (64 x vocab
            # floats per wide decode step). sample() may edit its input; logits is not read after.
            rows = logits.float() if idx == list(range(logits.shape[0])) else logits[torch.tensor(idx)].float()
            sampled = sample(rows, specs, [self._generator(plan.rows[i].uid, s) for i, s in zip(picked, specs)],
                             self._mask_buffer(specs, rows.shape[1]))
            for i, res in zip(picked, sampled):
                res.prompt_logprobs, res.prompt_top_logprobs = out[i].prompt_logprobs, out[i].prompt_top_logprobs
                out[i] = res
        return StepResult(out)

    def _generator(self, uid: int, spec: SampleSpec) -> torch.Generator | None:
        if spec.params.is_greedy or spec.seed is None:
            return None
        g = self._generators.get(uid)
        if g is None:
            g = self._generators[uid] = torch.Generator()
            g.manual_seed(spec.seed)
        return g

    def _mask_buffer(self, specs: list[SampleSpec], width: int) -> torch.Tensor | None:
        if all(s.grammar is None for s in specs):
            return None
        m = self._masks
        if m is None or m.shape[0] < len(specs) or m.shape[1] < width:
            m = self._masks = allocate_masks(max(len(specs), 64), width)
        return m
