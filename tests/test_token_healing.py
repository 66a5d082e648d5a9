"""Token healing (sgl/runtime/constrained/healing.py) on the real embedded model.

The prompt is backed up over its last token(s) and the output must start by spelling
them: checked where the prompt ends mid-word, in a space, and in (or just after) a
multi-byte UTF-8 character. Every case checks what a user sees: the backed-up prompt plus
the healed prefix plus the returned text is the decode of all the tokens, and the first
token is the one the unconstrained model ranks highest among those that spell the prefix.
Composition with a regex, stop strings, streaming, n > 1, logprobs and the radix cache
are checked on the same engine; the grammar-level cases (masks, rollback, draft
clipping) run on the vocabulary alone.
"""

from __future__ import annotations

import re

import pytest

from sgl.runtime.constrained.healing import HealingGrammar, plan_healing, strip_healed
from sgl.runtime.speculative.proposer import clip_to_grammar

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "token_healing": True}


def healed(engine, prompt=None, input_ids=None, **params):
    return engine.generate(prompt=prompt, input_ids=input_ids, sampling_params={**GREEDY, **params})


def check_visible(engine, ids: list[int], res: dict) -> None:
    """decode(kept + output) == decode(kept) + healed prefix + text, and the first output
    token is the unconstrained model's best among the tokens that spell the prefix."""
    tk = engine.tokenizer
    meta = res["meta_info"]
    k = meta["healed_tokens"]
    kept = ids[:-k]
    assert meta["prompt_tokens"] == len(kept)
    full = tk.decode(kept + res["output_ids"], skip_special_tokens=True)
    assert full == tk.decode(kept) + meta["healed_prefix"] + res["text"]
    tok = engine_tok(engine)
    prefix = b"".join(tok.token_bytes[t] for t in ids[-k:])
    probe = engine.generate(input_ids=kept, sampling_params={"temperature": 0.0, "max_new_tokens": 1},
                            return_logprob=True, top_logprobs_num=100)
    ranked = [t for _, t, _ in probe["meta_info"]["output_top_logprobs"][0]]
    spelling = [t for t in ranked if tok.token_bytes[t] and (prefix.startswith(tok.token_bytes[t])
                                                             or tok.token_bytes[t].startswith(prefix))]
    assert spelling, "no token among the model's top 100 spells the prefix"
    assert res["output_ids"][0] == spelling[0]


_TOK: dict[int, object] = {}


def engine_tok(engine):
    from sgl.runtime.constrained.vocab import TokenizerInfo

    if id(engine) not in _TOK:
        _TOK[id(engine)] = TokenizerInfo.from_hf_tokenizer(engine.tokenizer, eos_token_ids=engine.eos_token_ids)
    return _TOK[id(engine)]


# -- the three boundaries ---------------------------------------------------------------
def test_prompt_ends_mid_word(engine):
    prompt = "The capital of France is Par"
    res = healed(engine, prompt)
    assert res["meta_info"]["healed_prefix"] == " Par"
    check_visible(engine, engine.tokenizer.encode(prompt), res)
    assert (" Par" + res["text"]).startswith(" Paris")  # the word the model knows


def test_prompt_ends_in_a_space(engine):
    prompt = "Question: What is 6 times 4?\nAnswer: "
    res = healed(engine, prompt)
    assert res["meta_info"]["healed_prefix"] == " "
    check_visible(engine, engine.tokenizer.encode(prompt), res)


def test_prompt_ends_in_a_partial_utf8_character(engine):
    tok = engine_tok(engine)
    head = tok.token_bytes.index(b"\xe2\x80")  # the first two bytes of ’ — … (a byte-level token)
    ids = engine.tokenizer.encode("He stopped and said") + [head]  # ends inside a character
    assert engine.tokenizer.decode(ids).endswith("\ufffd")
    res = healed(engine, input_ids=ids)
    meta = res["meta_info"]
    assert meta["healed_tokens"] == 1 and meta["healed_prefix"] == ""  # no whole character was cut
    first = tok.token_bytes[res["output_ids"][0]]
    assert first.startswith(b"\xe2\x80") and len(first) >= 3  # the character is completed, not replaced
    kept = ids[:-1]
    full = engine.tokenizer.decode(kept + res["output_ids"], skip_special_tokens=True)
    # What the user sees: their prompt without its cut-off character, then the text.
    assert full == engine.tokenizer.decode(ids).rstrip("\ufffd") + res["text"]
    assert res["text"][0] in "\u2018\u2019\u201c\u201d\u2013\u2014\u2026\u2022" or ord(res["text"][0]) >= 0x2000
    check_visible(engine, ids, res)


def test_plan_never_splits_a_character(engine):
    tok = engine_tok(engine)
    for text in ["Tokyo is 東京", "Smile 😀", "The price is 5€", "naïve", "Temperature: 25°"]:
        ids = engine.tokenizer.encode(text)
        plan = plan_healing(ids, tok)
        if plan is None:
            continue
        assert b"".join(tok.token_bytes[t] for t in plan.kept) + plan.prefix == text.encode()
        assert plan.prefix.decode("utf-8") == plan.text


def test_off_by_default_and_no_meta(engine):
    res = engine.generate("The capital of France is Par", {"temperature": 0.0, "max_new_tokens": 2})
    assert "healed_prefix" not in res["meta_info"]


# -- composition --------------------------------------------------------------------------
def test_with_a_regex(engine):
    prompt = "Question: What is 6 times 4?\nAnswer: "
    res = healed(engine, prompt, regex=r"[0-9]+\n")
    assert res["meta_info"]["healed_prefix"] == " "
    assert re.fullmatch(r" ?[0-9]+\n", res["text"]), res["text"]  # the grammar follows the healed space


def test_stop_string_never_matches_the_healed_prefix(engine):
    prompt = "Question: What is 6 times 4?\nAnswer:\n"
    res = healed(engine, prompt, stop=["\n"], max_new_tokens=8)
    assert res["meta_info"]["healed_prefix"] == "\n"
    assert res["text"] and "\n" not in res["text"]
    assert res["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_streaming_matches_the_final_text(engine):
    prompt = "The capital of France is Par"
    final = healed(engine, prompt, max_new_tokens=8)
    chunks = [c["text"] for c in engine.generate(prompt, {**GREEDY, "max_new_tokens": 8}, stream=True)]
    assert chunks[-1] == final["text"]
    assert all(final["text"].startswith(c) for c in chunks)


def test_n_logprobs_and_cache(engine):
    prompt = "My favourite colour is bl"
    out = engine.generate(prompt, {"temperature": 1.0, "max_new_tokens": 4, "token_healing": True, "n": 2,
                                   "seed": 3}, return_logprob=True)
    ids = engine.tokenizer.encode(prompt)
    for res in out:
        meta = res["meta_info"]
        assert meta["healed_prefix"] == " bl"
        assert len(meta["output_token_logprobs"]) == len(res["output_ids"])
        kept = ids[: -meta["healed_tokens"]]
        assert (engine.tokenizer.decode(kept + res["output_ids"], skip_special_tokens=True)
                == engine.tokenizer.decode(kept) + " bl" + res["text"])
    again = healed(engine, prompt)
    assert again["meta_info"]["cached_tokens"] >= again["meta_info"]["prompt_tokens"] - 1  # the backed-up prompt


# -- the grammar on its own -----------------------------------------------------------------
def test_grammar_masks_rollback_and_draft_clipping(tok):
    from sgl.runtime.constrained.registry import compile_grammar

    g = HealingGrammar(b" Par", compile_grammar("regex", r"(is|k)[.]", tok), tok)
    allowed = {tok.token_bytes[t] for t in g.allowed_token_ids()}
    # Part of the prefix, all of it, or all of it running on into the regex: nothing else.
    assert {b" ", b" Par", b" Paris", b" Park"} <= allowed
    assert b" Party" not in allowed
    assert all(b" Par".startswith(b) or re.fullmatch(rb" Par(i|is|k|is\.|k\.)", b) for b in allowed), allowed
    ids = {b: i for i, b in enumerate(tok.token_bytes) if b}
    sp, par, paris, dot = ids[b" "], ids[b"Par"], ids[b" Paris"], ids[b"."]
    assert not g.can_end()
    # Drafts are cut where the composed language refuses them; the state is unchanged after.
    assert clip_to_grammar(g, [sp, par, ids[b"is"], dot, dot]) == [sp, par, ids[b"is"], dot]
    assert clip_to_grammar(g, [paris, ids[b"x"]]) == [paris]
    g.accept_token(sp)
    g.accept_token(par)
    assert g.healed and not g.can_end()
    g.accept_token(ids[b"k"])
    g.rollback(2)
    assert not g.healed and g.pos == 1
    with pytest.raises(ValueError):
        g.accept_token(paris)  # " Paris" does not spell the rest of the prefix ("Par")
    g.accept_token(ids[b"Paris"])
    g.accept_token(dot)
    assert g.is_terminated()
    plain = HealingGrammar(b" Par", None, tok)
    assert b" Party" in {tok.token_bytes[t] for t in plain.allowed_token_ids()}  # any continuation


def test_strip_healed():
    assert strip_healed(" Paris.", " Par") == "is."
    assert strip_healed(" P", " Par") == ""  # the prefix is not spelled out yet
    assert strip_healed("x", "") == "x"
