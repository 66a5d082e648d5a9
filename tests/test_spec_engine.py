"""Speculative decoding end to end on the real embedded model: greedy outputs with the
n-gram proposer on are identical to plain decoding on 20 prompts (plain, JSON-schema and
regex constrained, stop strings, n>1), drafts are accepted where the output copies its
prompt, and meta_info / server info report it. Requests run two at a time so every decode
step (drafts included) stays on the C decode step, whose rows are summed the same way
whatever the batch: a request's logits then never depend on speculation."""

from __future__ import annotations

import json

import pytest

from sgl.runtime.engine import Engine

RECORD = {"name": "Ada Lovelace", "born": 1815, "city": "London", "field": "mathematics",
          "known_for": ["analytical engine notes", "first algorithm"]}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "born", "city"]}


def cases(eng: Engine) -> list[tuple[str, dict]]:
    def chat(text: str) -> str:
        return eng.apply_chat_template([{"role": "user", "content": text}])

    g = {"temperature": 0, "max_new_tokens": 40}
    plain = [
        chat("Copy this JSON object exactly, changing born to 1816:\n" + json.dumps(RECORD)),
        chat("Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the"),
        chat("Write a Python function that adds two numbers, then the same function with a docstring."),
        chat("List the days of the week, then list them again in reverse order."),
        chat("Tell me a short story about a robot."),
        chat("What is the capital of Italy?"),
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef fibonacci_memo(n, memo={}):\n",
        "One, two, three, four, five, six, seven, eight, nine, ten. One, two, three,",
    ]
    out = [(p, g) for p in plain]
    for who in ("Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie"):
        out.append((chat(f"Give {who}'s name, birth year and city as JSON."), {**g, "json_schema": json.dumps(SCHEMA)}))
    out.append((chat("Give a US phone number."), {**g, "regex": r"\(\d{3}\) \d{3}-\d{4}"}))
    out.append((chat("Say yes or no: is the sky blue?"), {**g, "regex": "(yes|no)[.!]"}))
    for p, stop in ((chat("Count from one to twenty in words, separated by commas."), [", seven"]),
                    (chat("Name three fruits, one per line."), ["\n"]),
                    (plain[0], ["1816"]),
                    (chat("Spell the word banana letter by letter with dashes."), ["n-a-n"])):
        out.append((p, {**g, "stop": stop}))
    out.append((plain[1], {**g, "n": 2, "max_new_tokens": 24}))
    out.append((chat("Describe the ocean in one sentence."), {**g, "n": 2, "max_new_tokens": 24}))
    return out


@pytest.fixture(scope="module")
def spec_engine():
    eng = Engine(max_total_tokens=8192, speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                 speculative_draft_policy="always")
    yield eng
    eng.shutdown()


def run_pairs(eng: Engine, cs: list[tuple[str, dict]]) -> list[dict]:
    # Both engines start from an empty radix tree: a prefix's KV computed inside another
    # test's longer prompt may differ in the last bits (README, Known limits), which is
    # not what this compares.
    eng.flush_cache()
    out: list[dict] = []
    for i in range(0, len(cs), 2):
        chunk = cs[i : i + 2]
        res = eng.generate([p for p, _ in chunk], [sp for _, sp in chunk])
        out.extend(res)
    return out


def test_greedy_outputs_identical_with_and_without_speculation(engine: Engine, spec_engine: Engine) -> None:
    cs = cases(engine)
    assert len(cs) == 20
    plain, spec = run_pairs(engine, cs), run_pairs(spec_engine, cs)
    assert len(plain) == len(spec) == 22  # two cases ask for n=2
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert b["output_ids"] == a["output_ids"], f"case {i}: {a['text']!r} vs {b['text']!r}"
        assert b["text"] == a["text"]
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
    copied = spec[0]["meta_info"]  # the JSON rewrite copies its prompt: drafts pay
    assert copied["spec_accepted_tokens"] >= 10
    assert copied["spec_verify_ct"] < copied["completion_tokens"] - 5
    assert copied["spec_accept_length"] > 1.3
    info = spec_engine.get_server_info()
    assert info["spec_algorithm"] == "ngram" and info["spec_accepted_tokens_total"] > 0
    assert 0 < info["spec_accept_rate"] <= 1 and info["spec_accept_length"] > 1


def test_tiny_random_draft_model_is_verified_and_outputs_unchanged(engine: Engine, tmp_path) -> None:
    """A random-weight draft (the target's vocabulary) is mostly wrong: its drafts go
    through verification and rejection, and the output is the target's own."""
    from tests.test_spec_draft_model import write_tiny_draft

    draft = write_tiny_draft(tmp_path / "tiny")
    cs = cases(engine)[:4]
    plain = run_pairs(engine, cs)
    with Engine(max_total_tokens=4096, speculative_algorithm="draft", speculative_draft_model_path=str(draft),
                speculative_num_draft_tokens=3, speculative_draft_policy="always") as eng:
        spec = run_pairs(eng, cs)
        info = eng.get_server_info()
    for a, b in zip(plain, spec):
        assert b["output_ids"] == a["output_ids"]
    drafted = sum(o["meta_info"]["spec_draft_tokens"] for o in spec)
    accepted = sum(o["meta_info"]["spec_accepted_tokens"] for o in spec)
    assert drafted > 50 and accepted < drafted
    assert info["spec_algorithm"] == "draft"


@pytest.mark.slow
def test_ngram_under_tensor_parallelism_keeps_greedy_output() -> None:
    """Drafts are extra tokens of the broadcast step: the other rank runs them too."""
    p = "Copy exactly: red, green, blue, red, green, blue, red, green,"
    outs = {}
    for name, kw in (("off", {}), ("ngram", {"speculative_algorithm": "ngram", "speculative_draft_policy": "always"})):
        with Engine(tp_size=2, dtype="float32", max_total_tokens=2048, **kw) as e:
            outs[name] = e.generate(p, {"max_new_tokens": 24, "temperature": 0})
    assert outs["ngram"]["output_ids"] == outs["off"]["output_ids"]
    assert outs["ngram"]["meta_info"]["spec_accepted_tokens"] > 0
