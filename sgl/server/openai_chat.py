"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat shapes.

Tool calls follow `tool_calls.py`. With tools in play, streamed replies are buffered per
choice and sent as one final delta (content or tool_calls), since whether the text is a
call is only known at the end; plain replies stream token by token.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sgl.server import tool_calls
from sgl.server.access_log import note_usage
from sgl.server.engine_client import EngineClient, GenInput, finish_of, meta_of, new_rid, split_n
from sgl.server.errors import bad_request
from sgl.server.openai_api import (_client, _finish, _response_format_schema, _stream, _usage_of,
                                   chat_logprobs, check_model, router, sampling_from)
from sgl.server.openai_protocol import ChatCompletionRequest
from sgl.server.sse import sse


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    out = []
    for m in req.messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        if isinstance(m.content, list):
            d["content"] = "".join(p.text for p in m.content)
        else:
            d["content"] = m.content or ""
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [{"id": tc.id or tool_calls.call_id(), "type": "function",
                                "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                               for tc in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


class _ToolPlan:
    """What to do about tools for one request: off, auto (parse), or forced (grammar)."""

    def __init__(self, req: ChatCompletionRequest) -> None:
        self.tools = [t.model_dump() for t in req.tools or []]
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if not self.tools and choice != "none":
            raise bad_request("tool_choice is set but no tools were given", "tool_choice")
        self.mode = "none" if choice == "none" else ("auto" if choice == "auto" else "forced")
        self.schema: str | None = None
        self.fixed_name: str | None = None
        if self.mode == "forced":
            named = choice.model_dump() if not isinstance(choice, str) else choice
            self.schema, self.fixed_name = tool_calls.constraint_schema(self.tools, named)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if self.mode == "forced":
            calls = tool_calls.parse_forced(text, self.fixed_name)
            return (None, calls) if calls else (text, [])
        if self.mode == "auto":
            return tool_calls.parse_auto(text, self.tools)
        return text, []


def _build_prompt(req: ChatCompletionRequest, plan: _ToolPlan, engine: Any) -> str:
    # Tools go into the system message rather than the template's `tools` variable: few
    # templates (SmolLM2's included) render tools, and this way every model sees them.
    messages = _messages(req)
    if plan.mode != "none":
        messages = _with_system(messages, tool_calls.describe_tools(plan.tools, auto=plan.mode == "auto"))
    add_gen = not (req.continue_final_message and messages[-1]["role"] == "assistant")
    try:
        return engine.apply_chat_template(messages, add_generation_prompt=add_gen)
    except Exception as e:  # jinja2 TemplateError (e.g. raise_exception in the template)
        raise bad_request(f"messages could not be rendered with the chat template: {e}", "messages") from None


@router.post("/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    client = _client(request)
    engine = request.app.state.engine
    model = check_model(request, req.model)
    plan = _ToolPlan(req)
    prompt = _build_prompt(req, plan, engine)
    num = client.count_tokens(prompt)
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if limit is None:
        limit = max(client.context_length - num, 0)
    client.check_budget(num, limit, prompt_param="messages", max_param=max_param)
    schema = plan.schema if plan.schema is not None else _response_format_schema(req.response_format)
    if plan.schema is not None and req.response_format is not None and req.response_format.type != "text":
        raise bad_request("response_format cannot be combined with a forced tool_choice", "response_format")
    sp = sampling_from(req, client, limit, schema)
    want_lp = bool(req.logprobs)
    if req.top_logprobs and not want_lp:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    g = GenInput(prompt, None, sp, req.rid or new_rid("chatcmpl-"), want_lp, None,
                 (req.top_logprobs or 0) if want_lp else None, num)
    rid = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())

    def message_and_finish(text: str, fr_raw: Any) -> tuple[dict[str, Any], str | None, Any]:
        fr, matched = _finish(fr_raw)
        content, calls = plan.parse(text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
            fr = "tool_calls"
        return msg, fr, matched

    if not req.stream:
        out = (await client.generate(request, [g]))[0]
        group = out if isinstance(out, list) else [out]
        choices = []
        for i, o in enumerate(group):
            note_usage(request, meta_of(o))
            msg, fr, matched = message_and_finish(o.get("text", ""), finish_of(o))
            choices.append({"index": i, "message": msg,
                            "logprobs": chat_logprobs(client, meta_of(o)) if want_lp else None,
                            "finish_reason": fr, "matched_stop": matched})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": _usage_of([[meta_of(o) for o in group]]),
                             "system_fingerprint": None})

    buffered = plan.mode != "none"
    subs = split_n(g)

    def frame(choices: list[dict[str, Any]], usage: Any = None, with_usage_key: bool = False) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "system_fingerprint": None, "choices": choices}
        if with_usage_key:
            body["usage"] = usage
        return sse(body)

    include_usage = req.stream_options is not None and req.stream_options.include_usage

    def first_frames(n: int) -> list[bytes]:
        return [frame([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(n)], None, include_usage)]

    def on_chunk(i: int, chunk: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
        text = chunk.get("text", "")
        if buffered:
            return []
        sent = state.get("sent", "")
        delta = text[len(sent):]
        state["sent"] = text
        lp = None
        if want_lp:
            full = chat_logprobs(client, meta_of(chunk))["content"]
            lp = {"content": full[state.get("lp_sent", 0):]}
            state["lp_sent"] = len(full)
        if not delta and not (lp and lp["content"]):
            return []
        return [{"index": i, "delta": {"content": delta}, "logprobs": lp, "finish_reason": None}]

    def on_finish(i: int, chunk: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
        text = chunk.get("text", "")
        msg, fr, matched = message_and_finish(text, finish_of(chunk))
        out = []
        if buffered:
            delta: dict[str, Any] = {}
            if msg.get("tool_calls"):
                delta["tool_calls"] = msg["tool_calls"]
            elif msg["content"]:
                delta["content"] = msg["content"]
            lp = chat_logprobs(client, meta_of(chunk)) if want_lp else None
            out.append({"index": i, "delta": delta, "logprobs": lp, "finish_reason": None})
        out.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": fr, "matched_stop": matched})
        return out

    return await _stream(request, client, subs, [0] * len(subs), 1, on_chunk, frame, first_frames,
                         include_usage, on_finish)
