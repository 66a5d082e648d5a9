"""Tool (function) calling for the chat API: prompts, grammars, and parsing.

How a call is produced depends on `tool_choice`:

- a named function: the reply is generated under a JSON-Schema grammar built from that
  function's `parameters`, so it *is* the arguments object; it is returned as one call.
- "required": the grammar is `anyOf` over `{"name": <const>, "arguments": <parameters>}`
  for every tool, so the model must pick a tool and give valid arguments.
- "auto" (the default when tools are given): the model generates freely after being
  shown the tools and the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  convention (Hermes/Qwen style). Every well-formed block naming a known tool becomes a
  call; text outside the blocks stays the message content. Unconstrained, so a small
  model may answer in prose instead, which is a valid "auto" outcome.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from sgl.server.errors import bad_request

_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def make_call(name: str, arguments: Any, index: int = 0) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "index": index, "type": "function", "function": {"name": name, "arguments": args}}


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else dict(_ANY_OBJECT)


def describe_tools(tools: list[dict[str, Any]], *, auto: bool) -> str:
    """System-prompt text listing the tools (and, for auto, the call convention)."""
    specs = [json.dumps({"name": t["function"]["name"], "description": t["function"].get("description") or "",
                         "parameters": parameters_of(t)}, ensure_ascii=False) for t in tools]
    text = "You have access to the following functions:\n" + "\n".join(specs)
    if auto:
        text += ("\n\nTo call a function, reply with\n<tool_call>\n{\"name\": <function name>, "
                 "\"arguments\": <arguments object>}\n</tool_call>\nOtherwise answer normally.")
    return text


def find_tool(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for t in tools:
        if t["function"]["name"] == name:
            return t
    raise bad_request(f"tool_choice names function {name!r}, which is not in tools "
                      f"({[t['function']['name'] for t in tools]})", "tool_choice")


def constraint_schema(tools: list[dict[str, Any]], choice: Any) -> tuple[str, str | None]:
    """JSON Schema (as a string) for a forced call, and the function name if fixed."""
    if isinstance(choice, dict):
        tool = find_tool(tools, choice["function"]["name"])
        return json.dumps(parameters_of(tool)), tool["function"]["name"]
    many = len(tools) > 1
    variants = [{"type": "object",
                 "properties": {"name": {"const": t["function"]["name"]},
                                "arguments": _rebase_refs(parameters_of(t),
                                                          (f"/anyOf/{i}" if many else "") + "/properties/arguments")},
                 "required": ["name", "arguments"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema = {"anyOf": variants} if many else variants[0]
    return json.dumps(schema), None


# Keywords whose values are data, not schemas: a {"$ref": ...} inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords mapping names to schemas: a property may be called "const" or "$ref".
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                          "dependencies"})


def _rebase_refs(schema: Any, prefix: str) -> Any:
    """`schema` with its local $refs ("#/$defs/Foo", "#") pointing into the place it is nested
    at (`prefix`, a JSON pointer): pydantic's parameters keep their $defs at their root, and
    nested under "arguments" a "#/$defs/Foo" would name the wrapper's root instead."""
    if isinstance(schema, list):
        return [_rebase_refs(s, prefix) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):  # not "#anchor"
            out[k] = "#" + prefix + v[1:]
        elif k in _DATA_KEYWORDS:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _rebase_refs(sub, prefix) for name, sub in v.items()}
        else:
            out[k] = _rebase_refs(v, prefix)
    return out


def parse_forced(text: str, fixed_name: str | None) -> list[dict[str, Any]]:
    """Calls from output generated under `constraint_schema` (empty if not parseable)."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # the model's output may nest deeper than json can
        return []
    if fixed_name is not None:
        return [make_call(fixed_name, obj)]
    if isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj:
        return [make_call(obj["name"], obj["arguments"])]
    return []


def parse_auto(text: str, tools: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """Split free output into (content, calls) using the <tool_call> convention."""
    names = {t["function"]["name"] for t in tools}
    calls: list[dict[str, Any]] = []
    for m in _CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(obj, dict) and obj.get("name") in names:
            calls.append(make_call(obj["name"], obj.get("arguments", obj.get("parameters", {})), len(calls)))
    if not calls:
        return text, []
    content = _CALL_RE.sub("", text).strip()
    return (content or None), calls
