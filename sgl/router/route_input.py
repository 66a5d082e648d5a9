"""What a policy routes on, taken from a request body (`RouteRequest`: text, token ids).

    /generate             `text`, or `input_ids` (token ids, routing text "")
    /v1/completions       `prompt`: a string or a list of token ids
    /v1/chat/completions  the conversation rendered with the worker's chat template (the
                          text the worker will prefill), when the router has the
                          worker's tokenizer; else the message contents joined by newlines

A batch (a list of texts, of prompts, or of id lists) is routed whole, by its first
element: the batch goes to one worker in one request, as a client sent it, so the
answer's order and shape are the worker's own. Token ids are computed only when the
policy asks for them (`wants_token_ids`) and a tokenizer is at hand.
A body whose routing fields have the wrong type, or token ids outside 0 .. 2**32-1, raises
`ValueError` naming the field.
"""

from __future__ import annotations

from typing import Any, Protocol

from sgl.router.policies.base import RouteRequest


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str: ...


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value and isinstance(value[0], (str, list)) else value


# Token ids are hashed into page hashes as unsigned 32-bit values (sgl/kv_events/hashing.py).
MAX_TOKEN_ID = 2**32 - 1


def _ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{name} must be a string, a list of token ids, or a list of those")
    bad = next((t for t in value if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise ValueError(f"{name}: token id {bad} is out of range (0 .. {MAX_TOKEN_ID})")
    return value


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def route_request(endpoint: str, body: dict[str, Any], tokenizer: Tokenizer | None, want_ids: bool,
                  request_id: str | None = None) -> RouteRequest:
    text, ids = "", None
    if endpoint == "/generate":
        if body.get("text") is not None:
            text = _first(body["text"])
            if not isinstance(text, str):
                raise ValueError("text must be a string or a list of strings")
        elif body.get("input_ids") is not None:
            ids = _ids(_first(body["input_ids"]), "input_ids")
    elif endpoint == "/v1/completions":
        prompt = _first(body.get("prompt", ""))
        if isinstance(prompt, str):
            text = prompt
        else:
            ids = _ids(prompt, "prompt")
    elif endpoint == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of message objects")
        text = _render(messages, body.get("tools"), tokenizer)
    if ids is None and want_ids and tokenizer is not None and text:
        ids = tokenizer.encode(text)
    return RouteRequest(endpoint=endpoint, text=text, token_ids=ids, request_id=request_id)


def _render(messages: list[dict[str, Any]], tools: Any, tokenizer: Tokenizer | None) -> str:
    if tokenizer is not None:
        try:
            return tokenizer.render_chat(messages, tools if isinstance(tools, list) else None)
        except Exception:  # a conversation the template rejects still gets routed; the worker will answer
            pass
    return "\n".join(_content_text(m.get("content")) for m in messages)
