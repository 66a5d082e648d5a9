"""SGLang-native HTTP API: /generate, model/server info, health, cache flush, abort.

Field names and response shapes follow SGLang's server so `sglang.RuntimeEndpoint` and
scripts written for SGLang work unchanged: `/generate` takes `text` or `input_ids` (one or
a batch), `sampling_params`, `stream`, `return_logprob`, `logprob_start_len`,
`top_logprobs_num`, `return_text_in_logprobs`, `rid`, and answers `{text, output_ids,
meta_info}` (a list for batches or n > 1). Streams are SSE frames with the cumulative
text so far, ending with `data: [DONE]`. Unknown top-level SGLang fields are accepted and
ignored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from sgl.server.access_log import note_usage
from sgl.server.engine_client import (EngineClient, GenInput, abort_chunk_error, client_of, new_rid, split_n,
                                     sse_response, tagged_chunks)
from sgl.server.errors import APIError, bad_request, error_body
from sgl.server.pd import bootstraps
from sgl.server.sse import DONE, sse

MAX_BATCH = 256
_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs")


class GenerateRequest(BaseModel):
    """SGLang's GenerateReqInput, minus multimodal and LoRA fields (accepted, ignored)."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = Field(None, description="Prompt, or a batch of prompts")
    input_ids: list[int] | list[list[int]] | None = Field(None, description="Token ids instead of text")
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    # PD disaggregation (sgl/server/pd.py): what a PD router adds; ignored when colocated.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    rid: str = ""
    abort_all: bool = False


def register(app: FastAPI) -> None:
    """SGLang's native routes (the aliases without `get_` stay out of the OpenAPI schema)."""
    app.add_api_route("/generate", generate, methods=["POST"])
    app.add_api_route("/get_model_info", get_model_info, methods=["GET"])
    app.add_api_route("/model_info", get_model_info, methods=["GET"], include_in_schema=False)
    app.add_api_route("/get_server_info", get_server_info, methods=["GET"])
    app.add_api_route("/server_info", get_server_info, methods=["GET"], include_in_schema=False)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/health_generate", health_generate, methods=["GET"])
    app.add_api_route("/flush_cache", flush_cache, methods=["POST"])
    app.add_api_route("/flush_cache", flush_cache, methods=["GET"], include_in_schema=False)
    app.add_api_route("/abort_request", abort_request, methods=["POST"])
    app.add_api_route("/clear_hicache_storage_backend", clear_hicache_storage_backend, methods=["GET", "POST"])


def _per_item(value: Any, n: int, name: str, default: Any) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise bad_request(f"{name} has {len(value)} entries but the batch has {n} prompts", name)
        return [default if v is None else v for v in value]
    return [default if value is None else value] * n


_UNSUPPORTED_FIELDS = ("image_data", "video_data", "audio_data", "lora_path", "session_params")


def _build_inputs(req: GenerateRequest, client: EngineClient) -> tuple[list[GenInput], bool, int]:
    """Validate and expand a /generate body into engine inputs; returns (gens, is_batch, n)."""
    for name in _UNSUPPORTED_FIELDS:
        value = (req.model_extra or {}).get(name)
        if value and (not isinstance(value, list) or any(v is not None for v in value)):
            raise bad_request(f"{name} is not supported by this server (text-only, no LoRA)", name)
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", "text")
    if req.text is not None:
        is_batch = isinstance(req.text, list)
        texts: list[str | None] = list(req.text) if is_batch else [req.text]  # type: ignore[arg-type]
        ids_list: list[list[int] | None] = [None] * len(texts)
    else:
        ids = req.input_ids or []
        is_batch = bool(ids) and isinstance(ids[0], list)
        ids_list = list(ids) if is_batch else [ids]  # type: ignore[list-item]
        texts = [None] * len(ids_list)
    n_prompts = len(texts)
    if n_prompts == 0:
        raise bad_request("the batch is empty", "text" if req.text is not None else "input_ids")
    if n_prompts > MAX_BATCH:
        raise bad_request(f"batch of {n_prompts} prompts exceeds the limit of {MAX_BATCH}", "text")
    sps = _per_item(req.sampling_params, n_prompts, "sampling_params", {})
    want_lp = _per_item(req.return_logprob, n_prompts, "return_logprob", False)
    starts = _per_item(req.logprob_start_len, n_prompts, "logprob_start_len", None)
    tops = _per_item(req.top_logprobs_num, n_prompts, "top_logprobs_num", None)
    rids = _per_item(req.rid, n_prompts, "rid", None)
    gens: list[GenInput] = []
    n_each = 1
    for i in range(n_prompts):
        suffix = f"[{i}]" if is_batch else ""
        sp = client.clean_sampling(sps[i], "sampling_params" + suffix)
        n_each = int(sp.get("n", 1))
        if texts[i] is not None:
            if not texts[i]:
                raise bad_request("text" + suffix + " is empty", "text")
            num = client.count_tokens(texts[i])  # type: ignore[arg-type]
            pparam = "text"
        else:
            client.check_ids(ids_list[i], "input_ids" + suffix)
            num = len(ids_list[i])  # type: ignore[arg-type]
            pparam = "input_ids"
        client.check_budget(num, int(sp.get("max_new_tokens", 128)), prompt_param=pparam,
                            max_param="sampling_params.max_new_tokens")
        start, top = starts[i], tops[i]
        if start is not None:
            if start < -1:
                raise bad_request(f"logprob_start_len must be >= -1, got {start}", "logprob_start_len")
            start = min(start, max(num - 1, 0))
        if top is not None and not 0 <= top <= 64:
            raise bad_request(f"top_logprobs_num must be in [0, 64], got {top}", "top_logprobs_num")
        gens.append(GenInput(texts[i], ids_list[i], sp, rids[i] or new_rid(), bool(want_lp[i]), start, top, num))
    if len(set(g.rid for g in gens)) != len(gens):
        raise bad_request("rid values must be unique", "rid")
    if len({int(g.sampling.get("n", 1)) for g in gens}) > 1 and req.bootstrap_room is not None:
        raise bad_request("a PD request (bootstrap_room) needs the same n for every prompt", "sampling_params")
    rooms = bootstraps(client.engine, req.bootstrap_host, req.bootstrap_port, req.bootstrap_room, n_prompts, n_each)
    for g, samples in zip(gens, rooms or []):
        g.bootstrap = samples
    return gens, is_batch, n_each


def format_logprob_list(client: EngineClient, entries: Any, with_text: bool) -> list[Any] | None:
    if entries is None:
        return None
    out = []
    for e in entries:
        lp, tid = e[0], int(e[1])
        text = e[2] if len(e) > 2 else None
        if with_text and text is None:
            text = client.token_text(tid)
        out.append([lp, tid, text if with_text else None])
    return out


def shape_meta(client: EngineClient, meta: dict[str, Any], g: GenInput, with_text: bool,
               t0: float) -> dict[str, Any]:
    meta = dict(meta)
    meta.setdefault("id", g.rid)
    meta["e2e_latency"] = round(time.perf_counter() - t0, 6)
    if not g.return_logprob:
        for k in _LOGPROB_KEYS:
            meta.pop(k, None)
        return meta
    for k in ("input_token_logprobs", "output_token_logprobs"):
        meta[k] = format_logprob_list(client, meta.get(k), with_text)
    for k in ("input_top_logprobs", "output_top_logprobs"):
        if meta.get(k) is not None:
            meta[k] = [format_logprob_list(client, row, with_text) if row else row for row in meta[k]]
    return meta


def shape_result(client: EngineClient, out: dict[str, Any], g: GenInput, with_text: bool, t0: float) -> dict[str, Any]:
    return {"text": out.get("text", ""), "output_ids": list(out.get("output_ids") or []),
            "meta_info": shape_meta(client, out.get("meta_info") or {}, g, with_text, t0)}


async def generate(req: GenerateRequest, request: Request) -> Response:
    client = client_of(request)
    gens, is_batch, n_each = _build_inputs(req, client)
    with_text = req.return_text_in_logprobs
    t0 = time.perf_counter()
    if req.stream:
        return await _stream_generate(request, client, gens, is_batch or n_each > 1, with_text, t0)
    outs = await client.generate(request, gens)
    results: list[dict[str, Any]] = []
    for g, out in zip(gens, outs):
        for o in out if isinstance(out, list) else [out]:
            shaped = shape_result(client, o, g, with_text, t0)
            note_usage(request, shaped["meta_info"])
            results.append(shaped)
    if not is_batch and len(results) == 1:
        return JSONResponse(results[0])
    return JSONResponse(results)


async def _stream_generate(request: Request, client: EngineClient, gens: list[GenInput], tagged: bool,
                           with_text: bool, t0: float) -> Response:
    subs = [s for g in gens for s in split_n(g)]
    handles = await client.open_streams(request, subs)

    async def frames() -> AsyncIterator[bytes]:
        try:
            async for i, chunk in tagged_chunks(handles):
                shaped = shape_result(client, chunk, subs[i], with_text, t0)
                err = abort_chunk_error(chunk)
                if err is not None:
                    yield sse(error_body(err.message, err.type, err.param, err.status))
                    continue
                if tagged:
                    shaped["index"] = i
                if shaped["meta_info"].get("finish_reason"):
                    note_usage(request, shaped["meta_info"])
                yield sse(shaped)
        except APIError as e:
            yield sse(error_body(e.message, e.type, e.param, e.status))
        except (ValueError, TypeError) as e:
            yield sse(error_body(str(e), "invalid_request_error", None, 400))
        yield DONE

    return sse_response(frames(), handles)


async def get_model_info(request: Request) -> dict[str, Any]:
    st = request.app.state
    return {
        "model_path": st.model_path,
        "tokenizer_path": st.model_path,
        "served_model_name": st.served_model_name,
        "is_generation": True,
        "context_length": client_of(request).context_length,
        "vocab_size": client_of(request).vocab_size,
        # Not in SGLang's answer; sgl's own RuntimeEndpoint uses them to format chats.
        "chat_template": getattr(st.engine, "chat_template", None),
        "eos_token": getattr(client_of(request).tokenizer, "eos_token", None),
        "token_healing": True,  # takes the token_healing sampling parameter (sgl's own)
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


async def get_server_info(request: Request) -> dict[str, Any]:
    st = request.app.state
    info = await asyncio.to_thread(st.engine.get_server_info)
    out = {**st.server_args, **info, "version": st.version}
    if out.get("max_total_tokens") is None:
        out["max_total_tokens"] = getattr(st.engine, "max_total_tokens", info.get("kv_total_tokens"))
    return out


async def health(request: Request) -> Response:
    if request.app.state.shutting_down:
        return PlainTextResponse("shutting down", status_code=503)
    try:  # a dead scheduler makes the server unhealthy (the engine says why)
        getattr(request.app.state.engine, "check_alive", lambda: None)()
    except RuntimeError as e:
        return PlainTextResponse(str(e), status_code=503)
    return Response(status_code=200)


async def health_generate(request: Request) -> Response:
    """Healthy only if the engine can actually produce a token."""
    client = client_of(request)
    g = GenInput(None, [0], {"max_new_tokens": 1, "temperature": 0}, new_rid("health-"), num_prompt_tokens=1)
    try:
        await asyncio.wait_for(client.generate(request, [g]), timeout=60)
    except Exception as e:  # noqa: BLE001 - any failure means unhealthy
        client.abort(g.rid)
        raise APIError(f"engine failed to generate: {type(e).__name__}: {e}", 503) from None
    return Response(status_code=200)


async def flush_cache(request: Request) -> Response:
    ok = await asyncio.to_thread(request.app.state.engine.flush_cache)
    if not ok:
        raise APIError("cache not flushed: requests are still running; retry when idle", 400)
    return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                             "(When there are running or waiting requests, the operation will not be performed.)\n")


async def clear_hicache_storage_backend(request: Request) -> Any:
    """Drop the hierarchical cache's storage tier pages of this model (SGLang's route)."""
    try:
        ok = await asyncio.to_thread(request.app.state.engine.clear_hicache_storage_backend)
    except TimeoutError as e:
        raise APIError(f"{e} (a hung storage backend?); it may still finish", 504) from None
    if not ok:
        raise APIError("no storage tier: start with --enable-hierarchical-cache --hicache-storage-backend", 400)
    return "Hierarchical cache storage backend cleared."


async def abort_request(req: AbortRequest, request: Request) -> Response:
    client = client_of(request)
    if req.abort_all:
        client.abort_all()
    elif req.rid:
        client.abort(req.rid)
    else:
        raise bad_request("give rid or abort_all", "rid")
    return Response(status_code=200)
