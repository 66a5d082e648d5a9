"""The server's API-key guard: the one in `sgl/http_auth.py`, shared with the router."""

from __future__ import annotations

from sgl.http_auth import OPEN_PATHS, ApiKeyMiddleware

__all__ = ["OPEN_PATHS", "ApiKeyMiddleware"]
