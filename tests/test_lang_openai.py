"""OpenAI backend without a server: ChatML -> messages, requests sent, unsupported features."""

from __future__ import annotations

import json

import httpx
import pytest

import sgl
from sgl.lang.backends.openai import chatml_to_messages


def _backend(seen: list):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path.endswith("/chat/completions"):
            content = "Paris." if "France" in body["messages"][-1]["content"] else "Tokyo."
            return httpx.Response(200, json={
                "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": content}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
        return httpx.Response(200, json={
            "id": "x", "object": "text_completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "text": " 42", "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    return sgl.OpenAI("m", base_url="http://fake/v1", api_key="k", http_client=client)


def test_chatml_round_trip():
    text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU\nmore<|im_end|>\n<|im_start|>assistant\n"
    assert chatml_to_messages(text) == [{"role": "system", "content": "S"}, {"role": "user", "content": "U\nmore"}]
    with pytest.raises(sgl.BackendError):
        chatml_to_messages("<|im_start|>user\nU<|im_end|>\n")


def test_chat_program_sends_messages():
    seen: list = []
    backend = _backend(seen)

    @sgl.function
    def chat(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Capital of France?")
        s += sgl.assistant(sgl.gen("a", max_tokens=8, stop="\n"))
        s += sgl.user("And Japan?")
        s += sgl.assistant(sgl.gen("b", max_tokens=8))

    st = chat.run(backend=backend, temperature=0)
    assert (st["a"], st["b"]) == ("Paris.", "Tokyo.")
    path, body = seen[1]
    assert path == "/v1/chat/completions"
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert body["messages"][2]["content"] == "Paris."
    assert seen[0][1]["stop"] == ["\n"] and seen[0][1]["max_tokens"] == 8


def test_unsupported_features_raise_clearly():
    backend = _backend([])

    @sgl.function
    def regex_prog(s):
        s += sgl.user("x")
        s += sgl.assistant(sgl.gen("a", regex=r"\d+"))

    with pytest.raises(sgl.ProgramError, match="regex"):
        regex_prog.run(backend=backend)

    @sgl.function
    def mid_turn(s):
        s += sgl.user("x")
        s += sgl.assistant("Sure: " + sgl.gen("a"))

    with pytest.raises(sgl.ProgramError, match="start of an assistant turn"):
        mid_turn.run(backend=backend)


def test_completion_model_gets_raw_text():
    seen: list = []
    backend = _backend(seen)
    backend.is_chat_model = False

    @sgl.function
    def prog(s):
        s += "Q: 6*7?\nA:" + sgl.gen("a", max_tokens=4)

    assert prog.run(backend=backend)["a"] == " 42"
    assert seen[0][0] == "/v1/completions" and seen[0][1]["prompt"] == "Q: 6*7?\nA:"


def test_instruct_models_are_chat_models_and_every_option_is_sent():
    assert sgl.OpenAI("meta-llama/Llama-3.1-8B-Instruct", base_url="http://fake/v1", api_key="k").is_chat_model
    assert not sgl.OpenAI("gpt-3.5-turbo-instruct", base_url="http://fake/v1", api_key="k").is_chat_model
    seen: list = []
    backend = _backend(seen)

    @sgl.function
    def prog(s):
        s += sgl.user("x")
        s += sgl.assistant(sgl.gen("a", max_tokens=8, stop=["\n", ".", "!", "?", ";"], top_k=5,
                                   repetition_penalty=1.1))

    prog.run(backend=backend)
    body = seen[0][1]
    assert body["stop"] == ["\n", ".", "!", "?", ";"]  # not cut to 4 in silence
    assert body["top_k"] == 5 and body["repetition_penalty"] == 1.1  # SGLang's extensions, as extra fields
    assert "min_p" not in body and "ignore_eos" not in body  # defaults are not sent

    backend.is_chat_model = False

    @sgl.function
    def raw(s):
        s += "Q: 6*7?\nA:" + sgl.gen("a", max_tokens=4, stop="<|im_end|>")

    raw.run(backend=backend)
    assert seen[-1][1]["stop"] == ["<|im_end|>"]  # a completion model keeps every stop
