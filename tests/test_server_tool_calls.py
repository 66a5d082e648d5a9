"""Tool-call prompts, grammars and parsing (pure functions, no server)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sgl.server import tool_calls
from sgl.server.errors import APIError

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "ping"}},
]


def test_parse_auto_extracts_known_calls_and_keeps_text():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = tool_calls.parse_auto(text, TOOLS)
    assert content == "Let me add."
    assert len(calls) == 1 and calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


@pytest.mark.parametrize("text", ["plain answer", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                                  "<tool_call>{not json</tool_call>"])
def test_parse_auto_leaves_non_calls_as_content(text):
    assert tool_calls.parse_auto(text, TOOLS) == (text, [])


def test_forced_named_schema_is_the_parameters():
    schema, name = tool_calls.constraint_schema(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert name == "add" and json.loads(schema) == TOOLS[0]["function"]["parameters"]
    calls = tool_calls.parse_forced('{"a": 3, "b": 4}', name)
    assert calls[0]["function"]["name"] == "add" and json.loads(calls[0]["function"]["arguments"]) == {"a": 3, "b": 4}
    with pytest.raises(APIError) as e:
        tool_calls.constraint_schema(TOOLS, {"type": "function", "function": {"name": "missing"}})
    assert e.value.param == "tool_choice"


def test_required_schema_accepts_exactly_the_tools():
    schema = json.loads(tool_calls.constraint_schema(TOOLS, "required")[0])
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, schema)
    jsonschema.validate({"name": "ping", "arguments": {}}, schema)
    for bad in ({"name": "add", "arguments": {"a": 1}}, {"name": "other", "arguments": {}}, {"name": "ping"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    calls = tool_calls.parse_forced('{"name": "ping", "arguments": {}}', None)
    assert calls[0]["function"] == {"name": "ping", "arguments": "{}"}
    assert tool_calls.parse_forced("not json", None) == []


def test_describe_tools_mentions_every_tool():
    text = tool_calls.describe_tools(TOOLS, auto=True)
    assert '"add"' in text and '"ping"' in text and "<tool_call>" in text
    assert "<tool_call>" not in tool_calls.describe_tools(TOOLS, auto=False)


def test_model_output_nested_deeper_than_json_can_parse_is_text_not_a_crash():
    from sgl.server.tool_calls import parse_auto, parse_forced

    deep = "[" * 100_000 + "]" * 100_000
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>'
    assert parse_auto(text, tools) == (text, [])
    assert parse_forced(deep, "f") == []


# As pydantic writes them: shared types under $defs at the parameters' root, and a tree
# type that refers to itself through "#".
POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}
DEFS_TOOLS = [
    {"type": "function", "function": {"name": "move", "parameters": {
        "$defs": {"Point": POINT}, "type": "object", "additionalProperties": False,
        "properties": {"to": {"$ref": "#/$defs/Point"}, "const": {"enum": [{"$ref": "#/not-a-ref"}]}},
        "required": ["to"]}}},
    {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["kids"], "additionalProperties": False}}},
]


@pytest.mark.parametrize("tools", [DEFS_TOOLS, DEFS_TOOLS[:1]], ids=["two-tools", "one-tool"])
def test_required_schema_keeps_each_tools_refs_pointing_into_its_own_parameters(tools):
    from sgl.runtime.constrained.json_schema import canonical_json, schema_to_regex

    schema = json.loads(tool_calls.constraint_schema(tools, "required")[0])
    good = {"name": "move", "arguments": {"to": {"x": 1, "y": 2}}}
    bad = {"name": "move", "arguments": {"to": {"x": 1}}}
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    data = json.dumps(schema)
    assert '"#/not-a-ref"' in data  # data under enum is left as it was
    rx = schema_to_regex(schema)  # our compiler resolves the rebased pointers too
    assert re.fullmatch(rx, canonical_json(good, schema)) and not re.fullmatch(rx, canonical_json(bad, schema))
    if len(tools) > 1:
        jsonschema.validate({"name": "tree", "arguments": {"kids": [{"kids": []}, {"kids": [{"kids": []}]}]}}, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": "tree", "arguments": {"kids": [{"kids": 1}]}}, schema)


def test_rebasing_leaves_anchors_and_data_alone_and_reaches_draft7_dependencies():
    schema = {"$ref": "#node", "dependencies": {"default": {"$ref": "#/$defs/A"}}, "enum": [{"$ref": "#/x"}]}
    assert tool_calls._rebase_refs(schema, "/p") == {
        "$ref": "#node", "dependencies": {"default": {"$ref": "#/p/$defs/A"}}, "enum": [{"$ref": "#/x"}]}
