"""Error vocabulary of the HTTP server: one exception type and the handlers that render it.

Every failure a client sees uses OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`, on the native endpoints too (SGLang's own client only reads `error.message`).
Request-body problems (malformed JSON, wrong types, out-of-range values) become 400s whose
message names the offending field, so a client can fix the request; only genuine server
bugs become 500s, and they never take the process down. A dead engine scheduler is a
503 naming its cause (and /health fails), since no request can succeed until a restart.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sgl.runtime.engine import SchedulerCrashedError

logger = logging.getLogger("sgl.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A failure with an HTTP status and a message meant for the client."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ClientDisconnected(Exception):
    """The client went away before the answer was ready; the request was aborted."""


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code if err.code is not None else err.status),
                        status_code=err.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param=param)


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str:
    # ("body", "messages", 0, "role") -> "messages[0].role"; the "body" prefix helps nobody.
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out


def validation_error(exc: RequestValidationError) -> APIError:
    """Turn pydantic's list of problems into one 400 naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return bad_request(f"request body is not valid JSON: {ctx.get('error', first.get('msg'))}")
    param = _loc_to_param(first.get("loc", ()))
    msgs = []
    for e in errors[:3]:
        p = _loc_to_param(e.get("loc", ()))
        msgs.append(f"{p or 'body'}: {e.get('msg')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return bad_request("invalid request: " + "; ".join(msgs) + more, param=param or None)


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers so that every error leaves in the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(APIError(detail, exc.status_code))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        # nobody reads this: 499 (nginx's "client closed request") keeps it out of the 500s
        return Response(status_code=499)

    @app.exception_handler(SchedulerCrashedError)
    async def _crashed(request: Request, exc: SchedulerCrashedError) -> JSONResponse:
        return error_response(APIError(str(exc), 503))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(f"internal server error: {type(exc).__name__}: {exc}", 500,
                                       type="server_error"))
