"""Verification: the target's logits at a row's last k+1 positions decide which of its k
drafts stand, and the token that follows them.

Row j of the logits scores the token after d_0 .. d_{j-1}. Each row is prepared as a plain
decode step at that point would be: penalties count the drafts before it as output, the
grammar mask is the matcher's after accepting them (filled one row at a time, then rolled
back), banned ids as planned. Then:

  - greedy: the target's choice c_j = argmax of row j; drafts stand while c_j == d_j, and
    c_a (first mismatch, or row k after all k) is the row's own token. The tokens are
    those of k+1 plain greedy steps, given logits that do not depend on the batch.
  - sampling: a deterministic draft is a point-mass proposal q = delta(d_j), and the
    standard rule for it reads: accept d_j with probability p_j(d_j); on rejection sample
    from p_j with d_j removed (max(0, p - q), renormalized); after k acceptances sample
    row k. Each emitted token is distributed exactly as the target would sample it.

Logprobs reported for every emitted token are the raw model's (log-softmax of the
unprocessed logits), as in the sampler.
"""

from __future__ import annotations

import dataclasses

import torch

from sgl.runtime.constrained.masks import allocate_masks, apply_masks
from sgl.runtime.executor.plan import RowResult, SampleSpec
from sgl.runtime.executor.sampler import apply_banned, apply_penalties, draw, sampling_probs, top_logprobs


def _fill_grammar_rows(grammar: object, drafts: list[int], masks: torch.Tensor) -> None:
    """masks[j] = the grammar's mask after accepting drafts[:j]; the matcher ends unchanged."""
    accepted = 0
    try:
        for j in range(len(drafts) + 1):
            masks[j].zero_()
            grammar.fill_mask(masks[j])  # type: ignore[attr-defined]
            if j < len(drafts):
                grammar.accept_token(drafts[j])  # type: ignore[attr-defined]
                accepted += 1
    finally:
        if accepted:
            grammar.rollback(accepted)  # type: ignore[attr-defined]


def _position_specs(spec: SampleSpec, drafts: list[int]) -> list[SampleSpec]:
    if spec.penalty_output_ids is None:
        return [spec] * (len(drafts) + 1)
    return [dataclasses.replace(spec, penalty_output_ids=list(spec.penalty_output_ids) + drafts[:j])
            for j in range(len(drafts) + 1)]


@torch.inference_mode()
def verify(logits: torch.Tensor, spec: SampleSpec, generator: torch.Generator | None,
           masks: torch.Tensor | None = None) -> RowResult:
    """logits: float32 [k+1, V] for a row with k = len(spec.draft_ids) drafts (edited in
    place). `masks`: a reusable bool buffer of at least [k+1, V] for a grammar row."""
    drafts = list(spec.draft_ids)
    k = len(drafts)
    n, vocab = logits.shape
    assert n == k + 1, f"verification of {k} drafts needs {k + 1} logits rows, got {n}"
    raw_lp = torch.log_softmax(logits, dim=-1) if spec.want_logprob else None
    specs = _position_specs(spec, drafts)
    apply_penalties(logits, specs)
    if spec.grammar is not None:
        view = (masks if masks is not None else allocate_masks(n, vocab))[:n, :vocab]
        _fill_grammar_rows(spec.grammar, drafts, view)
        apply_masks(logits, view, range(n))
    apply_banned(logits, specs)

    tokens = None
    if not spec.params.is_greedy:
        tokens = _rejection_sample(sampling_probs(logits, [spec.params] * n), drafts, generator)
    if tokens is None:  # greedy, or a sampled distribution that broke down (sampler.draw)
        choice = torch.argmax(logits, dim=-1).tolist()
        a = 0
        while a < k and choice[a] == drafts[a]:
            a += 1
        tokens = drafts[:a] + [int(choice[a])]

    results = [RowResult(token_id=t) for t in tokens]
    if raw_lp is not None:
        for j, r in enumerate(results):
            r.logprob = float(raw_lp[j, r.token_id])
            if spec.top_logprobs_num > 0:
                r.top_logprobs = top_logprobs(raw_lp[j], spec.top_logprobs_num)
    last = results[-1]
    last.accepted = results[:-1]
    return last


def _rejection_sample(probs: torch.Tensor, drafts: list[int],
                      generator: torch.Generator | None) -> list[int] | None:
    """Accepted drafts and one drawn token; None where a row's distribution broke down."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = probs[j]
        if float(torch.rand((), generator=generator)) < float(p[d]):
            out.append(d)
            continue
        rest = p.clone()
        rest[d] = 0.0
        if float(rest.sum()) <= 0.0:  # p(d) == 1 up to rounding: d is the only choice
            out.append(d)
            continue
        token = draw(rest, generator)
        return None if token is None else [*out, token]
    token = draw(probs[len(drafts)], generator)
    return None if token is None else [*out, token]
