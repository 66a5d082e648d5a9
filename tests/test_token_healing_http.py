"""Token healing over HTTP, on a server that speculates with n-grams.

`token_healing` is a sampling parameter of /generate and an extra field of the OpenAI
routes (off unless sent). One real server with `--speculative-algorithm ngram` answers a
prompt whose repetition makes the proposer draft right after the healed boundary; greedy
speculation is exact, so its output ids must equal the in-process engine's without
speculation. A bad value is a 400 naming the field.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server_proc import start_server

PROMPT = "one two three four. one two three four. one two three four. one two th"


@pytest.fixture(scope="module")
def srv():
    s = start_server("--max-total-tokens", "4096", "--speculative-algorithm", "ngram",
                     "--speculative-num-draft-tokens", "3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def test_generate_heals_and_speculates_exactly(http, engine):
    sp = {"temperature": 0, "max_new_tokens": 12, "token_healing": True}
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": sp})
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert meta["healed_prefix"] == " th" and meta["healed_tokens"] == 1
    assert body["text"].startswith("ree four.")  # " th" + "ree": the word the pattern continues
    assert meta.get("spec_verify_ct", 0) > 0  # drafts were verified
    local = engine.generate(PROMPT, sp)
    assert body["output_ids"] == local["output_ids"] and body["text"] == local["text"]
    # a stream of the same request ends with the same text, every chunk a prefix of it
    with http.stream("POST", "/generate", json={"text": PROMPT, "sampling_params": sp, "stream": True}) as s:
        texts = [line[6:] for line in s.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(t)["text"] for t in texts]
    assert chunks[-1] == body["text"] and all(body["text"].startswith(c) for c in chunks)


def test_off_by_default_and_openai_extra_field(http):
    plain = http.post("/generate", json={"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
    assert "healed_prefix" not in plain.json()["meta_info"]
    r = http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                           "token_healing": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("ree")
    assert http.get("/get_model_info").json()["token_healing"] is True


def test_bad_value_is_a_400_naming_the_field(http):
    r = http.post("/generate", json={"text": "hi", "sampling_params": {"token_healing": "yes"}})
    assert r.status_code == 400 and "token_healing" in r.text
    r = http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "token_healing": 3})
    assert r.status_code == 400 and "token_healing" in r.text


def test_runtime_endpoint_sends_it(srv):
    import sgl

    ep = sgl.RuntimeEndpoint(srv.url)
    assert ep.supports_token_healing

    @sgl.function
    def prog(s):
        s += PROMPT
        s += sgl.gen("w", max_tokens=3)

    st = prog.run(backend=ep, temperature=0)
    assert st["w"].startswith("ree") and st.text() == PROMPT + st["w"]
    assert st.get_meta_info("w")["healed_prefix"] == " th"
