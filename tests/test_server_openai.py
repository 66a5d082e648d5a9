"""The OpenAI-compatible API through the official `openai` client, against a real server."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server_proc import start_server

pytestmark = [pytest.mark.server, pytest.mark.model]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                   "required": ["tz"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def srv():
    s = start_server("--max-total-tokens", "16384", "--context-length", "2048", "--served-model-name", "smol")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=120, max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["smol"]


def test_completion_logprobs_and_usage(client):
    r = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=5,
                                  temperature=0, logprobs=2)
    c = r.choices[0]
    assert "Paris" in c.text and c.finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert len(c.logprobs.tokens) == 5 and "".join(c.logprobs.tokens) == c.text
    assert all(len(t) == 2 and max(t.values()) == lp for t, lp in zip(c.logprobs.top_logprobs, c.logprobs.token_logprobs))
    # the same prompt again hits the prefix cache
    r2 = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=1, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_n2_stop_and_logprobs(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Name a color."}],
                                       max_tokens=12, n=2, seed=1, temperature=1.0, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.message.role == "assistant" and c.message.content
        assert len(c.logprobs.content) > 0 and len(c.logprobs.content[0].top_logprobs) == 2
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    s = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Count from 1 to 9."}],
                                       max_tokens=40, temperature=0, stop=["5"])
    assert "5" not in s.choices[0].message.content and s.choices[0].finish_reason == "stop"


def test_chat_stream_with_usage(client):
    kwargs = dict(model="smol", messages=[{"role": "user", "content": "Say hello."}], max_tokens=10, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    assert "".join(parts) == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_stream_n2(client):
    stream = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=6, n=2, seed=3,
                                       stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[0] and texts[1]


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Reply with a JSON object."}], max_tokens=40,
        temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call(client, choice):
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What's the weather in Paris?"}], max_tokens=60,
        temperature=0, tools=[WEATHER_TOOL, TIME_TOOL] if choice == "required" else [WEATHER_TOOL],
        tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_call_streamed_and_auto(client):
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Weather in Rome?"}], max_tokens=60, temperature=0,
        tools=[WEATHER_TOOL], tool_choice="required", stream=True)
    calls = [tc for ch in stream for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_TOOL["function"]["parameters"])
    # auto: free generation; either prose or a parsed call, never an error
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi!"}],
                                       max_tokens=16, temperature=0, tools=[WEATHER_TOOL])
    c = r.choices[0]
    assert c.message.content or c.message.tool_calls


def test_errors_are_openai_shaped(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert e.value.body["param"] == "max_tokens" and "context length" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="x", max_tokens=4, temperature=-1)
    assert "temperature" in e.value.body["message"]
