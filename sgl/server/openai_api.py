"""OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Requests are translated into engine inputs (SGLang sampling names), run through the
engine client (validation, aborts, metrics), and the results rendered in OpenAI's
shapes, streamed as `chat.completion.chunk` / `text_completion` SSE frames when asked.
`response_format` becomes a `json_schema` constraint (json_object -> any JSON object);
tools are handled as `tool_calls.py` describes. Each of the n choices of a streamed
request is its own engine stream; non-streamed n > 1 uses the engine's n (shared prompt).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sgl.runtime.constrained.kinds import CONSTRAINT_KINDS
from sgl.runtime.sampling_params import FIELD_NAMES
from sgl.server.access_log import note_usage
from sgl.server.engine_client import (EngineClient, GenInput, abort_message, finish_of, meta_of, new_rid,
                                     split_n)
from sgl.server.errors import APIError, bad_request, error_body
from sgl.server.openai_protocol import OPENAI_NAMES, CompletionRequest, ResponseFormat, _Sampling
from sgl.server.sse import DONE, guarded_stream, merge_streams, sse

router = APIRouter(prefix="/v1")


def _client(request: Request) -> EngineClient:
    return request.app.state.client


def check_model(request: Request, model: str) -> str:
    st = request.app.state
    if model in st.model_aliases:
        return st.served_model_name
    raise APIError(f"model {model!r} does not exist; this server serves {st.served_model_name!r}", 404,
                   param="model", code="model_not_found")


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    st = request.app.state
    return {"object": "list", "data": [{
        "id": st.served_model_name, "object": "model", "created": st.created, "owned_by": "sgl",
        "root": st.model_path, "max_model_len": _client(request).context_length}]}


# ---- translation ----------------------------------------------------------------------------

def _response_format_schema(rf: ResponseFormat | None) -> str | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return '{"type": "object"}'
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("response_format.json_schema.schema is required for type json_schema",
                          "response_format.json_schema")
    return json.dumps(rf.json_schema.schema_)


def sampling_from(req: _Sampling, client: EngineClient, max_new_tokens: int, json_schema: str | None) -> dict[str, Any]:
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


def _finish(fr: Any) -> tuple[str | None, Any]:
    """OpenAI finish_reason and SGLang's matched_stop from an engine finish reason."""
    if not fr:
        return None, None
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    matched = fr.get("matched") if isinstance(fr, dict) else None
    return ("length" if kind == "length" else "stop"), matched


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _usage_of(metas_by_prompt: list[list[dict[str, Any]]]) -> dict[str, Any]:
    # Prompt tokens count once per prompt, however many choices were sampled from it.
    p = sum(int(ms[0].get("prompt_tokens") or 0) for ms in metas_by_prompt if ms)
    c = sum(int(m.get("completion_tokens") or 0) for ms in metas_by_prompt for m in ms)
    k = sum(int(ms[0].get("cached_tokens") or 0) for ms in metas_by_prompt if ms)
    return _usage(p, c, k)


def _lp_entries(meta: dict[str, Any], key: str) -> list[Any]:
    return list(meta.get(key) or [])


def chat_logprobs(client: EngineClient, meta: dict[str, Any], start: int = 0) -> dict[str, Any]:
    toks = _lp_entries(meta, "output_token_logprobs")[start:]
    tops = _lp_entries(meta, "output_top_logprobs")[start:]
    content = []
    for i, e in enumerate(toks):
        s = client.token_text(int(e[1]))
        row = tops[i] if i < len(tops) and tops[i] else []
        content.append({"token": s, "logprob": e[0], "bytes": list(s.encode()),
                        "top_logprobs": [{"token": client.token_text(int(t[1])), "logprob": t[0],
                                          "bytes": list(client.token_text(int(t[1])).encode())} for t in row]})
    return {"content": content}


def completion_logprobs(client: EngineClient, meta: dict[str, Any], echo: bool, offset0: int) -> dict[str, Any]:
    entries = (_lp_entries(meta, "input_token_logprobs") if echo else []) + _lp_entries(meta, "output_token_logprobs")
    tops = (_lp_entries(meta, "input_top_logprobs") if echo else []) + _lp_entries(meta, "output_top_logprobs")
    tokens, lps, top_out, offsets = [], [], [], []
    pos = offset0
    for i, e in enumerate(entries):
        s = client.token_text(int(e[1]))
        tokens.append(s)
        lps.append(e[0])
        offsets.append(pos)
        pos += len(s)
        row = tops[i] if i < len(tops) else None
        top_out.append({client.token_text(int(t[1])): t[0] for t in row} if row else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_out, "text_offset": offsets}


# ---- completions ----------------------------------------------------------------------------

@router.post("/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    client = _client(request)
    model = check_model(request, req.model)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (best-of sampling is not supported)", "best_of")
    prompts: list[tuple[str | None, list[int] | None]]
    p = req.prompt
    if isinstance(p, str):
        prompts = [(p, None)]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [(x, None) for x in p]  # type: ignore[misc]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [(None, p)]  # type: ignore[list-item]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [(None, x) for x in p]  # type: ignore[misc]
    else:
        raise bad_request("prompt must be a non-empty string, list of strings, or token id list(s)", "prompt")
    if len(prompts) * req.n > 64:
        raise bad_request(f"{len(prompts)} prompts x n={req.n} exceeds 64 choices", "n")
    max_new = 16 if req.max_tokens is None else req.max_tokens
    schema = _response_format_schema(req.response_format)
    sp = sampling_from(req, client, max_new, schema)
    gens = []
    for text, ids in prompts:
        if text is not None:
            if not text:
                raise bad_request("prompt is empty", "prompt")
            num = client.count_tokens(text)
        else:
            num = len(client.check_ids(ids, "prompt"))
        client.check_budget(num, max_new, prompt_param="prompt", max_param="max_tokens")
        want_lp = req.logprobs is not None
        gens.append(GenInput(text, ids, sp, new_rid("cmpl-"), want_lp, 0 if (want_lp and req.echo) else None,
                             req.logprobs if want_lp else None, num))
    rid = "cmpl-" + uuid.uuid4().hex
    created = int(time.time())
    echo_texts = [text if text is not None else client.tokenizer.decode(ids) for text, ids in prompts]

    def choice(idx: int, prompt_i: int, out: dict[str, Any]) -> dict[str, Any]:
        meta = meta_of(out)
        fr, matched = _finish(finish_of(out))
        prefix = echo_texts[prompt_i] if req.echo else ""
        lp = completion_logprobs(client, meta, req.echo, 0) if req.logprobs is not None else None
        return {"index": idx, "text": prefix + out.get("text", ""), "logprobs": lp, "finish_reason": fr,
                "matched_stop": matched}

    if not req.stream:
        outs = await client.generate(request, gens)
        choices, metas = [], []
        for pi, out in enumerate(outs):
            group = out if isinstance(out, list) else [out]
            metas.append([meta_of(o) for o in group])
            for o in group:
                note_usage(request, meta_of(o))
                choices.append(choice(len(choices), pi, o))
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": _usage_of(metas)})

    subs = [(pi, s) for pi, g in enumerate(gens) for s in split_n(g)]

    def frame(choices: list[dict[str, Any]], usage: Any = None, with_usage_key: bool = False) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": choices}
        if with_usage_key:
            body["usage"] = usage
        return sse(body)

    def on_chunk(i: int, chunk: dict[str, Any], state: dict[str, Any]) -> list[dict[str, Any]]:
        pi = subs[i][0]
        text = chunk.get("text", "")
        sent = state.setdefault("sent", "")
        delta = text[len(sent):]
        state["sent"] = text
        if not state.get("echoed") and req.echo:
            delta = echo_texts[pi] + delta
            state["echoed"] = True
        fr, matched = _finish(finish_of(chunk))
        lp = None
        if req.logprobs is not None:
            # Engine chunks carry cumulative logprobs; send only the entries not sent yet.
            full = completion_logprobs(client, meta_of(chunk), req.echo, 0)
            n_sent = state.get("lp_sent", 0)
            lp = {k: v[n_sent:] for k, v in full.items()}
            state["lp_sent"] = len(full["tokens"])
        if not delta and fr is None and not (lp and lp["tokens"]):
            return []
        c = {"index": i, "text": delta, "logprobs": lp, "finish_reason": fr}
        if fr is not None:
            c["matched_stop"] = matched
        return [c]

    return await _stream(request, client, [s for _, s in subs], [pi for pi, _ in subs], len(gens), on_chunk,
                         frame, None, req.stream_options is not None and req.stream_options.include_usage)


# ---- shared streaming ---------------------------------------------------------------------

async def _stream(request: Request, client: EngineClient, subs: list[GenInput], prompt_of: list[int],
                  num_prompts: int, on_chunk: Any, frame: Any, first_frames: Any, include_usage: bool,
                  on_finish: Any = None) -> Response:
    """Open one engine stream per choice, then render chunks via `on_chunk` into SSE frames."""
    handles = await client.open_streams(request, subs)

    async def frames() -> AsyncIterator[bytes]:
        states: list[dict[str, Any]] = [{} for _ in subs]
        metas: list[list[dict[str, Any]]] = [[] for _ in range(num_prompts)]
        if first_frames is not None:
            for f in first_frames(len(subs)):
                yield f
        source = (merge_streams([h.chunks() for h in handles]) if len(handles) > 1
                  else ((0, c) async for c in handles[0].chunks()))
        try:
            async for i, chunk in source:
                msg = abort_message(chunk)
                if msg is not None:
                    yield sse(error_body(msg, "invalid_request_error", None, 400))
                    continue
                choices = on_chunk(i, chunk, states[i])
                if finish_of(chunk) is not None:
                    meta = meta_of(chunk)
                    note_usage(request, meta)
                    metas[prompt_of[i]].append(meta)
                    if on_finish is not None:
                        choices = choices + on_finish(i, chunk, states[i])
                for c in choices:  # one choice per frame, as OpenAI streams do
                    yield frame([c], None, include_usage)
        except APIError as e:
            yield sse(error_body(e.message, e.type, e.param, e.status))
            yield DONE
            return
        if include_usage:
            yield frame([], _usage_of(metas), True)
        yield DONE

    def close_all() -> None:
        for h in handles:
            h.close()

    return StreamingResponse(guarded_stream(frames(), close_all, [h.it for h in handles]),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def model_aliases(served_model_name: str, model_path: str) -> set[str]:
    names = {served_model_name, model_path, os.path.basename(model_path.rstrip("/"))}
    return {n for n in names if n}
