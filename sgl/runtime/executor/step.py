"""The executor: one `StepPlan` through the model, out comes a `StepResult`.

It builds the ForwardBatch, runs the model runner, fills grammar masks, samples, and
computes prompt and output logprobs. It keeps the only per-request state that lives on
this side of the seam: each sampled request's torch.Generator, created from the seed
the plan carries and dropped when the plan lists the request as released.

Logits rows requested per plan row, in this order (the sampler wants them so):
prompt-logprob positions first, then the sampled position (see executor/plan.py).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from sgl.runtime.constrained.masks import allocate_masks
from sgl.runtime.executor.forward_batch import ForwardBatch
from sgl.runtime.executor.plan import FatalExecutorError, RowResult, SampleSpec, StepPlan, StepResult
from sgl.runtime.ipc.messages import Forward
from sgl.runtime.memory.host_pool import HostKVPool
from sgl.runtime.executor.sampler import prompt_logprobs, sample
from sgl.runtime.speculative.verify import verify


class ModelRunner(Protocol):
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [len(batch.logits_indices), vocab]."""


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step; the result's rows align with plan.rows."""


def forward_inputs(plan: StepPlan) -> tuple[Forward, list[int], list[int]]:
    """(the step as plain lists, first prompt-logprob logits row per plan row, sampled
    logits row or -1)."""
    fwd = Forward(table_writes=plan.table_writes, kv_stores=plan.kv_stores, kv_loads=plan.kv_loads)
    lp_rows: list[int] = []
    sample_rows: list[int] = []
    logits_idx = fwd.logits_indices
    for r in plan.rows:
        start = len(fwd.input_ids)  # this row's offset on the token axis
        fwd.input_ids.extend(r.input_ids)
        fwd.out_cache_loc.extend(r.out_cache_loc)
        fwd.req_pool_indices.append(r.req_pool_idx)
        fwd.prefix_lens.append(r.prefix_len)
        fwd.extend_lens.append(r.extend_len)
        lp_rows.append(len(logits_idx))
        lo = start + r.prompt_lp_start - r.prefix_len
        logits_idx.extend(range(lo, lo + len(r.prompt_lp_next_ids)))
        sample_rows.append(len(logits_idx) if r.sample is not None else -1)
        if r.sample is not None:  # the last token's row, after the rows of any drafts before it
            end = start + r.extend_len
            logits_idx.extend(range(end - 1 - len(r.sample.draft_ids), end))
    return fwd, lp_rows, sample_rows


def to_batch(fwd: Forward, req_to_token: torch.Tensor, device: str | torch.device = "cpu") -> ForwardBatch:
    return ForwardBatch.build(fwd.input_ids, fwd.out_cache_loc, fwd.req_pool_indices, fwd.prefix_lens,
                              fwd.extend_lens, req_to_token, logits_indices=fwd.logits_indices, device=device)


def build_forward_batch(plan: StepPlan, req_to_token: torch.Tensor, device: str | torch.device = "cpu"
                        ) -> tuple[ForwardBatch, list[int], list[int]]:
    """(batch, first prompt-logprob logits row per plan row, sampled logits row or -1)."""
    fwd, lp_rows, sample_rows = forward_inputs(plan)
    return to_batch(fwd, req_to_token, device), lp_rows, sample_rows


class Peers(Protocol):
    """The other tensor-parallel ranks, as rank 0's executor sees them."""

    def send(self, fwd: Forward) -> None:
        """Have every other rank run `fwd` with us (its collectives pair with ours)."""


class StepExecutor:
    """The in-process executor over a model runner (`runner.forward(batch) -> logits`)."""

    def __init__(self, runner: ModelRunner, req_to_token: torch.Tensor, device: str | torch.device = "cpu",
                 peers: Peers | None = None, host_pool: HostKVPool | None = None, kv_pool: Any = None) -> None:
        self.runner = runner
        self.host_pool = host_pool  # the hierarchical cache's host tier, with the device pool it pairs with
        self.kv_pool = kv_pool
        self.copy_stats = {"hicache_load_seconds": 0.0, "hicache_store_seconds": 0.0}
        self.peers = peers
        self.req_to_token = req_to_token
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        self._masks: torch.Tensor | None = None  # grammar mask buffer, reused across steps

    def execute(self, plan: StepPlan) -> StepResult:
        for uid in plan.released_uids:
            self._generators.pop(uid, None)
        fwd, lp_rows, sample_rows = forward_inputs(plan)
        if not plan.rows:  # copies only (the scheduler had no batch)
            if self.peers is not None:
                self.peers.send(fwd)
            self._copies(plan)
            return StepResult([])
        batch = to_batch(fwd, self.req_to_token, self.device)
        if self.peers is None:
            self._copies(plan)
            logits = self.runner.forward(batch)
        else:
            self.peers.send(fwd)
            try:
                self._copies(plan)
                logits = self.runner.forward(batch)
            except Exception as e:  # the ranks are out of step in their collectives for good
                raise FatalExecutorError(f"tensor-parallel forward failed: {type(e).__name__}: {e}") from e
        out = [RowResult() for _ in plan.rows]
        for i, r in enumerate(plan.rows):
            if r.prompt_lp_next_ids:
                lo = lp_rows[i]
                out[i].prompt_logprobs, out[i].prompt_top_logprobs = prompt_logprobs(
                    logits[lo : lo + len(r.prompt_lp_next_ids)], r.prompt_lp_next_ids, r.prompt_top_logprobs_num)
        picked = [i for i, j in enumerate(sample_rows) if j >= 0]
        drafted = [i for i in picked if plan.rows[i].sample.draft_ids]  # type: ignore[union-attr]
        if drafted:
            picked = [i for i in picked if not plan.rows[i].sample.draft_ids]  # type: ignore[union-attr]
            self._verify(plan, logits, sample_rows, drafted, out)
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

    def _verify(self, plan: StepPlan, logits: torch.Tensor, sample_rows: list[int], drafted: list[int],
                out: list[RowResult]) -> None:
        """Rows with speculative drafts: accept or reject them (speculative/verify.py)."""
        for i in drafted:
            spec = plan.rows[i].sample
            assert spec is not None
            lo, k = sample_rows[i], len(spec.draft_ids)
            masks = self._mask_buffer([spec], logits.shape[1], k + 1)
            res = verify(logits[lo : lo + k + 1].float(), spec, self._generator(plan.rows[i].uid, spec), masks)
            res.prompt_logprobs, res.prompt_top_logprobs = out[i].prompt_logprobs, out[i].prompt_top_logprobs
            out[i] = res

    def _copies(self, plan: StepPlan) -> None:
        if not (plan.kv_stores or plan.kv_loads or plan.kv_fills):
            return
        t0 = time.perf_counter()
        host = self.host_pool
        if host is None:
            raise RuntimeError("a step carries KV tier copies but this executor has no host tier")
        host.store(self.kv_pool, plan.kv_stores)
        for page, blob in plan.kv_fills:
            host.fill(page, blob)
        if plan.kv_stores and str(self.device).startswith("cuda"):
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        host.load(self.kv_pool, plan.kv_loads)
        if plan.kv_loads and str(self.device).startswith("cuda"):
            torch.cuda.synchronize()
        self.copy_stats["hicache_store_seconds"] += t1 - t0
        self.copy_stats["hicache_load_seconds"] += time.perf_counter() - t1

    def _generator(self, uid: int, spec: SampleSpec) -> torch.Generator | None:
        if spec.params.is_greedy or spec.seed is None:
            return None
        g = self._generators.get(uid)
        if g is None:
            g = self._generators[uid] = torch.Generator()
            g.manual_seed(spec.seed)
        return g

    def _mask_buffer(self, specs: list[SampleSpec], width: int, rows: int = 0) -> torch.Tensor | None:
        if all(s.grammar is None for s in specs):
            return None
        need = max(len(specs), rows)
        m = self._masks
        if m is None or m.shape[0] < need or m.shape[1] < width:
            m = self._masks = allocate_masks(max(need, 64), width)
        return m
