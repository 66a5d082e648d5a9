"""The step seam: the scheduler's `StepPlan` in, the executor's `StepResult` out.

The scheduler decides *what* runs (which requests, which of their tokens, where their
KV goes, how each sampled row is sampled); the executor runs the model, fills grammar
masks, samples and computes logprobs, and answers with token ids and floats. The
scheduler never sees logits; the executor never sees a queue or a radix tree.

Both sides are plain dataclasses (lists of ints and floats, `SamplingParams`), so a
later issue can send them across processes (rank 0 schedules and broadcasts the plan;
every tensor-parallel rank executes it). One field is not plain: `SampleSpec.grammar`,
the request's grammar matcher, kept by reference so the in-process executor fills its
mask row without a copy of the matcher's state. Across processes it would become the
grammar's mask (or its state id) computed on the scheduler side.

For one plan row (request), the new tokens and the logits rows it asks for:

    0 ........ prefix_len ............................. prefix_len + len(input_ids)
    |-- KV in the pool --|-- input_ids (KV written at out_cache_loc) --|
                              prompt logprob positions:  [prompt_lp_start,
                                 prompt_lp_start + len(prompt_lp_next_ids))
                              sampled position: the last new token, when `sample` is set

With speculative decoding a decode row's input_ids end with `sample.draft_ids` (k tokens
guessed by a proposer, KV slots of their own); the row then asks for the logits of its last
k+1 tokens, and its result lists the accepted drafts before its own token
(sgl/runtime/speculative/verify.py):

    input_ids:  pending (last sampled, or a jump-forward run) | d_0 .. d_{k-1}
    logits:                                        row 0 .. row k
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sgl.runtime.sampling_params import SamplingParams

TopLogprobs = list[tuple[float, int]]  # [(logprob, token_id)], best first


@dataclass
class SampleSpec:
    """How to sample one row: everything the sampler needs, nothing it must look up."""

    params: SamplingParams
    seed: int | None = None  # non-greedy rows: seeds the request's generator on first use
    banned: list[int] | None = None  # ids forbidden now (eos / stop ids before min_new_tokens)
    # Ids seen so far, only for rows with a frequency / presence / repetition penalty.
    penalty_prompt_ids: list[int] | None = None
    penalty_output_ids: list[int] | None = None
    want_logprob: bool = False
    top_logprobs_num: int = 0
    grammar: Any = None  # the one non-plain field: see the module docstring
    draft_ids: list[int] = field(default_factory=list)  # speculative drafts ending the row's input_ids


@dataclass
class PlanRow:
    """One request's part of a step."""

    uid: int  # the request's id for executor-side state (its sampling generator)
    req_pool_idx: int  # its row in the request -> token table
    prefix_len: int  # tokens whose KV is already computed (c0)
    input_ids: list[int]  # the new tokens, fill_ids[c0 : c0 + extend_len]
    out_cache_loc: list[int]  # KV slot of each new token
    prompt_lp_start: int = 0  # first position whose logits give a prompt logprob
    prompt_lp_next_ids: list[int] = field(default_factory=list)  # the prompt token each scores
    prompt_top_logprobs_num: int = 0
    sample: SampleSpec | None = None  # None: a prefill chunk that ends before the prompt does

    @property
    def extend_len(self) -> int:
        return len(self.input_ids)


@dataclass
class StepPlan:
    rows: list[PlanRow]
    released_uids: list[int] = field(default_factory=list)  # finished since the last plan: drop their state
    # (row, start, slots) writes to the request -> token table since the last plan, for
    # executors that keep their own copy of the table (tensor-parallel ranks other than 0).
    table_writes: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # Hierarchical KV cache copies, run before the forward (memory/host_pool.py says in
    # which order and why): (host page, device slots) device -> host, (host page, first
    # token in the page, device slots) host -> device, and (host page, bytes) from the
    # storage tier into host memory (rank 0 only; storage is off with tensor parallelism).
    kv_stores: list[tuple[int, list[int]]] = field(default_factory=list)
    kv_loads: list[tuple[int, int, list[int]]] = field(default_factory=list)
    kv_fills: list[tuple[int, bytes | memoryview]] = field(default_factory=list)


class FatalExecutorError(RuntimeError):
    """Raised by an executor that can never run another step (a tensor-parallel peer
    died mid-collective): the scheduler stops instead of failing one batch and going on."""


@dataclass
class RowResult:
    token_id: int = -1  # -1: the row sampled nothing
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    # Speculative decoding: the drafts the target accepted (token, logprob each), in order;
    # token_id above follows them (the target's own token after the last accepted draft).
    accepted: list["RowResult"] = field(default_factory=list)


@dataclass
class StepResult:
    rows: list[RowResult]  # aligned with StepPlan.rows

    @staticmethod
    def of_tokens(token_ids: list[int]) -> "StepResult":
        """Token ids only (-1 for rows that sample nothing): what fake executors return."""
        return StepResult([RowResult(token_id=t) for t in token_ids])
