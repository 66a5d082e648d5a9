"""Per-request observation: one structured (JSON) log line and HTTP metrics per request.

A pure ASGI middleware (not `BaseHTTPMiddleware`, which would buffer streams and hide
disconnects). Handlers add token usage with `note_usage`; the line is written when the
response, streamed or not, has ended.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sgl.server.metrics import Metrics

access_logger = logging.getLogger("sgl.server.access")

_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")


def note_usage(request: Any, meta: dict[str, Any]) -> None:
    """Add one generation's token counts (from meta_info) to the request's log line."""
    usage = request.scope.setdefault("state", {}).setdefault("sgl_usage", dict.fromkeys(_USAGE_KEYS, 0))
    for k in _USAGE_KEYS:
        v = meta.get(k)
        if isinstance(v, int):
            usage[k] += v


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics, paths: frozenset[str] = frozenset()) -> None:
        """`paths`: the app's route paths, to label requests refused before routing (401)."""
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0
        request_id = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            status = status or 500
            raise
        finally:
            self.metrics.in_flight.dec()
            # 499 (nginx's "client closed request") when no response ever started.
            status = status or 499
            # Label by route template; any other path (a 404, a 401 before routing) shares
            # one label, so scanners cannot blow up the metric's cardinality.
            path_label = getattr(scope.get("route"), "path", None)
            if path_label is None:
                path_label = scope.get("path") if scope.get("path") in self.paths else "unmatched"
            self.metrics.observe_http(path_label, status)
            line = {
                "ts": round(time.time(), 3),
                "request_id": request_id,
                "method": scope.get("method"),
                "path": scope.get("path"),
                "status": status,
                "duration_ms": round((time.perf_counter() - t0) * 1000, 2),
                "client": (scope.get("client") or [None])[0],
            }
            line.update(scope["state"].get("sgl_usage") or {})
            access_logger.info(json.dumps(line, separators=(",", ":")))
