"""`create_app(config)`: the router's ASGI app (Starlette, FastAPI's core) around one
`Router` (state.py), with the routes of routes.py and the optional API-key guard.

Plain Starlette: bodies are forwarded raw, so there is nothing to validate, and skipping
FastAPI's per-request dependency machinery keeps the router's overhead low.
"""

from __future__ import annotations

import contextlib
import hmac
import json
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from sgl.router import routes
from sgl.router.config import RouterConfig
from sgl.router.policies.base import Policy
from sgl.router.proxy import error_body
from sgl.router.state import Router


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every path but /health (constant-time compare)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") != "/health":
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(token, self.key):
                body = json.dumps(error_body("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                             "authentication_error", "invalid_api_key")).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def create_app(cfg: RouterConfig, policy: Policy | None = None) -> Starlette:
    """A ready-to-serve router app for `cfg` (its policy made from `cfg.policy` unless given)."""
    router = Router(cfg, policy)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = Starlette(routes=routes.ROUTES, lifespan=lifespan, exception_handlers=routes.EXCEPTION_HANDLERS)
    app.state.router = router
    if cfg.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=cfg.api_key)
    return app
