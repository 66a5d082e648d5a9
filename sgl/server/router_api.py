"""What a router in front of this server reads: the current load and the tokenizer.

`GET /get_load` answers in SGLang's shape, a JSON list with one object per data-parallel
rank (this server has one), which sglang-router's `power_of_two` policy parses (it sums
`num_tokens` over the list), plus our finer fields for a router that weighs prefill
against load. `GET /get_tokenizer` exports the engine's tokenizer and chat template, so a
router that must not import the runtime tokenizes and renders chats exactly as the engine
does. The load is read from the scheduler at call time (one control call, no O(tokens)
work); the tokenizer answer is built once and kept.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from sgl.server.errors import APIError


def register(app: FastAPI) -> None:
    app.add_api_route("/get_load", get_load, methods=["GET"])
    app.add_api_route("/get_tokenizer", get_tokenizer, methods=["GET"])


def _int(info: dict[str, Any], key: str) -> int:
    v = info.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def load_entry(info: dict[str, Any]) -> dict[str, int]:
    """One rank's load from the engine's server info (the scheduler's snapshot).

    SGLang's fields: `dp_rank`; `num_reqs` (running + waiting); `num_waiting_reqs`;
    `num_tokens` = KV slots held by requests (used minus the evictable prefix cache) plus
    the tokens waiting requests will prefill, SGLang's definition. Ours:
    `num_running_reqs`; `num_running_tokens` (context of admitted requests: prompt +
    output so far); `num_waiting_tokens` (tokens waiting requests will prefill: prompt,
    plus output so far if retracted); `num_pending_prefill_tokens` (the prefill work queued:
    what the prefix cache does not cover of waiting requests, plus the unprefilled rest of
    admitted ones; what a KV-aware router weighs); `kv_total_tokens`, `kv_used_tokens` (allocated,
    including the evictable cache), `kv_evictable_tokens`.
    """
    running, waiting = _int(info, "num_running_reqs"), _int(info, "num_waiting_reqs")
    used, evictable = _int(info, "kv_used_tokens"), _int(info, "kv_evictable_tokens")
    waiting_tokens = _int(info, "num_waiting_tokens")
    return {
        "dp_rank": 0,
        "num_reqs": running + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": max(used - evictable, 0) + waiting_tokens,
        "num_running_reqs": running,
        "num_running_tokens": _int(info, "num_running_tokens"),
        "num_waiting_tokens": waiting_tokens,
        "num_pending_prefill_tokens": _int(info, "num_pending_prefill_tokens"),
        "kv_total_tokens": _int(info, "kv_total_tokens"),
        "kv_used_tokens": used,
        "kv_evictable_tokens": evictable,
    }


async def get_load(request: Request) -> list[dict[str, int]]:
    """`[{"dp_rank": 0, "num_reqs": int, "num_waiting_reqs": int, "num_tokens": int,
    "num_running_reqs": int, "num_running_tokens": int, "num_waiting_tokens": int,
    "num_pending_prefill_tokens": int, "kv_total_tokens": int, "kv_used_tokens": int, "kv_evictable_tokens": int}]`
    (a list, one entry per data-parallel rank; readers sum fields over it). Field
    meanings: `load_entry`."""
    st = request.app.state
    info = await asyncio.to_thread(st.engine.get_server_info)
    st.metrics.note_engine_state(info)  # a reading for the recent-rate gauges too
    return [load_entry(info)]


async def get_tokenizer(request: Request) -> Response:
    """`{"tokenizer_json": str, "chat_template": str | null, "bos_token": str | null,
    "eos_token": str | null}`.

    `tokenizers.Tokenizer.from_str(tokenizer_json).encode(text).ids` equals the engine's
    token ids for `text` (special tokens included as the engine adds them). Rendering
    `chat_template` as transformers does — a jinja2 sandboxed environment with
    trim_blocks and lstrip_blocks, a `raise_exception(message)` global, variables
    `messages`, `add_generation_prompt`, `bos_token`, `eos_token` (and `tools` when
    given) — equals the prompt the engine builds for /v1/chat/completions. (A template
    that calls transformers' extras, `strftime_now()` or `tojson(indent=...)`, needs
    them too; SmolLM2's does not.)
    """
    st = request.app.state
    body = getattr(st, "tokenizer_answer", None)
    if body is None:
        answer = await asyncio.to_thread(tokenizer_answer, st.engine)
        body = st.tokenizer_answer = json.dumps(answer, ensure_ascii=False).encode()
    return Response(body, media_type="application/json")


def tokenizer_answer(engine: Any) -> dict[str, Any]:
    tok = getattr(engine, "tokenizer", None)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise APIError("this engine's tokenizer cannot be exported (it is not a fast tokenizer)", 501)
    template = getattr(engine, "chat_template", None)
    if isinstance(template, dict):  # named templates: the one used for chats is "default"
        template = template.get("default")
    return {"tokenizer_json": backend.to_str(), "chat_template": template if isinstance(template, str) else None,
            "bos_token": getattr(tok, "bos_token", None), "eos_token": getattr(tok, "eos_token", None)}

