"""The OpenAI handlers in-process against a fake engine (no model): routes come only from
`create_app`, and streamed deltas add up to the non-streamed answer.

The fake's output is a pure function of the prompt (the prompt reversed, repeated to
max_tokens characters; one character per token), so every shape can be checked exactly.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import APIRouter
from fastapi.testclient import TestClient

from sgl.server import app as app_module
from sgl.server import native_api, openai_api, openai_chat, openai_completions, router_api
from sgl.server.app import create_app


class CharTokenizer:
    """One printable ASCII character per token."""

    eos_token = None

    def get_vocab(self) -> dict[str, int]:
        return {chr(32 + i): i for i in range(95)}

    def __len__(self) -> int:
        return 95

    def encode(self, text: str, **_: Any) -> list[int]:
        return [ord(c) - 32 for c in text]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(32 + i) for i in ids)


def reply(prompt: str, n: int) -> str:
    return (prompt[::-1] * n)[:n]


class FakeEngine:
    model_path = "fake-model"
    context_length = 512
    chat_template = None

    def __init__(self) -> None:
        self.tokenizer = CharTokenizer()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<a>" if add_generation_prompt else "")

    async def async_generate(self, prompt: str | None = None, sampling_params: dict | None = None,
                             input_ids: list[int] | None = None, stream: bool = False, **_: Any) -> Any:
        text = prompt if prompt is not None else self.tokenizer.decode(input_ids or [])
        sp = sampling_params or {}
        out = reply(text, sp["max_new_tokens"])

        def result(t: str, done: bool) -> dict[str, Any]:
            return {"text": t, "meta_info": {"prompt_tokens": len(text), "completion_tokens": len(t),
                                             "cached_tokens": 0, "finish_reason": {"type": "length"} if done else None}}

        if not stream:
            n = sp.get("n", 1)
            return result(out, True) if n == 1 else [result(out, True) for _ in range(n)]

        async def chunks() -> Any:
            for k in range(1, len(out) + 1):
                yield result(out[:k], k == len(out))

        return chunks()

    def abort(self, rid: str) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def get_server_info(self) -> dict[str, Any]:
        return {}


@pytest.fixture(scope="module")
def http():
    with TestClient(create_app(FakeEngine(), served_model_name="m")) as c:
        yield c


def frames(body: str) -> list[Any]:
    out = []
    for line in body.splitlines():
        if line.startswith("data: "):
            out.append(None if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def test_routes_come_from_create_app_only():
    for module in (native_api, router_api, openai_api, openai_completions, openai_chat, app_module):
        assert not [v for v in vars(module).values() if isinstance(v, APIRouter)], module.__name__
    paths = {r.path for r in create_app(FakeEngine()).routes}
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/generate", "/health", "/get_load",
            "/get_tokenizer"} <= paths


def test_router_endpoints_on_a_bare_engine(http):
    # an engine that reports nothing has no load; a tokenizer that is not a fast one cannot be exported
    assert http.get("/get_load").json() == [{
        "dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0, "num_running_reqs": 0,
        "num_running_tokens": 0, "num_waiting_tokens": 0, "num_pending_prefill_tokens": 0, "kv_total_tokens": 0,
        "kv_used_tokens": 0, "kv_evictable_tokens": 0}]
    r = http.get("/get_tokenizer")
    assert r.status_code == 501 and "fast tokenizer" in r.json()["error"]["message"]


def test_completions_two_prompts_with_echo(http):
    r = http.post("/v1/completions", json={"model": "m", "prompt": ["abc", "xy"], "max_tokens": 4, "echo": True})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and body["model"] == "m"
    assert [c["text"] for c in body["choices"]] == ["abc" + reply("abc", 4), "xy" + reply("xy", 4)]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completions_stream_adds_up(http):
    req = {"model": "m", "prompt": [[65, 66, 67]], "max_tokens": 5, "n": 2, "stream": True,
           "stream_options": {"include_usage": True}}
    fs = frames(http.post("/v1/completions", json=req).text)
    assert fs[-1] is None
    texts = {0: "", 1: ""}
    for f in fs[:-2]:
        (c,) = f["choices"]
        texts[c["index"]] += c["text"]
        assert f["usage"] is None and f["object"] == "text_completion"
    assert texts == {0: reply("abc", 5), 1: reply("abc", 5)}  # ids 65.. are "a"..: chr(32 + id)
    assert fs[-2]["choices"] == [] and fs[-2]["usage"]["completion_tokens"] == 10
    assert fs[-2]["usage"]["prompt_tokens"] == 3  # once per prompt, not per choice


def test_chat_plain_and_streamed(http):
    msgs = [{"role": "user", "content": "hello"}]
    prompt = "<user>hello<a>"
    body = http.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 6}).json()
    assert body["object"] == "chat.completion" and body["system_fingerprint"] is None
    (c,) = body["choices"]
    assert c["message"] == {"role": "assistant", "content": reply(prompt, 6)} and c["finish_reason"] == "length"
    fs = frames(http.post("/v1/chat/completions",
                          json={"model": "m", "messages": msgs, "max_tokens": 6, "stream": True}).text)
    assert fs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(f["object"] == "chat.completion.chunk" for f in fs[:-1])
    assert "".join(f["choices"][0]["delta"].get("content", "") for f in fs[1:-1]) == reply(prompt, 6)
    assert fs[-2]["choices"][0]["finish_reason"] == "length" and fs[-1] is None


def test_chat_without_max_tokens_fills_the_context(http):
    prompt = "<user>hi<a>"
    body = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert body.json()["usage"]["completion_tokens"] == FakeEngine.context_length - len(prompt)


def test_chat_without_max_tokens_fills_what_the_kv_pool_holds_when_it_is_smaller():
    class SmallPool(FakeEngine):
        max_total_tokens = 100  # less than the context window of 512

    with TestClient(create_app(SmallPool(), served_model_name="m")) as c:
        body = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert body.status_code == 200, body.text
    assert body.json()["usage"]["completion_tokens"] == 100 - len("<user>hi<a>")


def test_regexes_and_schemas_that_break_the_parser_are_400s(http):
    for rf in ({"type": "regex", "regex": "a{4294967295}"}, {"type": "regex", "regex": "(" * 600 + ")" * 600}):
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                    "max_tokens": 2, "response_format": rf})
        assert r.status_code == 400, (rf["regex"][:20], r.status_code, r.text[:200])
    r = http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2, "json_schema": "[" * 5000}})
    assert r.status_code == 400, r.text[:200]
    r = http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2,
                                                                     "stop_regex": "(" * 600 + ")" * 600}})
    assert r.status_code == 400, r.text[:200]


def test_a_stream_that_breaks_mid_way_ends_with_an_error_event_and_done():
    class Breaks(FakeEngine):
        async def async_generate(self, *args: Any, stream: bool = False, **kwargs: Any) -> Any:
            inner = await super().async_generate(*args, stream=stream, **kwargs)

            async def chunks() -> Any:
                async for k, c in _enumerate(inner):
                    if k == 2:
                        raise RuntimeError("a renderer bug")
                    yield c

            return chunks() if stream else inner

    async def _enumerate(it: Any) -> Any:
        k = 0
        async for x in it:
            yield k, x
            k += 1

    with TestClient(create_app(Breaks(), served_model_name="m"), raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 8, "stream": True})
    got = frames(r.text)
    assert got[-1] is None and got[-2]["error"]["type"] == "server_error", r.text[-300:]
    assert "RuntimeError" in got[-2]["error"]["message"]


def test_a_chunked_body_past_the_limit_is_a_413(http, monkeypatch):
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 1000)

    def chunks() -> Any:  # no Content-Length: the limit must hold while reading
        yield b'{"model": "m", "prompt": "'
        for _ in range(100):
            yield b"a" * 100
        yield b'", "max_tokens": 2}'

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit" in r.text, (r.status_code, r.text[:200])
    small = http.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2})
    assert small.status_code == 200


def test_a_client_that_left_is_a_499_not_a_500(caplog):
    import logging

    from sgl.server.errors import ClientDisconnected

    app = create_app(FakeEngine(), served_model_name="m")

    @app.get("/left")
    async def left() -> None:
        raise ClientDisconnected()

    with caplog.at_level(logging.ERROR), TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/left").status_code == 499
    assert not [r for r in caplog.records if "unhandled error" in r.getMessage()]


def test_bad_requests_name_the_field(http):
    r = http.post("/v1/completions", json={"model": "m", "prompt": [], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http.post("/v1/completions", json={"model": "other", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # the placeholders (README's "default", sglang-router's "unknown", none) and the path name the one model
    for extra in ({"model": "default"}, {"model": "unknown"}, {"model": None}, {}, {"model": "fake-model"}):
        r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, **extra})
        assert r.status_code == 200 and r.json()["model"] == "m", extra
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 2, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
