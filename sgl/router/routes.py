"""The router's HTTP endpoints (SGLang-native, OpenAI, and sglang-router's control API).

    POST /generate, /v1/completions, /v1/chat/completions   routed by the policy, admitted by
                                                             the concurrency limit, retried
    GET  /v1/models, /get_model_info, /health_generate      from one healthy worker
    GET  /get_server_info   the first worker's info, plus "router" (options) and "workers"
                            (each worker's url, role, state and info)
    POST /flush_cache       to every worker; 200 only when all flushed
    GET  /health            200 while at least one worker is in rotation, else 503
    GET  /workers, /list_workers; POST /add_worker?url=, /remove_worker?url=
    GET  /metrics           Prometheus text (sgl_router_*)

PD mode (`--pd-disaggregation`): generation routes go to a (prefill, decode) pair (pd_proxy.py);
/health needs a prefill and a decode worker in rotation; /health_generate sends a 1-token
/generate through a pair; /get_server_info, /flush_cache and /workers cover both sets;
/add_worker takes `worker_type=prefill|decode` (and `bootstrap_port=` for a prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from sgl.router.admission import Rejected
from sgl.router.config import bootstrap_port
from sgl.router.policies.base import RouteRequest
from sgl.router.state import Router, __version__
from sgl.router.metrics import CONTENT_TYPE
from sgl.router.proxy import Forward, error_response, read_json, wait_disconnect
from sgl.router.route_input import route_request

GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def _router(request: Request) -> Router:
    return request.app.state.router  # type: ignore[no-any-return]


def _headers(router: Router, request: Request) -> tuple[dict[str, str], str | None]:
    """Headers for the worker: JSON, auth, and the client's request id (first configured header found)."""
    out = {"content-type": "application/json", **router.worker_headers}
    if not router.worker_headers and "authorization" in request.headers:
        out["authorization"] = request.headers["authorization"]  # no router key: the client's reaches the worker
    rid = None
    for name in router.cfg.request_id_headers:
        value = request.headers.get(name)
        if value:
            out[name] = value
            rid = rid or value
    if rid:
        out["x-request-id"] = rid
    return out, rid


async def _generation(request: Request, endpoint: str) -> Response:
    router = _router(request)
    t_route = endpoint
    try:
        raw, body = await read_json(request)
        headers, rid = _headers(router, request)
        route_req = route_request(endpoint, body, router.tokenizer, router.wants_token_ids, rid)
    except ValueError as e:
        router.metrics.observe(t_route, 400, 0.0)
        return error_response(400, str(e))
    try:
        if not await _admitted(router, request):
            router.metrics.observe(t_route, 499, 0.0)
            return Response(status_code=499)  # the client left while queued: nobody reads this
    except Rejected as e:
        router.metrics.observe(t_route, e.status, 0.0)
        return error_response(e.status, e.message)
    assert router.proxy is not None
    fwd = Forward("POST", endpoint, endpoint, raw, headers, stream=bool(body.get("stream")), route_req=route_req,
                  json=body if router.pd else None, on_finish=router.admission.release)
    return await router.proxy.forward_watching(fwd, request.receive,
                                               router.pd_proxy.forward if router.pd_proxy is not None else None)


async def _admitted(router: Router, request: Request) -> bool:
    """Wait for an admission slot unless the client leaves first (False: no slot is held,
    and its place in the queue went to the next one). Rejected as acquire raises it."""
    acquire = asyncio.ensure_future(router.admission.acquire())
    gone = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({acquire, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left = gone.done()
        gone.cancel()
        if not acquire.done():
            acquire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquire
    if acquire.cancelled():
        return False
    acquire.result()  # Rejected: queue full or timed out
    if left:  # the slot came as the client went: pass it on
        router.admission.release()
        return False
    return True


async def generate(request: Request) -> Response:
    return await _generation(request, "/generate")


async def completions(request: Request) -> Response:
    return await _generation(request, "/v1/completions")


async def chat_completions(request: Request) -> Response:
    return await _generation(request, "/v1/chat/completions")


async def _from_one(request: Request, path: str) -> Response:
    router = _router(request)
    assert router.proxy is not None
    headers, _ = _headers(router, request)
    query = ("?" + request.url.query) if request.url.query else ""
    return await router.proxy.forward(Forward("GET", path + query, path, None, headers))


async def models(request: Request) -> Response:
    return await _from_one(request, "/v1/models")


async def model_info(request: Request) -> Response:
    return await _from_one(request, "/get_model_info")


# PD mode's /health_generate: one token through a (prefill, decode) pair, the whole path.
_PD_PROBE_TEXT = "Hi"
_PD_PROBE: dict[str, Any] = {"text": _PD_PROBE_TEXT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


async def health_generate(request: Request) -> Response:
    router = _router(request)
    if not router.pd:
        return await _from_one(request, "/health_generate")
    assert router.pd_proxy is not None
    headers, _ = _headers(router, request)
    fwd = Forward("POST", "/generate", "/health_generate", None, headers,
                  route_req=RouteRequest("/generate", _PD_PROBE_TEXT), json=dict(_PD_PROBE))
    resp = await router.pd_proxy.forward(fwd)
    if resp.status_code != 200:
        return resp
    return PlainTextResponse("OK: a (prefill, decode) pair generated a token\n")


async def server_info(request: Request) -> Response:
    router = _router(request)
    assert router.proxy is not None
    headers, _ = _headers(router, request)
    results = await router.proxy.fan_out("GET", "/get_server_info", headers, router.fleet.all())
    infos = {url: body for url, status, body in results if status == 200 and isinstance(body, dict)}
    workers = []
    for w in router.fleet.all():
        workers.append({**w.describe(), "server_info": infos.get(w.url)})
    first = next((infos[w.url] for w in router.fleet.all() if w.url in infos), {})
    out = {**first, "router": {"version": __version__, "policy": router.policy.name, "config": router.cfg.public(),
                               "mode": "pd" if router.pd else "regular", "policies": _policies(router),
                               "chat_routing": "template" if router.tokenizer is not None else "contents"},
           "workers": workers}
    return JSONResponse(out)


def _policies(router: Router) -> dict[str, str]:
    return {r.role: r.policy.name for r in router.fleet.sets}


async def flush_cache(request: Request) -> Response:
    router = _router(request)
    assert router.proxy is not None
    headers, _ = _headers(router, request)
    results = await router.proxy.fan_out("POST", "/flush_cache", headers, router.fleet.all())
    failed = [{"url": u, "status": s, "detail": b} for u, s, b in results if s != 200]
    if not results:
        return error_response(503, "no workers registered")
    if failed:
        return JSONResponse({"flushed": len(results) - len(failed), "failed": failed}, status_code=500)
    return PlainTextResponse(f"Cache flushed on {len(results)} worker(s).\n")


async def health(request: Request) -> Response:
    router = _router(request)
    by_role = router.fleet.available_by_role()
    n = sum(by_role.values())
    if not router.pd:
        if n == 0:
            return JSONResponse({"status": "unavailable", "healthy_workers": 0,
                                 "message": "no healthy workers"}, status_code=503)
        return JSONResponse({"status": "ok", "healthy_workers": n})
    out = {"healthy_workers": n, "healthy_prefill": by_role["prefill"], "healthy_decode": by_role["decode"]}
    missing = [role for role, k in by_role.items() if k == 0]
    if missing:  # a pair needs both: sglang-router's /health said OK with only decode up (its #33740)
        return JSONResponse({"status": "unavailable", **out,
                             "message": f"no healthy {' or '.join(missing)} workers"}, status_code=503)
    return JSONResponse({"status": "ok", **out})


async def workers(request: Request) -> Response:
    router = _router(request)
    ws = [w.describe() for w in router.fleet.all()]
    out = {"workers": ws, "healthy": [w["url"] for w in ws if w["healthy"]], "policy": router.policy.name}
    if router.pd:
        out["policies"] = _policies(router)
    return JSONResponse(out)


async def list_workers(request: Request) -> Response:
    return JSONResponse({"urls": [w.url for w in _router(request).fleet.all()]})


def _url_param(request: Request) -> str | None:
    url = request.query_params.get("url")
    return url if url and url.startswith(("http://", "https://")) else None


async def add_worker(request: Request) -> Response:
    router = _router(request)
    url = _url_param(request)
    if url is None:
        return error_response(400, "query parameter url must be a worker URL (http://host:port)", param="url")
    if router.fleet.get(url.rstrip("/")) is not None:
        return error_response(400, f"worker {url} is already registered", param="url")
    role = request.query_params.get("worker_type") or "worker"
    if role == "regular":
        role = "worker"
    try:
        port = bootstrap_port(request.query_params.get("bootstrap_port"), "bootstrap_port")
        if port is not None and role != "prefill":
            raise ValueError("bootstrap_port is for a prefill worker (worker_type=prefill)")
        w, err = await router.add_worker(url, role, port)
    except ValueError as e:
        param = "bootstrap_port" if "bootstrap_port" in str(e) else "worker_type"
        return error_response(400, str(e), param=param)
    if w is None:
        return error_response(503, f"worker {url} did not pass a health check within "
                                   f"{router.cfg.worker_startup_timeout_secs:g}s: {err}", param="url")
    return PlainTextResponse(f"Successfully added worker: {w.url}\n")


async def remove_worker(request: Request) -> Response:
    router = _router(request)
    url = _url_param(request)
    if url is None:
        return error_response(400, "query parameter url must be a worker URL (http://host:port)", param="url")
    w = router.remove_worker(url)
    if w is None:
        return error_response(404, f"worker {url} is not registered", param="url")
    return PlainTextResponse(f"Successfully removed worker: {w.url}\n")


async def metrics(request: Request) -> Response:
    return Response(_router(request).metrics.render(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "error")
    if status == 404:
        detail = f"no route {request.url.path} on the router"
    elif status == 405:
        detail = f"method {request.method} not allowed on {request.url.path}"
    return error_response(status, str(detail))


EXCEPTION_HANDLERS: dict[Any, Any] = {404: _http_error, 405: _http_error}

_POST: dict[str, Any] = {"/generate": generate, "/v1/completions": completions,
                         "/v1/chat/completions": chat_completions, "/flush_cache": flush_cache,
                         "/add_worker": add_worker, "/remove_worker": remove_worker}
_GET: dict[str, Any] = {"/v1/models": models, "/get_model_info": model_info, "/health_generate": health_generate,
                        "/get_server_info": server_info, "/health": health, "/workers": workers,
                        "/list_workers": list_workers, "/metrics": metrics}
ROUTES = ([Route(p, fn, methods=["POST"]) for p, fn in _POST.items()]
          + [Route(p, fn, methods=["GET"]) for p, fn in _GET.items()])
