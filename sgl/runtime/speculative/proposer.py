"""The proposer seam and the options of speculative decoding.

A proposer guesses the tokens that follow each request's `fill_ids`. It may keep state per
request (an n-gram index, a draft model's KV), keyed by `Req.uid`; since the scheduler may
retract a request, rewrite its tail (jump-forward retokenizes the last token) or accept
only part of a draft, a proposer must treat `fill_ids` as the truth at every call and
reconcile its state with it (e.g. by the longest common prefix), never assume that its
last drafts were accepted. Proposals are deterministic: the verifier treats a draft as a
point-mass proposal, which keeps sampling exact for any proposer (verify.py).

Room for EAGLE/MTP heads: such a proposer reads the target's hidden states; it would take
them from the step result through the same `propose` call (a later field of `Req`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

ALGORITHMS = ("ngram", "draft")
# SGLang's spellings of the same algorithms.
ALIASES = {"ngram": "ngram", "draft": "draft", "standalone": "draft", "draft_model": "draft"}


def algorithm_name(value: str) -> str:
    """Our name for a --speculative-algorithm value (case-insensitive, SGLang's names too)."""
    name = ALIASES.get(value.strip().lower())
    if name is None:
        raise ValueError(f"speculative_algorithm must be one of ngram, draft (or SGLang's NGRAM, STANDALONE); "
                         f"got {value!r}")
    return name


@dataclass(frozen=True)
class SpecOptions:
    """What the scheduler needs to speculate (built from EngineConfig)."""

    algorithm: str  # "ngram" | "draft"
    num_draft_tokens: int = 4  # most drafts verified per request per step
    ngram_min_window: int = 1  # shortest suffix that may match
    ngram_max_window: int = 12  # longest suffix compared
    # Most token rows a decode step may have (decode rows + drafts), or None: set where a
    # fast decode path takes a bounded number of rows (the CPU C decode step), so drafts
    # never push a step onto a slower path.
    max_step_rows: int | None = None
    # One draft row's cost as a share of a one-row decode step (calibrate.py), or None:
    # verify every proposed draft (tests; hosts where it could not be measured).
    row_cost: float | None = None


class Proposer(Protocol):
    def propose(self, reqs: Sequence[Any], budgets: Sequence[int]) -> list[list[int]]:
        """For each request, at most budgets[i] tokens guessed to follow its fill_ids
        (an empty list: no guess). Called once per decode step, on the scheduler thread."""

    def release(self, uid: int) -> None:
        """The request finished or left: drop whatever was kept for it."""


def clip_to_grammar(grammar: Any, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` the request's grammar allows from its state (it has
    accepted every output token, pending ones included). The state is unchanged after."""
    ok = 0
    try:
        for t in drafts:
            if grammar.is_terminated():
                break
            grammar.accept_token(t)
            ok += 1
    except ValueError:
        pass
    finally:
        if ok:
            grammar.rollback(ok)
    return drafts[:ok]
