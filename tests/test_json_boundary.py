"""JSON Schema answers at the prompt boundary (issue 18, gap 1, the JSON row).

On the real embedded model: after a JSON few-shot prompt that ends in ":" or ": ", a
`gen(json_schema=...)` must return the value the unconstrained model writes for the same
prompt (greedy), the variable being the JSON text alone while the prompt keeps the space
the model chose. Jump-forward holds back a forced tail the model would extend (`"` of
`{"answer"`, spelled by the model as `":`), and what a user sees stays the decode of the
output ids. The whitespace setting (--constrained-json-whitespace-pattern,
--constrained-json-disable-any-whitespace) is checked on the grammars alone, and the
hold-back helpers on the vocabulary alone.
"""

from __future__ import annotations

import json
import re

import pytest

import sgl
from sgl.runtime.constrained import registry
from sgl.runtime.constrained.healing import grammar_extends, jump_forward_holdback
from tests.grammar_helpers import accepts_text

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
HEAD = ("Answer each question in JSON.\n\n"
        "Question: How many wheels does a car have?\nAnswer: {\"answer\": 4}\n\n"
        "Question: What is 3 plus 4?\nAnswer: {\"answer\": 7}\n\n")
QUESTIONS = ["How many days are in a week?", "How many months are in a year?",
             "How many sides does a triangle have?", "How many legs does a spider have?"]
ENDS = {"colon": ":", "colon_space": ": "}


@sgl.function
def free_answer(s, q, end):
    s += HEAD + "Question: " + q + "\nAnswer" + end
    s += sgl.gen("a", max_tokens=12, stop="}")


@sgl.function
def json_answer(s, q, end):
    s += HEAD + "Question: " + q + "\nAnswer" + end
    s += sgl.gen("a", max_tokens=16, json_schema=json.dumps(SCHEMA))


def first_int(text: str) -> int | None:
    m = re.search(r"-?\d+", text)
    return int(m.group(0)) if m else None


@pytest.mark.parametrize("shape", list(ENDS))
def test_json_gen_returns_the_free_models_value(engine, shape):
    end = ENDS[shape]
    for q in QUESTIONS:  # one at a time: a batch's numerics may move a near tie either way
        free = first_int(free_answer.run(q, end, backend=engine, temperature=0)["a"])
        assert free is not None
        st = json_answer.run(q, end, backend=engine, temperature=0)
        assert json.loads(st["a"]) == {"answer": free}
        assert st["a"].startswith("{")  # the variable is the JSON text alone
        assert st.text().endswith("Answer: " + st["a"])  # the prompt keeps the space the model wanted


def test_jump_forward_holds_back_what_the_model_extends(engine):
    tk = engine.tokenizer
    prompt = HEAD + "Question: How many days are in a week?\nAnswer:"
    params = {"temperature": 0.0, "max_new_tokens": 16, "json_schema": json.dumps(SCHEMA), "token_healing": True}
    res = engine.generate(prompt, params)
    meta = res["meta_info"]
    assert json.loads(res["text"]) == {"answer": 7}
    assert meta["jump_forward_tokens"] >= 1  # `answer` was forced ...
    quote_colon = tk.encode('":', add_special_tokens=False)
    assert len(quote_colon) == 1 and quote_colon[0] in res["output_ids"]  # ... and `":` sampled whole
    # What a user sees is the decode of what the model saw.
    kept = tk.encode(prompt)[: -meta["healed_tokens"]]
    assert meta["prompt_tokens"] == len(kept)
    full = tk.decode(kept + res["output_ids"], skip_special_tokens=True)
    assert full == tk.decode(kept) + meta["healed_prefix"] + res["text"] == prompt + res["text"]
    # Streaming and n > 1 give the same text.
    chunks = list(engine.generate(prompt, params, stream=True))
    assert chunks[-1]["text"] == res["text"] and chunks[-1]["output_ids"] == res["output_ids"]
    both = engine.generate([prompt, prompt], [params, params])
    assert [r["text"] for r in both] == [res["text"]] * 2
    forked = engine.generate(prompt, {**params, "n": 2})
    assert [r["text"] for r in forked] == [res["text"]] * 2


def test_streamed_json_gen_stores_the_json_alone(engine):
    st = json_answer.run("How many days are in a week?", ":", backend=engine, temperature=0, stream=True)
    list(st.text_iter())
    assert json.loads(st["a"]) == {"answer": 7} and st["a"].startswith("{")
    assert st.text().endswith("Answer: " + st["a"])


def test_holdback_on_the_vocabulary(tok):
    ids = [t for t in _encode(tok, '{"answer"')]
    cut, held = jump_forward_holdback(ids, 0, tok)
    assert held == b'"' and cut == len(ids) - 1
    assert jump_forward_holdback(ids, len(ids), tok) == (len(ids), b"")  # never into the sampled head
    # Some longer token starting with `"` is allowed after `{"answer` (`":`), unless the
    # grammar ends at the quote.
    for regex, extends in ((r'\{"answer"[ ]?:[ ]?[0-9]+\}', True), (r'\{"answer"', False)):
        g = registry.compile_grammar("regex", regex, tok)
        for t in ids[:cut]:
            g.accept_token(t)
        assert grammar_extends(g, held, tok) is extends


@pytest.mark.parametrize("env, ok, bad", [
    ({}, ['{"answer":7}', ' {"answer": 7}', '{ "answer" : 7 }'], ['  {"answer": 7}', '{"answer":  7}', '\n{"answer":7}']),
    ({"SGL_CONSTRAINED_JSON_DISABLE_ANY_WHITESPACE": "1"}, ['{"answer":7}'], [' {"answer":7}', '{"answer": 7}']),
    ({"SGL_CONSTRAINED_JSON_WHITESPACE_PATTERN": r"[ \n]*"}, ['\n{\n  "answer": 7\n}', '{"answer":7}'],
     ['\t{"answer":7}']),
])
def test_whitespace_setting(tok, monkeypatch, no_grammar_disk_cache, env, ok, bad):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    c = registry.compile_tables("json_schema", SCHEMA, tok, use_cache=False)
    assert all(accepts_text(c, t) for t in ok), ok
    assert not any(accepts_text(c, t) for t in bad), bad


def test_whitespace_setting_is_part_of_the_cache_key(tok, monkeypatch):
    spaced = registry.compile_tables("json_schema", SCHEMA, tok)
    monkeypatch.setenv("SGL_CONSTRAINED_JSON_DISABLE_ANY_WHITESPACE", "1")
    compact = registry.compile_tables("json_schema", SCHEMA, tok)
    assert compact is not spaced and not accepts_text(compact, ' {"answer": 7}')


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_compact_on_other_backends(tok, monkeypatch, backend):
    pytest.importorskip(backend)
    monkeypatch.setenv("SGL_GRAMMAR_BACKEND", backend)
    monkeypatch.setenv("SGL_CONSTRAINED_JSON_DISABLE_ANY_WHITESPACE", "1")
    g = registry.compile_tables("json_schema", SCHEMA, tok, use_cache=False).new_matcher()
    for t in _encode(tok, '{"answer":'):
        g.accept_token(t)
    space = _encode(tok, " ")
    assert len(space) == 1
    with pytest.raises(ValueError):
        g.accept_token(space[0])


def _encode(tok, text: str) -> list[int]:
    from transformers import AutoTokenizer

    from tests.grammar_helpers import GGUF, GGUF_DIR

    import os

    hf = tok.memo("test_hf_tokenizer", lambda: AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=os.path.basename(GGUF)))
    return hf.encode(text, add_special_tokens=False)
