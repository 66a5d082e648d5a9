"""One sampling schema: every `SamplingParams` field is accepted, under its own name (or
its one documented rename), by `sgl.gen` / `run`, by `/generate`'s `sampling_params` and by
`/v1/chat/completions`; seeded, penalized gens work on the engine and over HTTP.

`GOOD` and `BAD` hold a valid and an invalid value for every field, and the first test
fails when a field is added without them, so a new parameter cannot skip these checks.
A bad value must come back as a 400 naming the field: that proves the server reads it
rather than silently dropping it.
"""

from __future__ import annotations

import re

import httpx
import pytest

import sgl
from sgl.lang.backends.fake import FakeBackend
from sgl.lang.ir import DSL_RENAMES, TOLERANT_REGEX
from sgl.runtime.constrained.kinds import CONSTRAINT_KINDS
from sgl.runtime.constrained.registry import KINDS
from sgl.runtime.sampling_params import FIELD_NAMES, SamplingParams
from sgl.server.openai_protocol import OPENAI_NAMES
from tests.server_proc import start_server

GOOD = {
    "max_new_tokens": 3, "min_new_tokens": 1, "stop": ["\n\n"], "stop_token_ids": [0], "stop_regex": ["zz+"],
    "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "frequency_penalty": 0.1,
    "presence_penalty": 0.1, "repetition_penalty": 1.1, "ignore_eos": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "no_stop_trim": True, "n": 2, "seed": 3, "token_healing": True, "regex": "(yes|no)",
    "json_schema": '{"type": "integer"}', "ebnf": 'root ::= "yes" | "no"', "lark": 'start: "yes" | "no"',
    "choices": ["yes", "no"],
}
BAD = {
    "max_new_tokens": -1, "min_new_tokens": -1, "stop": 5, "stop_token_ids": [-1], "stop_regex": ["("],
    "temperature": -1, "top_p": 0, "top_k": 0, "min_p": 2, "frequency_penalty": 3, "presence_penalty": 3,
    "repetition_penalty": 0, "ignore_eos": "yes", "skip_special_tokens": "yes",
    "spaces_between_special_tokens": "yes", "no_stop_trim": "yes", "n": 0, "seed": "x", "token_healing": "yes", "regex": 5,
    "json_schema": 5, "ebnf": 5, "lark": 5, "choices": [],
}


def test_tables_cover_every_field_and_constraint_kinds_are_fields():
    assert set(GOOD) == set(BAD) == set(FIELD_NAMES)
    assert set(KINDS) == set(CONSTRAINT_KINDS) and set(CONSTRAINT_KINDS) <= set(FIELD_NAMES)
    for name in FIELD_NAMES:
        assert SamplingParams.from_dict({"max_new_tokens": 3, name: GOOD[name]}) is not None
        with pytest.raises(ValueError, match=name):
            SamplingParams.from_dict({name: BAD[name]})


# ---- the DSL ------------------------------------------------------------------------------

def _sent(be: FakeBackend) -> dict:
    gens = [c for c in be.calls if c["sampling_params"].get("max_new_tokens") != 0]
    return gens[-1]["sampling_params"]


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_every_field_is_accepted_by_gen_and_run(name):
    be = FakeBackend(lambda prompt, sp: "yes")

    @sgl.function
    def by_gen(s):
        s += "Q:" + sgl.gen("a", **{name: GOOD[name]})

    @sgl.function
    def by_run(s):
        s += "Q:" + sgl.gen("a")

    # A regex gen is sent with the whitespace the model may want around its match (ir.py).
    sent = TOLERANT_REGEX.format(GOOD[name]) if name == "regex" else GOOD[name]
    if name == "choices":  # gen(choices=...) is a select, as in SGLang
        assert by_gen.run(backend=be)["a"] in GOOD["choices"]
    else:
        by_gen.run(backend=be)
        assert _sent(be)[name] == sent
    by_run.run(backend=be, **{name: GOOD[name]})
    assert _sent(be)[name] == sent


def test_dsl_renames_and_unknown_options():
    be = FakeBackend()

    @sgl.function
    def prog(s):
        s += sgl.gen("a", max_tokens=4, min_tokens=1, grammar='start: "ok"', sampling_seed=9)

    prog.run(backend=be)
    assert {k: _sent(be)[k] for k in ("max_new_tokens", "min_new_tokens", "lark", "seed")} == \
        {"max_new_tokens": 4, "min_new_tokens": 1, "lark": 'start: "ok"', "seed": 9}
    assert all(DSL_RENAMES[k] in FIELD_NAMES for k in DSL_RENAMES)
    with pytest.raises(TypeError, match="top_q"):
        sgl.gen("a", top_q=0.5)
    with pytest.raises(TypeError, match="twice"):
        sgl.gen("a", max_tokens=4, max_new_tokens=5)
    with pytest.raises(TypeError, match="top_q"):
        prog.run_batch([{}], backend=be, top_q=0.5)
    with pytest.raises(ValueError, match="at most one constraint"):
        sgl.gen("a", regex="a", lark='start: "a"')


def test_program_parameter_wins_over_an_option_of_the_same_name():
    be = FakeBackend()

    @sgl.function
    def prog(s, seed):
        s += f"seed {seed}:" + sgl.gen("a")

    st = prog.run(seed=5, temperature=0.25, backend=be)
    assert st.text().startswith("seed 5:")
    assert "seed" not in _sent(be) and _sent(be)["temperature"] == 0.25


def test_a_gen_constraint_replaces_the_run_constraint():
    be = FakeBackend()

    @sgl.function
    def prog(s):
        s += sgl.gen("a") + sgl.gen("b", regex="[0-9]+") + sgl.gen_int("c")

    prog.run(backend=be, json_schema='{"type": "string"}')
    a, b, c = (call["sampling_params"] for call in be.calls)
    assert a["json_schema"] == '{"type": "string"}'
    assert b["regex"] == TOLERANT_REGEX.format("[0-9]+") and "json_schema" not in b
    assert "[-+]?[0-9]" in c["regex"] and "json_schema" not in c


# ---- the engine and the server ----------------------------------------------------------------

@sgl.function
def seeded(s, seed):
    s += "Write one surprising word:" + sgl.gen("w", max_tokens=8, temperature=1.0, seed=seed,
                                                 repetition_penalty=1.1)


@sgl.function
def penalized(s, penalty):
    s += "a b a b a b a b a b a b" + sgl.gen("w", max_tokens=8, temperature=0, repetition_penalty=penalty)


def _check_seed_and_penalty(backend, generate):
    """`generate(prompt, sampling_params) -> text` is the backend's own API, for reference;
    it is sent `token_healing` as the DSL sends it on an sgl backend."""
    first = [seeded.run(seed=k, backend=backend)["w"] for k in (3, 4, 5, 6)]
    again = [seeded.run(seed=k, backend=backend)["w"] for k in (3, 4, 5, 6)]
    assert first == again  # a seeded gen is reproducible...
    assert len(set(first)) > 1  # ...and the seed is really used
    assert first[0] == generate("Write one surprising word:", {"max_new_tokens": 8, "temperature": 1.0, "seed": 3,
                                                               "repetition_penalty": 1.1, "token_healing": True})
    plain, strong = (penalized.run(penalty=p, backend=backend)["w"] for p in (1.0, 2.0))
    assert plain != strong  # the penalty reaches the sampler
    assert strong == generate("a b a b a b a b a b a b", {"max_new_tokens": 8, "temperature": 0,
                                                          "repetition_penalty": 2.0, "token_healing": True})


@pytest.mark.model
@pytest.mark.timeout(900)
def test_seed_and_repetition_penalty_on_the_engine(engine):
    _check_seed_and_penalty(engine, lambda p, sp: engine.generate(prompt=p, sampling_params=sp)["text"])


@pytest.fixture(scope="module")
def srv():
    s = start_server("--max-total-tokens", "16384", "--context-length", "2048")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=300) as c:
        yield c


def _names(name: str, body: dict) -> bool:
    err = body["error"]
    return re.search(rf"\b{name}\b", f"{err['message']} {err.get('param')}") is not None


@pytest.mark.model
@pytest.mark.server
@pytest.mark.timeout(1200)
def test_seed_and_repetition_penalty_over_http(srv, http):
    def generate(prompt, sp):
        r = http.post("/generate", json={"text": prompt, "sampling_params": sp})
        assert r.status_code == 200, r.text
        return r.json()["text"]

    _check_seed_and_penalty(sgl.RuntimeEndpoint(srv.url), generate)


@pytest.mark.model
@pytest.mark.server
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", FIELD_NAMES)
def test_every_field_is_accepted_by_generate_and_chat(http, name):
    r = http.post("/generate", json={"text": "Yes or no?", "sampling_params": {"max_new_tokens": 2,
                                                                                name: GOOD[name]}})
    assert r.status_code == 200, r.text
    r = http.post("/generate", json={"text": "Yes or no?", "sampling_params": {name: BAD[name]}})
    assert r.status_code == 400 and _names(name, r.json()), r.text

    theirs = OPENAI_NAMES.get(name, name)
    chat = {"model": "default", "messages": [{"role": "user", "content": "Yes or no?"}], "max_tokens": 2}
    models = http.get("/v1/models").json()["data"]
    chat["model"] = models[0]["id"]
    r = http.post("/v1/chat/completions", json={**chat, theirs: GOOD[name]})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={**chat, theirs: BAD[name]})
    assert r.status_code == 400 and _names(theirs, r.json()), r.text


def test_a_temperature_or_penalty_that_overflows_takes_the_argmax_not_the_batch_down():
    import torch

    from sgl.runtime.executor.plan import SampleSpec
    from sgl.runtime.executor.sampler import sample
    from sgl.runtime.sampling_params import SamplingParams

    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0]] * 3)
    rows = [SampleSpec(SamplingParams.from_dict({"temperature": 1e-39})),  # logits / t overflows
            SampleSpec(SamplingParams.from_dict({"temperature": 1.0, "repetition_penalty": 1e-300}),
                       penalty_prompt_ids=[0, 1, 2, 3], penalty_output_ids=[]),
            SampleSpec(SamplingParams.from_dict({"temperature": 0.7}))]  # a healthy row beside them
    gens = [torch.Generator().manual_seed(k) for k in range(3)]
    got = sample(logits.clone(), rows, gens)
    assert got[0].token_id == 1 and got[1].token_id in range(4) and got[2].token_id in range(4)


def test_seeded_samples_of_one_prompt_get_seed_plus_k():
    from sgl.runtime.engine_io import normalize

    class Tok:
        def encode(self, text, **_):
            return [ord(c) for c in text]

    specs, _ = normalize(Tok(), "hello", None, {"n": 3, "seed": 5, "temperature": 1.0, "max_new_tokens": 4},
                         False, None, None, False, "r", 1000, 100)
    assert [s.params.seed for s in specs] == [5, 6, 7] and [s.rid for s in specs] == ["r-0", "r-1", "r-2"]
    one, _ = normalize(Tok(), "hello", None, {"seed": 5, "max_new_tokens": 4}, False, None, None, False, "r", 1000,
                       100)
    assert one[0].params.seed == 5
