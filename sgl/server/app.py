"""Builds the FastAPI app around an engine: routes, error handlers, middleware, lifecycle.

`create_app(engine, ...)` is the only entry point; it owns no globals (state lives on
`app.state`, metrics in a registry per app). On shutdown, requests still in flight after
uvicorn's grace period are aborted in the engine before the engine itself shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl.runtime.config import settings
from sgl.server import debug_api, native_api, openai_api, openai_chat, openai_completions, router_api
from sgl.server.access_log import AccessLogMiddleware
from sgl.server.auth import ApiKeyMiddleware
from sgl.server.engine_client import EngineClient
from sgl.server.errors import APIError, error_response, install_error_handlers
from sgl.server.metrics import CONTENT_TYPE, Metrics
from sgl.server.model_name import accepted_names, served_name_for

logger = logging.getLogger("sgl.server")

__version__ = "0.1.0"

# Far above any prompt that fits a context window; stops memory blow-ups from huge bodies.
MAX_BODY_BYTES = 32 * 1024 * 1024


def create_app(engine: Any, *, served_model_name: str | None = None, api_key: str | None = None,
               server_args: dict[str, Any] | None = None, shutdown_engine: bool = True) -> FastAPI:
    """A ready-to-serve app for `engine` (an `sgl.runtime.engine.Engine` or lookalike)."""
    model_path = str(getattr(engine, "model_path", None) or "default")
    served = served_model_name or served_name_for(model_path)
    metrics = Metrics(model_name=served)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        app.state.shutting_down = True
        n = app.state.client.abort_all()
        if n:
            logger.info("aborted %d in-flight request(s) at shutdown", n)
        if shutdown_engine:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="sgl", version=__version__, lifespan=lifespan,
                  description="SGLang-compatible structured-generation server (native and OpenAI APIs)")
    app.state.engine = engine
    app.state.client = EngineClient(engine, metrics)
    app.state.metrics = metrics
    app.state.model_path = model_path
    app.state.served_model_name = served
    app.state.model_aliases = accepted_names(served, model_path)
    app.state.created = int(time.time())
    app.state.version = __version__
    app.state.shutting_down = False
    app.state.server_args = dict(server_args or {}, model_path=model_path, served_model_name=served)

    install_error_handlers(app)
    for api in (native_api, router_api, openai_api, openai_completions, openai_chat):
        api.register(app)
    if settings().enable_debug_calls:
        debug_api.register(app)

    @app.get("/metrics", include_in_schema=False)
    async def metrics_endpoint(request: Request) -> Response:
        try:
            info = await asyncio.to_thread(engine.get_server_info)
        except Exception:  # still expose request metrics if the engine cannot answer
            logger.warning("get_server_info failed during /metrics", exc_info=True)
            info = None
        return Response(metrics.render(info), media_type=CONTENT_TYPE)

    app.add_middleware(_JsonBodyMiddleware)
    # Added last = outermost: the access log sees auth failures too.
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(AccessLogMiddleware, metrics=metrics,
                       paths=frozenset(p for r in app.routes if isinstance(p := getattr(r, "path", None), str)))
    return app


class _JsonBodyMiddleware:
    """Treat POST bodies as JSON whatever their content type (`curl -d` sends a form type).

    Every POST endpoint here takes JSON, as SGLang's do; without this, a form content type
    makes the body fail validation with a confusing message.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            length = dict(scope.get("headers") or []).get(b"content-length", b"0")
            if length.isdigit() and int(length) > MAX_BODY_BYTES:
                await error_response(APIError(f"request body of {int(length)} bytes exceeds the limit of "
                                              f"{MAX_BODY_BYTES} bytes", 413))(scope, receive, send)
                return
            headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            ctype = dict(scope.get("headers") or []).get(b"content-type", b"")
            if b"json" not in ctype:
                scope = dict(scope, headers=headers + [(b"content-type", b"application/json")])
            receive = _bounded(receive)  # a chunked body has no Content-Length to check up front
        await self.app(scope, receive, send)


def _bounded(receive: Any) -> Any:
    """`receive` that raises a 413 once the body passes MAX_BODY_BYTES (an HTTPException:
    FastAPI's body parsing passes those through, and turns anything else into a 400)."""
    seen = 0

    async def wrapped() -> Any:
        nonlocal seen
        message = await receive()
        if message.get("type") == "http.request":
            seen += len(message.get("body", b""))
            if seen > MAX_BODY_BYTES:
                raise StarletteHTTPException(413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes")
        return message

    return wrapped
