"""Optional API-key guard shared by the server and the router: `Authorization: Bearer <key>`
(or `X-API-Key: <key>`) on every path except /health.

Pure ASGI so it also guards streams without buffering them. The comparison is
constant-time; a missing or wrong key gets a 401 in OpenAI's error shape. It imports
nothing of sgl, so both the server and the router (which never imports the server) use it.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})

_BODY = json.dumps({"error": {"message": "invalid or missing API key (send 'Authorization: Bearer <key>')",
                              "type": "authentication_error", "param": None, "code": "invalid_api_key"}}).encode()


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(token, self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_BODY)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _BODY})
