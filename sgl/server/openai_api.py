"""OpenAI-compatible API: what its two handlers share, and GET /v1/models.

The completions (openai_completions.py) and chat (openai_chat.py) handlers each run
parse -> generate -> format. Parse turns a request into engine inputs: SGLang sampling
names (`sampling_from`), with `response_format` as a `json_schema` constraint
(json_object -> any JSON object). Generate runs them through the engine client
(validation, aborts, metrics): `generate_groups` waits for whole outputs (n > 1 uses
the engine's n, one shared prompt); `stream_choices` opens one engine stream per choice
and turns its chunks into SSE frames. Format renders OpenAI's shapes; the pieces both
need (envelope, finish reason, usage, logprobs) are here.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response

from sgl.runtime.constrained.kinds import CONSTRAINT_KINDS
from sgl.runtime.sampling_params import FIELD_NAMES
from sgl.server.access_log import note_usage
from sgl.server.engine_client import (EngineClient, GenInput, abort_chunk_error, client_of, finish_of, meta_of,
                                     sse_response, tagged_chunks)
from sgl.server.errors import APIError, bad_request, error_body
from sgl.server.model_name import resolve_model
from sgl.server.openai_protocol import OPENAI_NAMES, ResponseFormat, SamplingFields, StreamOptions
from sgl.server.sse import DONE, sse

log = logging.getLogger("sgl.server")


def register(app: FastAPI) -> None:
    app.add_api_route("/v1/models", list_models, methods=["GET"])


async def list_models(request: Request) -> dict[str, Any]:
    st = request.app.state
    return {"object": "list", "data": [{
        "id": st.served_model_name, "object": "model", "created": st.created, "owned_by": "sgl",
        "root": st.model_path, "max_model_len": client_of(request).context_length}]}


def check_model(request: Request, model: str | None) -> str:
    """The served name for a request's `model` (the rule: sgl/server/model_name.py)."""
    st = request.app.state
    return resolve_model(model, st.served_model_name, st.model_aliases)


# ---- parse --------------------------------------------------------------------------------

def response_format_schema(rf: ResponseFormat | None) -> str | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return '{"type": "object"}'
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("response_format.json_schema.schema is required for type json_schema",
                          "response_format.json_schema")
    return json.dumps(rf.json_schema.schema_)


def sampling_from(req: SamplingFields, client: EngineClient, max_new_tokens: int, json_schema: str | None) -> dict[str, Any]:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    declared = type(req).model_fields
    d: dict[str, Any] = {name: getattr(req, OPENAI_NAMES.get(name, name)) for name in FIELD_NAMES
                         if OPENAI_NAMES.get(name, name) in declared}
    d["max_new_tokens"] = max_new_tokens  # the endpoint's pick of max_tokens / max_completion_tokens / default
    if json_schema is not None:
        given_kinds = [k for k in CONSTRAINT_KINDS if d.get(k) is not None]
        if given_kinds:
            raise bad_request(f"response_format/tools cannot be combined with {given_kinds[0]}", "response_format")
        d["json_schema"] = json_schema
    if d["min_new_tokens"] is not None and d["min_new_tokens"] > max_new_tokens:
        raise bad_request(f"min_tokens ({d['min_new_tokens']}) must be <= max_tokens ({max_new_tokens})",
                          "min_tokens")
    return client.clean_sampling(d, "")


def wants_usage(stream_options: StreamOptions | None) -> bool:
    return stream_options is not None and stream_options.include_usage


# ---- format -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Envelope:
    """The fields around `choices` in every response (or chunk) of one request."""

    id: str
    object: str  # of a whole response; `chunk_object` in streamed frames
    model: str
    chunk_object: str = ""
    fingerprint: bool = False  # chat shapes carry "system_fingerprint": null
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, choices: list[dict[str, Any]], *, chunk: bool = False, **extra: Any) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "object": (self.chunk_object or self.object) if chunk else self.object,
                             "created": self.created, "model": self.model}
        if self.fingerprint:
            d["system_fingerprint"] = None
        d["choices"] = choices
        d.update(extra)
        return d


def finish_reason(fr: Any) -> tuple[str | None, Any]:
    """OpenAI finish_reason and SGLang's matched_stop from an engine finish reason."""
    if not fr:
        return None, None
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    matched = fr.get("matched") if isinstance(fr, dict) else None
    return ("length" if kind == "length" else "stop"), matched


def usage_of(metas_by_prompt: list[list[dict[str, Any]]]) -> dict[str, Any]:
    # Prompt tokens count once per prompt, however many choices were sampled from it.
    p = sum(int(ms[0].get("prompt_tokens") or 0) for ms in metas_by_prompt if ms)
    c = sum(int(m.get("completion_tokens") or 0) for ms in metas_by_prompt for m in ms)
    k = sum(int(ms[0].get("cached_tokens") or 0) for ms in metas_by_prompt if ms)
    details = {"cached_tokens": k}
    # The tier split appears when the worker reports one (hierarchical cache on).
    split = [ms[0]["cached_tokens_details"] for ms in metas_by_prompt if ms and ms[0].get("cached_tokens_details")]
    if split:
        details["cached_tokens_details"] = {t: sum(int(d.get(t) or 0) for d in split) for t in ("device", "host", "storage")}
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": details}


def chat_logprobs(client: EngineClient, meta: dict[str, Any]) -> dict[str, Any]:
    toks = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    content = []
    for i, e in enumerate(toks):
        s = client.token_text(int(e[1]))
        row = tops[i] if i < len(tops) and tops[i] else []
        content.append({"token": s, "logprob": e[0], "bytes": list(s.encode()),
                        "top_logprobs": [{"token": client.token_text(int(t[1])), "logprob": t[0],
                                          "bytes": list(client.token_text(int(t[1])).encode())} for t in row]})
    return {"content": content}


def completion_logprobs(client: EngineClient, meta: dict[str, Any], echo: bool) -> dict[str, Any]:
    def entries(kind: str) -> list[Any]:
        return list((meta.get(f"input_{kind}") or []) if echo else []) + list(meta.get(f"output_{kind}") or [])

    tokens, lps, top_out, offsets = [], [], [], []
    pos = 0
    tops = entries("top_logprobs")
    for i, e in enumerate(entries("token_logprobs")):
        s = client.token_text(int(e[1]))
        tokens.append(s)
        lps.append(e[0])
        offsets.append(pos)
        pos += len(s)
        row = tops[i] if i < len(tops) else None
        top_out.append({client.token_text(int(t[1])): t[0] for t in row} if row else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_out, "text_offset": offsets}


# ---- generate -----------------------------------------------------------------------------

async def generate_groups(request: Request, client: EngineClient, gens: list[GenInput]) -> list[list[dict[str, Any]]]:
    """Whole outputs: for each input, its n choices (usage noted for the access log)."""
    outs = await client.generate(request, gens)
    groups = [out if isinstance(out, list) else [out] for out in outs]
    for group in groups:
        for o in group:
            note_usage(request, meta_of(o))
    return groups


class ChoiceRenderer(Protocol):
    """How one endpoint turns the engine chunks of a streamed choice into choice deltas.

    `state` is a dict per choice the renderer may keep notes in (what was sent so far)."""

    def opening(self, n: int) -> list[dict[str, Any]]:
        """Choices of a frame sent before any chunk ([]: none)."""

    def on_chunk(self, i: int, chunk: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]: ...

    def on_finish(self, i: int, chunk: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
        """Extra choices after the last chunk of choice i."""


async def stream_choices(request: Request, client: EngineClient, subs: list[GenInput], prompt_of: list[int],
                         envelope: Envelope, renderer: ChoiceRenderer, include_usage: bool) -> Response:
    """Open one engine stream per choice (`subs`, from prompt `prompt_of[i]`) and send
    each choice delta in its own SSE frame, as OpenAI streams do; usage last if asked."""
    handles = await client.open_streams(request, subs)

    def frame(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        return sse(envelope.body(choices, chunk=True, **({"usage": usage} if include_usage else {})))

    async def frames() -> AsyncIterator[bytes]:
        states: list[dict[str, Any]] = [{} for _ in subs]
        metas: list[list[dict[str, Any]]] = [[] for _ in range(max(prompt_of) + 1)]
        opening = renderer.opening(len(subs))
        if opening:
            yield frame(opening)
        try:
            async for i, chunk in tagged_chunks(handles):
                err = abort_chunk_error(chunk)
                if err is not None:
                    yield sse(error_body(err.message, err.type, err.param, err.status))
                    continue
                choices = renderer.on_chunk(i, chunk, states[i])
                if finish_of(chunk) is not None:
                    note_usage(request, meta_of(chunk))
                    metas[prompt_of[i]].append(meta_of(chunk))
                    choices = choices + renderer.on_finish(i, chunk, states[i])
                for c in choices:
                    yield frame([c])
        except APIError as e:
            yield sse(error_body(e.message, e.type, e.param, e.status))
            yield DONE
            return
        except Exception as e:  # noqa: BLE001 - a renderer failing on odd model output: end with an error
            log.exception("streaming a completion failed")
            yield sse(error_body(f"internal error while streaming: {type(e).__name__}", "server_error", None, 500))
            yield DONE
            return
        if include_usage:
            yield frame([], usage_of(metas))
        yield DONE

    return sse_response(frames(), handles)
