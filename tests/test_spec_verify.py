"""The verifier and the n-gram proposer on their own: greedy acceptance is the prefix of
agreement, rejection sampling keeps the target distribution (chi-square over many seeds),
grammar masks follow the drafts row by row and leave the matcher unchanged, logprobs are
the raw model's; the n-gram index proposes what followed the longest match and survives
a rewritten tail."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl.runtime.executor.plan import SampleSpec
from sgl.runtime.sampling_params import SamplingParams
from sgl.runtime.speculative.ngram import NgramProposer
from sgl.runtime.speculative.proposer import algorithm_name, clip_to_grammar
from sgl.runtime.speculative.verify import verify

V = 8


def greedy_logits(choices: list[int]) -> torch.Tensor:
    x = torch.zeros(len(choices), V)
    for j, c in enumerate(choices):
        x[j, c] = 5.0
    return x


@pytest.mark.parametrize("drafts,choices,accepted,final", [
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3], 4),  # all accepted, bonus token
    ([1, 2, 3], [1, 5, 3, 4], [1], 5),  # mismatch at row 1: the target's token replaces d_1
    ([1, 2, 3], [6, 2, 3, 4], [], 6),
    ([7], [7, 0], [7], 0),
])
def test_greedy_accepts_the_prefix_of_agreement(drafts, choices, accepted, final) -> None:
    spec = SampleSpec(params=SamplingParams(temperature=0), draft_ids=drafts, want_logprob=True, top_logprobs_num=2)
    logits = greedy_logits(choices)
    raw = torch.log_softmax(logits, dim=-1)
    res = verify(logits.clone(), spec, None)
    assert [r.token_id for r in res.accepted] == accepted and res.token_id == final
    for j, r in enumerate(res.accepted + [res]):
        assert r.logprob == pytest.approx(float(raw[j, r.token_id]))
        assert r.top_logprobs is not None and r.top_logprobs[0][1] == choices[j]


class OnlyEven:
    """A grammar allowing even ids only, then (after 2 tokens) only id 6."""

    def __init__(self) -> None:
        self.hist: list[int] = []

    def fill_mask(self, row: torch.Tensor) -> None:
        if len(self.hist) >= 2:
            row[6] = True
        else:
            row[0::2] = True

    def accept_token(self, t: int) -> None:
        if (len(self.hist) >= 2 and t != 6) or t % 2:
            raise ValueError("not allowed")
        self.hist.append(t)

    def rollback(self, n: int) -> None:
        del self.hist[len(self.hist) - n:]

    def is_terminated(self) -> bool:
        return False


def test_grammar_masks_follow_the_drafts_and_the_matcher_is_unchanged() -> None:
    g = OnlyEven()
    g.accept_token(0)
    # Row 0 after [0]: even only -> argmax over evens is 2 (the odd 3 is masked).
    # Row 1 after [0, 2]: only 6 is allowed, whatever the logits say.
    logits = torch.zeros(2, V)
    logits[0, 3], logits[0, 2] = 9.0, 4.0
    logits[1, 1] = 9.0
    spec = SampleSpec(params=SamplingParams(temperature=0), draft_ids=[2], grammar=g)
    res = verify(logits, spec, None)
    assert [r.token_id for r in res.accepted] == [2] and res.token_id == 6
    assert g.hist == [0]


def test_clip_to_grammar_cuts_at_the_first_forbidden_draft() -> None:
    g = OnlyEven()
    assert clip_to_grammar(g, [2, 4, 6, 8]) == [2, 4, 6]  # after two tokens only 6 is allowed
    assert g.hist == []
    assert clip_to_grammar(g, [1, 2]) == []


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Over many seeds, the first emitted token follows softmax(row 0) and, given d_0 was
    accepted, the second follows softmax(row 1), whatever the drafts are."""
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 1.5
    p = torch.softmax(logits, dim=-1)
    drafts = [int(torch.argsort(p[0])[-2]), int(torch.argsort(p[1])[0])]  # 2nd likeliest; unlikeliest
    params = SamplingParams(temperature=1.0)
    n = 6000
    first = [0] * V
    second = [0] * V
    for seed in range(n):
        g = torch.Generator()
        g.manual_seed(seed)
        res = verify(logits.clone(), SampleSpec(params=params, draft_ids=drafts, seed=seed), g)
        toks = [r.token_id for r in res.accepted] + [res.token_id]
        first[toks[0]] += 1
        if toks[0] == drafts[0]:
            second[toks[1]] += 1
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001.
    assert chi_square(first, p[0].tolist()) < 24.3
    assert sum(second) > 300 and chi_square(second, p[1].tolist()) < 24.3
    assert first[drafts[0]] / n == pytest.approx(float(p[0, drafts[0]]), abs=0.03)


def test_sampled_verification_is_reproducible_with_a_seed() -> None:
    logits = torch.randn(4, V)
    spec = SampleSpec(params=SamplingParams(temperature=0.8, top_k=5), draft_ids=[1, 2, 3], seed=7)
    outs = []
    for _ in range(2):
        g = torch.Generator()
        g.manual_seed(7)
        r = verify(logits.clone(), spec, g)
        outs.append([x.token_id for x in r.accepted] + [r.token_id])
    assert outs[0] == outs[1]


def test_a_sampled_row_whose_distribution_overflows_verifies_as_greedy() -> None:
    # logits / 1e-39 overflows to inf and the probabilities to NaN: multinomial refuses them
    logits = greedy_logits([2, 7, 4, 5])
    spec = SampleSpec(params=SamplingParams(temperature=1e-39), draft_ids=[2, 7, 1])
    r = verify(logits.clone(), spec, torch.Generator().manual_seed(0))
    assert [x.token_id for x in r.accepted] + [r.token_id] == [2, 7, 4]


def req(uid: int, toks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(uid=uid, fill_ids=toks)


def test_ngram_proposes_what_followed_the_longest_match() -> None:
    p = NgramProposer(1, 4)
    toks = [1, 2, 3, 4, 5, 9, 9, 3, 4, 5, 6, 7, 0, 3, 4]
    # suffix [.., 0, 3, 4]: [3, 4] also ends at 3 (then 5, 9, 9) and at 8 (then 5, 6, 7); both
    # match 2 tokens, so the newer one wins.
    assert p.propose([req(1, toks)], [3]) == [[5, 6, 7]]
    assert p.propose([req(1, toks + [5, 6])], [2]) == [[7, 0]]  # [3 4 5 6] matches at 7..10
    assert p.propose([req(1, toks + [5, 6])], [0]) == [[]]
    assert p.propose([req(2, [1, 2, 3])], [4]) == [[]]  # no earlier occurrence


def test_ngram_min_window_and_resync_after_a_rewritten_tail() -> None:
    p = NgramProposer(2, 4)
    assert p.propose([req(1, [5, 1, 2, 8, 1])], [2]) == [[]]  # only a 1-token match
    assert p.propose([req(1, [5, 1, 2, 8, 1, 2])], [2]) == [[8, 1]]
    # jump-forward rewrote the tail: [.., 1, 2] -> [.., 1, 7, 7]
    assert p.propose([req(1, [5, 1, 2, 8, 1, 7, 7])], [2]) == [[]]
    assert p.propose([req(1, [5, 1, 2, 8, 1, 7, 7, 5, 1])], [3]) == [[2, 8, 1]]
    p.release(1)
    assert p._hist == {}
    with pytest.raises(ValueError, match="min_match_window"):
        NgramProposer(3, 2)


def test_algorithm_names() -> None:
    assert algorithm_name("NGRAM") == "ngram" and algorithm_name("STANDALONE") == "draft"
    with pytest.raises(ValueError, match="speculative_algorithm"):
        algorithm_name("eagle")


def test_draft_policy_follows_acceptance_and_row_cost() -> None:
    from sgl.runtime.speculative.policy import PROBE_EVERY, DraftPolicy

    assert DraftPolicy(None).lengths([1, 2], [4, 3]) == [4, 3]  # no measurement: verify all
    cheap, dear = DraftPolicy(0.05), DraftPolicy(1.0)
    assert cheap.lengths([1], [4]) == [3]  # p = 0.5 prior: the 4th draft (q = 1/16) does not pay
    assert dear.lengths([1], [4]) == [0]  # a row costs a whole step: only certainty would pay
    for _ in range(12):  # request 1 copies its context: every draft stands
        cheap.observe(1, 4, 4)
        cheap.observe(2, 4, 0)  # request 2 never matches
    got = cheap.lengths([1, 2], [4, 4])
    assert got[0] == 4 and got[1] == 0
    probes = [cheap.lengths([2], [4])[0] for _ in range(PROBE_EVERY)]
    assert probes.count(1) == 1 and probes.count(0) == PROBE_EVERY - 1  # probed once in a while
    cheap.release(2)
    assert cheap.lengths([2], [4]) == [3]  # a new request starts from the prior
