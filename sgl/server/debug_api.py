"""POST /debug/worker_call: run one of the worker's named control calls over HTTP, for
tests of a real server process (prove that no KV slot leaked after a fault; inject a
fault). Served only with --enable-debug-calls (SGL_ENABLE_DEBUG_CALLS=1), never by
default: a fault call breaks the server on purpose.

Body `{"name": str, "args": [...]}`, name one of ALLOWED; answers `{"value": ...}`, or
400 naming `name`, or 500 with the worker's error (a failed invariant check says which).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from sgl.server.errors import APIError, bad_request

ALLOWED = ("check_invariants", "inject_fault", "clear_fault", "pd_fault", "flush_cache")


class WorkerCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    args: list[Any] = []


def register(app: FastAPI) -> None:
    app.add_api_route("/debug/worker_call", worker_call, methods=["POST"], include_in_schema=False)


async def worker_call(body: WorkerCall, request: Request) -> dict[str, Any]:
    if body.name not in ALLOWED:
        raise bad_request(f"name must be one of {', '.join(ALLOWED)}", "name")
    engine = request.app.state.engine
    try:
        value = await asyncio.to_thread(engine.worker_call, body.name, *body.args)
    except Exception as e:  # noqa: BLE001 - reported to the test that asked
        raise APIError(f"{body.name} failed: {type(e).__name__}: {e}", 500) from None
    return {"value": value}
