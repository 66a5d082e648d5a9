"""`create_app(config)`: the router's ASGI app (Starlette, FastAPI's core) around one
`Router` (state.py), with the routes of routes.py and the optional API-key guard
(`sgl/http_auth.py`, the same as the server's).

Plain Starlette: bodies are forwarded raw, so there is nothing to validate, and skipping
FastAPI's per-request dependency machinery keeps the router's overhead low.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette

from sgl.http_auth import ApiKeyMiddleware
from sgl.router import routes
from sgl.router.config import RouterConfig
from sgl.router.policies.base import Policy
from sgl.router.state import Router


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
