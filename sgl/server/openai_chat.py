"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat shapes.

parse (`parse_chat`: tools plan, prompt, budget, sampling) -> generate (`generate_groups`,
or `stream_choices` with one engine stream per choice) -> format (`format_chat`, or
`ChatStream` for the SSE deltas). Tool calls follow `tool_calls.py`. With tools in play,
streamed replies are buffered per choice and sent as one final delta (content or
tool_calls), since whether the text is a call is only known at the end; plain replies
stream token by token.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sgl.server import tool_calls
from sgl.server.engine_client import EngineClient, GenInput, client_of, finish_of, meta_of, new_rid, split_n
from sgl.server.errors import bad_request
from sgl.server.openai_api import (Envelope, chat_logprobs, check_model, finish_reason, generate_groups,
                                   response_format_schema, sampling_from, stream_choices, usage_of, wants_usage)
from sgl.server.openai_protocol import ChatCompletionRequest
from sgl.server.pd import bootstraps


def register(app: FastAPI) -> None:
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])


async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    client = client_of(request)
    job = parse_chat(req, client, request.app.state.engine, check_model(request, req.model))
    if not req.stream:
        group = (await generate_groups(request, client, [job.gen]))[0]
        return JSONResponse(format_chat(job, client, group))
    subs = split_n(job.gen)
    return await stream_choices(request, client, subs, [0] * len(subs), job.envelope, ChatStream(job, client),
                                wants_usage(req.stream_options))


# ---- parse --------------------------------------------------------------------------------

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

    def message(self, text: str, fr_raw: Any) -> tuple[dict[str, Any], str | None, Any]:
        """The assistant message, OpenAI finish_reason and matched_stop of a finished choice."""
        fr, matched = finish_reason(fr_raw)
        content, calls = self.parse(text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
            fr = "tool_calls"
        return msg, fr, matched

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


@dataclass
class ChatJob:
    req: ChatCompletionRequest
    plan: _ToolPlan
    gen: GenInput
    envelope: Envelope


def parse_chat(req: ChatCompletionRequest, client: EngineClient, engine: Any, model: str) -> ChatJob:
    plan = _ToolPlan(req)
    prompt = _build_prompt(req, plan, engine)
    num = client.count_tokens(prompt)
    limit, max_param = _completion_limit(req, client.max_sequence - num)
    client.check_budget(num, limit, prompt_param="messages", max_param=max_param)
    schema = plan.schema if plan.schema is not None else response_format_schema(req.response_format)
    if plan.schema is not None and req.response_format is not None and req.response_format.type != "text":
        raise bad_request("response_format cannot be combined with a forced tool_choice", "response_format")
    sp = sampling_from(req, client, limit, schema)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    rooms = bootstraps(client.engine, req.bootstrap_host, req.bootstrap_port, req.bootstrap_room, 1, req.n)
    gen = GenInput(prompt, None, sp, req.rid or new_rid("chatcmpl-"), req.logprobs, None,
                   (req.top_logprobs or 0) if req.logprobs else None, num, rooms[0] if rooms is not None else None)
    return ChatJob(req, plan, gen, Envelope("chatcmpl-" + uuid.uuid4().hex, "chat.completion", model,
                                            chunk_object="chat.completion.chunk", fingerprint=True))


def _completion_limit(req: ChatCompletionRequest, room: int) -> tuple[int, str]:
    """(max new tokens, the parameter that set it); without one, the room left in the context
    and the KV pool."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return (max(room, 0) if req.max_tokens is None else req.max_tokens), "max_tokens"


# ---- format -------------------------------------------------------------------------------

def format_chat(job: ChatJob, client: EngineClient, group: list[dict[str, Any]]) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(group):
        msg, fr, matched = job.plan.message(out.get("text", ""), finish_of(out))
        choices.append({"index": i, "message": msg,
                        "logprobs": chat_logprobs(client, meta_of(out)) if job.req.logprobs else None,
                        "finish_reason": fr, "matched_stop": matched})
    return job.envelope.body(choices, usage=usage_of([[meta_of(o) for o in group]]))


class ChatStream:
    """A role delta for every choice, then content deltas token by token, or, with tools
    in play, one buffered delta at the end (a ChoiceRenderer)."""

    def __init__(self, job: ChatJob, client: EngineClient) -> None:
        self.job, self.client = job, client
        self.buffered = job.plan.mode != "none"

    def opening(self, n: int) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)]

    def on_chunk(self, i: int, chunk: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
        if self.buffered:
            return []
        text = chunk.get("text", "")
        delta = text[len(state.get("sent", "")):]
        state["sent"] = text
        lp = None
        if self.job.req.logprobs:
            full = chat_logprobs(self.client, meta_of(chunk))["content"]
            lp = {"content": full[state.get("lp_sent", 0):]}
            state["lp_sent"] = len(full)
        if not delta and not (lp and lp["content"]):
            return []
        return [{"index": i, "delta": {"content": delta}, "logprobs": lp, "finish_reason": None}]

    def on_finish(self, i: int, chunk: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
        msg, fr, matched = self.job.plan.message(chunk.get("text", ""), finish_of(chunk))
        out = []
        if self.buffered:
            delta: dict[str, Any] = {}
            if msg.get("tool_calls"):
                delta["tool_calls"] = msg["tool_calls"]
            elif msg["content"]:
                delta["content"] = msg["content"]
            lp = chat_logprobs(self.client, meta_of(chunk)) if self.job.req.logprobs else None
            out.append({"index": i, "delta": delta, "logprobs": lp, "finish_reason": None})
        out.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": fr, "matched_stop": matched})
        return out
