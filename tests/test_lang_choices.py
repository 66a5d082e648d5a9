"""The three select() choice methods on fixed logprob data (SGLang semantics)."""

from __future__ import annotations

import math

import pytest

import sgl


def entries(*lps):
    return [(lp, i, None) for i, lp in enumerate(lps)]


def norm(rows):
    return [sum(e[0] for e in r) / len(r) for r in rows]


def test_token_length_normalized_picks_highest_mean():
    rows = [entries(-1.0, -1.0), entries(-0.5, -2.0, -0.1), entries(-0.9)]
    d = sgl.token_length_normalized(choices=["a", "b", "c"], normalized_prompt_logprobs=norm(rows),
                                    input_token_logprobs=rows, output_token_logprobs=[[], [], []])
    # means: -1.0, -0.8667, -0.9
    assert d.decision == "b"
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-1.0, -2.6 / 3, -0.9])


def test_token_length_normalized_ties_go_to_first():
    rows = [entries(-1.0), entries(-1.0)]
    d = sgl.token_length_normalized(choices=["x", "y"], normalized_prompt_logprobs=norm(rows),
                                    input_token_logprobs=rows, output_token_logprobs=[[], []])
    assert d.decision == "x"


def test_greedy_token_selection_compares_position_by_position():
    # First tokens tie at -0.5; second token decides although "a" has the better mean.
    rows = [entries(-0.5, -3.0, -0.0), entries(-0.5, -1.0, -5.0)]
    d = sgl.greedy_token_selection(choices=["a", "b"], normalized_prompt_logprobs=norm(rows),
                                   input_token_logprobs=rows, output_token_logprobs=[[], []])
    assert d.decision == "b"
    assert norm(rows)[0] > norm(rows)[1]  # token_length_normalized would pick "a"


def test_greedy_pads_short_choice_with_its_mean():
    # "ab" is [-1, -3] (mean -2); "abc" continues with -2.5 at position 2 -> the padded -2 wins.
    rows = [entries(-1.0, -3.0), entries(-1.0, -3.0, -2.5)]
    d = sgl.greedy_token_selection(choices=["ab", "abc"], normalized_prompt_logprobs=norm(rows),
                                   input_token_logprobs=rows, output_token_logprobs=[[], []])
    assert d.decision == "ab"
    assert d.meta_info["greedy_logprob_matrix"][0] == [-1.0, -3.0, -2.0]


def test_unconditional_likelihood_normalized_discounts_generic_choices():
    cond = [entries(-1.0, -1.0), entries(-2.0, -2.0)]
    # The first choice is just as likely without the prompt; the second becomes much likelier with it.
    uncond = [entries(None, -1.0), entries(None, -6.0)]
    d = sgl.unconditional_likelihood_normalized(
        choices=["generic", "specific"], normalized_prompt_logprobs=norm(cond),
        input_token_logprobs=cond, output_token_logprobs=[[], []], unconditional_token_logprobs=uncond)
    # scores: mean(-1-0, -1+1) = -0.5 ; mean(-2-0, -2+6) = 1.0
    assert d.decision == "specific"
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.5, 1.0])
    assert sgl.unconditional_likelihood_normalized.requires_unconditional_logprobs
    assert not sgl.token_length_normalized.requires_unconditional_logprobs


def test_unconditional_requires_data_and_equal_lengths():
    cond = [entries(-1.0, -1.0)]
    with pytest.raises(ValueError):
        sgl.unconditional_likelihood_normalized(choices=["a"], normalized_prompt_logprobs=[-1.0],
                                                input_token_logprobs=cond, output_token_logprobs=[[]])
    with pytest.raises(ValueError):
        sgl.unconditional_likelihood_normalized(choices=["a"], normalized_prompt_logprobs=[-1.0],
                                                input_token_logprobs=cond, output_token_logprobs=[[]],
                                                unconditional_token_logprobs=[entries(None)])


def test_select_through_backend_uses_one_batched_call_and_boundary_tokens():
    from sgl.lang.backends.fake import FakeBackend

    # Each char scores by whether it belongs to "yes": the best choice is "yes".
    be = FakeBackend(scorer=lambda before, ch: -0.1 if ch in "yes" else -2.0)

    @sgl.function
    def prog(s):
        s += "Answer: "
        s += sgl.select("ans", ["no", "yes", "nope"])

    st = prog.run(backend=be)
    assert st["ans"] == "yes"
    assert st.text() == "Answer: yes"
    scoring = [c for c in be.calls if c["return_logprob"]]
    assert len(scoring) == 3 and {c["logprob_start_len"] for c in scoring} == {len("Answer: ") - 1}
    meta = st.get_meta_info("ans")
    # The overlap entry (the prefix's own last char) is dropped: one entry per choice char.
    assert [len(x) for x in meta["input_token_logprobs"]] == [2, 3, 4]
    assert not math.isnan(meta["normalized_prompt_logprobs"][0])
