"""Req: one request's state inside the scheduler (plain data, no tensors).

The request's token stream is `fill_ids = input_ids + output_ids`. Its KV state:

    0           num_tree_tokens            num_computed          len(fill_ids)
    |-- shared, owned by the radix tree --|-- owned by this req --|-- pending --|
    slots[i] is the KV slot of fill_ids[i] for i < num_computed.

Pending tokens (KV not computed yet) are the prompt tail during prefill, the last
sampled token during decode, or a jump-forward run forced by the grammar.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from sgl.runtime.sampling_params import SamplingParams
from sgl.runtime.scheduler.detokenize import DecodeState


@dataclass
class ReqOutput:
    """What the scheduler emits for a request: cumulative text and ids so far. `text` is
    None where the scheduler leaves decoding to its receiver (see OutputProcessor)."""

    rid: str
    text: str | None
    output_ids: list[int]
    finished: bool
    meta_info: dict[str, Any]


@dataclass(eq=False)  # identity semantics: queues hold and remove requests by identity
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs
    top_logprobs_num: int = 0
    stream: bool = False
    on_output: Callable[[ReqOutput], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    grammar: Any = None  # a Grammar (sgl.runtime.constrained.base), or None
    grammar_future: Any = None  # concurrent.futures.Future while compiling
    seed: int | None = None  # sampling seed (resolved at admission for non-greedy requests)
    uid: int = -1  # unique per scheduler; names the request's state on the executor side
    # PD disaggregation (sgl/runtime/disaggregation): where this request's KV comes from
    # (decode) or which room it serves (prefill); cleared once a decode request has its KV.
    bootstrap: Any = None  # protocol.Bootstrap
    pd_meta: dict[str, Any] | None = None  # transfer facts added to meta_info
    # Token healing (constrained/healing.py): input_ids is the backed-up prompt, and the
    # output text starts with heal_text (stripped from what the user sees).
    heal_prefix: bytes = b""
    heal_text: str = ""
    healed_tokens: int = 0

    # KV state (see module docstring)
    req_pool_idx: int | None = None
    slots: list[int] = field(default_factory=list)
    num_tree_tokens: int = 0
    last_node: Any = None  # locked radix node covering slots[:num_tree_tokens]
    # Speculative drafts for the step being run (after fill_ids; slots of their own, written
    # to the table after `slots`); empty between steps (scheduler/speculate.py).
    draft_ids: list[int] = field(default_factory=list)
    draft_slots: list[int] = field(default_factory=list)

    # accounting
    num_cached_tokens: int = 0  # prefix hit at first admission (all tiers)
    cached_tokens_details: dict[str, int] | None = None  # per tier, when the hierarchical cache is on
    page_hashes: list[int] = field(default_factory=list)  # hierarchical cache: the prompt's full pages
    admitted_once: bool = False
    jump_forward_tokens: int = 0
    spec_verify_ct: int = 0  # decode steps run with speculation on
    spec_draft_tokens: int = 0  # drafts proposed for it
    spec_accepted_tokens: int = 0  # drafts the target accepted
    num_retractions: int = 0
    aborted_message: str | None = None
    finish_reason: dict[str, Any] | None = None
    text: str = ""
    stop_check_from: int = 0  # text offset where the stop-string scan resumes
    detok: DecodeState = field(default_factory=DecodeState)  # incremental detokenization of output_ids
    created_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    # logprobs: lists of (logprob | None, token_id); tops: list of [(logprob, token_id)] | None
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_logprobs_done: bool = False
    output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def fill_slice(self, lo: int, hi: int) -> list[int]:
        """fill_ids[lo:hi] without building fill_ids (a decode step wants one token of it)."""
        k = len(self.input_ids)
        if lo >= k:
            return self.output_ids[lo - k : hi - k]
        return self.input_ids[lo:hi] + self.output_ids[: max(0, hi - k)]

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def num_computed(self) -> int:
        return len(self.slots)

    @property
    def num_pending(self) -> int:
        return self.fill_len - len(self.slots)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_done

    def first_logprob_row(self) -> int:
        """Position whose logits give the first requested prompt-token logprob.

        Token j's logprob comes from the logits at position j-1, so the prefix reused from
        the cache must stop before that position.
        """
        return max(self.logprob_start_len, 1) - 1
