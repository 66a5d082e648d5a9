"""Turn the scheduler's batch [(req, num_new_tokens)], whose KV slots are already
allocated and written into the request -> token table, into a plain `StepPlan`.

Per request the new tokens are fill_ids[c0 : c0 + n] (c0 = tokens already computed
before this step), then the request's speculative drafts, if any. The plan asks for
  - prompt logprobs at positions p in [max(c0, first_logprob_row), min(c0 + n, prompt_len - 1)),
    each scoring the prompt token p + 1;
  - a sampled token when the step reaches the end of fill_ids (`update` drops it for a
    request that turns out finished, e.g. max_new_tokens=0).
"""

from __future__ import annotations

from sgl.runtime.executor.plan import PlanRow, SampleSpec, StepPlan
from sgl.runtime.scheduler.req import Req


def sample_spec(req: Req, eos_ids: set[int]) -> SampleSpec:
    p = req.params
    banned = None
    if len(req.output_ids) < p.min_new_tokens:
        banned = sorted((set() if p.ignore_eos else eos_ids) | set(p.stop_token_ids))
    penalized = p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1
    return SampleSpec(
        params=p, seed=req.seed, banned=banned,
        penalty_prompt_ids=req.input_ids if penalized else None,
        penalty_output_ids=req.output_ids if penalized else None,
        want_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
        grammar=req.grammar,
    )


def make_plan(batch: list[tuple[Req, int]], eos_ids: set[int], released_uids: list[int]) -> StepPlan:
    rows: list[PlanRow] = []
    for req, n in batch:
        assert n > 0, "a planned request computes at least one token of its own"
        c0 = req.num_computed - n  # slots for this step were appended already
        assert req.req_pool_idx is not None
        row = PlanRow(uid=req.uid, req_pool_idx=req.req_pool_idx, prefix_len=c0,
                      input_ids=req.fill_slice(c0, c0 + n) + req.draft_ids,
                      out_cache_loc=req.slots[c0 : c0 + n] + req.draft_slots)
        if req.wants_input_logprobs:
            lo = max(c0, req.first_logprob_row())
            hi = min(c0 + n, len(req.input_ids) - 1)
            row.prompt_lp_start = lo
            row.prompt_lp_next_ids = req.input_ids[lo + 1 : hi + 1]
            row.prompt_top_logprobs_num = req.top_logprobs_num
        if c0 + n == req.fill_len:
            row.sample = sample_spec(req, eos_ids)
            row.sample.draft_ids = list(req.draft_ids)
        rows.append(row)
    return StepPlan(rows=rows, released_uids=released_uids)
