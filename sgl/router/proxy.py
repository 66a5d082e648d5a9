"""Forwarding one request to a worker: choice, retries, failure accounting, passthrough.

    pick a candidate (policy for generation routes, least in-flight for the rest)
      └─ send; the worker's answer head arrives
           ├─ connection error / error before the head / retryable status (408, 429, 5xx)
           │     -> count the failure (circuit, health probe), back off, retry on another worker
           ├─ non-streaming: read the body (an error while reading is retried too), send it
           └─ streaming 200: wait for the first chunk (an error before it is retried too), then
                 bytes reach the client, so no more retries; chunks are
                 forwarded as they arrive; if the worker dies mid-stream the client gets an SSE
                 error event and `data: [DONE]`, and the response ends

The request body is forwarded byte for byte (it was parsed only to route it). Every wait
is bounded: connect and each read by `--request-timeout-secs`, the queue by its timeout.
A client that goes away closes the upstream connection, which aborts the worker's request.

The hot path uses aiohttp's client: measured here, interleaved on one keep-alive
connection to the same worker, an httpx.AsyncClient call cost ~1.9 ms more than an aiohttp
call (p50 4.1 vs 2.2 ms on a busy 2-core host), which alone would eat the router's 2 ms
budget. Control calls (health checks, fan-out, tokenizer) keep httpx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from sgl.router.metrics import RouterMetrics
from sgl.router.policies.base import Policy, RouteRequest
from sgl.router.registry import Registry, Worker
from sgl.router.retry import RetryOptions, retryable_status

logger = logging.getLogger("sgl.router")

DONE = b"data: [DONE]\n\n"
OK, FAILED, CLIENT_CLOSED = 200, 502, 499  # how a stream ended (also its metrics status)
# Hop-by-hop, plus the ones our own server (uvicorn) sets, so they are not doubled.
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"})


def error_body(message: str, type: str, code: int | str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, as the workers answer it (sgl/server/errors.py)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                   408: "timeout_error", 429: "rate_limit_error", 503: "service_unavailable"}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(message, kind, status, param), status_code=status)


def sse_error(message: str) -> bytes:
    return b"data: " + json.dumps(error_body(message, "server_error", 502), separators=(",", ":")).encode() + b"\n\n"


@dataclass
class Forward:
    """One request to forward."""

    method: str
    path: str  # worker path, with the query string
    route: str  # metrics label
    body: bytes | None
    headers: dict[str, str]
    stream: bool = False
    route_req: RouteRequest | None = None  # set for generation routes: the policy chooses
    json: dict[str, Any] | None = None  # the parsed body (PD mode adds the bootstrap fields to it)
    on_finish: Callable[[], None] | None = None  # runs once, when the answer has fully left


class NoWorkers(Exception):
    pass


class Proxy:
    def __init__(self, registry: Registry, policy: Policy, session: aiohttp.ClientSession,
                 client: httpx.AsyncClient, retry: RetryOptions, metrics: RouterMetrics,
                 on_connect_error: Callable[[str], None], timeout: float) -> None:
        self.registry = registry
        self.policy = policy
        self.session = session  # the request path
        self.client = client  # fan-out control calls
        self.retry = retry
        self.metrics = metrics
        self.on_connect_error = on_connect_error
        self.timeout = timeout

    def _choose(self, fwd: Forward, tried: list[str]) -> Worker:
        return self.pick(self.registry, self.policy, fwd.route_req, tried)

    def pick(self, registry: Registry, policy: Policy, route_req: RouteRequest | None, tried: list[str]) -> Worker:
        """A worker of `registry` for the request (its `policy` decides when `route_req` is
        given, else the least loaded), preferring those not in `tried`; NoWorkers if none."""
        cands = registry.candidates(exclude=tried)
        if not cands:
            n = len(registry.all())
            what = "" if registry.role == "worker" else f" {registry.role}"
            raise NoWorkers(f"no{what} workers registered" if n == 0 else
                            f"none of the {n}{what} worker(s) is healthy (health checks or circuit breaker)")
        least_loaded = min(cands, key=lambda w: w.state.in_flight)
        if route_req is None:
            return least_loaded
        # Asked even with one candidate: a policy's trees, pending pages and counts follow what
        # it routed, and on_done is called for every attempt.
        try:
            chosen = policy.select(route_req, [w.state for w in cands])
        except Exception:  # a policy bug must not fail the request
            logger.exception("policy %s failed to select; routing to the least-loaded worker", policy.name)
            return least_loaded
        w = registry.get(chosen.url)
        return w if w is not None and w in cands else least_loaded

    def _done(self, fwd: Forward, w: Worker, ok: bool | None, error: str | None = None) -> None:
        self.settle(fwd.route_req, self.policy, w, ok, error)

    def settle(self, route_req: RouteRequest | None, policy: Policy, w: Worker, ok: bool | None,
               error: str | None = None) -> None:
        """Settle one attempt on `w`; ok None: abandoned by the client (no verdict on the worker)."""
        w.state.in_flight -= 1
        w.requests_total += 1
        if ok is not None:
            w.circuit.record(ok)
        else:
            w.circuit.abandon()
        if ok is False:
            w.failures_total += 1
            w.last_error = error or w.last_error
        self.metrics.worker_requests.labels(w.url, {True: "ok", False: "error", None: "abandoned"}[ok]).inc()
        if route_req is not None:
            try:
                policy.on_done(route_req, w.state, ok is not False)
            except Exception:  # a policy bug must not fail the request
                logger.exception("policy.on_done failed")

    async def forward(self, fwd: Forward) -> Response:
        """The worker's answer as a response; never raises for worker trouble. Cancelling it
        (the client left) closes the upstream connection, which aborts the worker's request."""
        tried: list[str] = []

        async def attempt(t0: float, final: bool) -> Response | str:
            w = self._choose(fwd, tried)
            tried.append(w.url)
            out = await self._attempt(fwd, w, t0, final=final)
            return f"{w.url}: {out}" if isinstance(out, str) else out

        return await self.with_retries(fwd, attempt)

    async def with_retries(self, fwd: Forward,
                           attempt: Callable[[float, bool], Awaitable[Response | str]]) -> Response:
        """The retry policy, for one worker or a PD pair: `attempt(t0, final)` returns the
        answer or why to try again (its failures already counted); up to the configured
        attempts with back-off; NoWorkers ends with 503. A `Passthrough` (a stream) settles
        the request when it ends, anything else here."""
        t0 = time.perf_counter()
        last = "no attempt"
        done = 0
        finish_here = True
        try:
            for i in range(self.retry.max_attempts):
                if i:
                    self.metrics.retries.labels(fwd.route).inc()
                    await asyncio.sleep(self.retry.delay_secs(i))
                try:
                    out = await attempt(t0, i + 1 == self.retry.max_attempts)
                except NoWorkers as e:
                    msg = f"{e}; last error: {last}" if done else str(e)
                    return self.final_answer(fwd, t0, error_response(503, msg))
                done += 1
                if isinstance(out, str):
                    last = out
                    continue
                if isinstance(out, Passthrough):
                    finish_here = False  # the stream calls on_finish when it ends
                    return out
                return self.final_answer(fwd, t0, out)
            return self.final_answer(fwd, t0, error_response(502, f"all {done} attempt(s) failed; last: {last}"))
        finally:
            if finish_here and fwd.on_finish is not None:
                fwd.on_finish()

    async def forward_watching(self, fwd: Forward, receive: Receive,
                               forward: Callable[[Forward], Awaitable[Response]] | None = None) -> Response:
        """`forward` (default: this proxy's), cancelled if the client disconnects while waiting
        for the answer (or, for a stream, for its first chunk: the prefill); once a stream
        flows, `Passthrough` watches."""
        task = asyncio.ensure_future((forward or self.forward)(fwd))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self.metrics.observe(fwd.route, CLIENT_CLOSED, 0.0)
        if task.cancelled():
            return Response(status_code=CLIENT_CLOSED)  # nobody reads it
        return task.result()

    async def _attempt(self, fwd: Forward, w: Worker, t0: float, final: bool) -> Response | str:
        """One try on `w`: the answer, or why to try again (the failure already counted)."""
        w.state.in_flight += 1
        w.circuit.begin()
        resp: aiohttp.ClientResponse | None = None
        settled = False
        try:
            try:
                resp = await self.session.request(fwd.method, w.url + fwd.path, data=fwd.body, headers=fwd.headers)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                settled = True
                return self._failed(fwd, w, e, "")
            if retryable_status(resp.status) and not final:
                body = await read_quietly(resp)
                settled = True
                self._done(fwd, w, resp.status < 500, f"answered {resp.status}")
                return f"answered {resp.status}: {body[:200].decode(errors='replace')}"
            try:
                if fwd.stream and resp.status == 200:
                    # A worker sends the head at once and the first frame after the prefill: wait
                    # for that frame here, so a worker that dies in between is still retried.
                    first = await resp.content.readany()
                    settled = True  # the passthrough settles it when the stream ends
                    return Passthrough(resp, fwd, first, lambda end, err: self._stream_done(fwd, w, t0, end, err))
                body = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                resp.close()
                settled = True
                return self._failed(fwd, w, e, " while reading the answer")
            resp.release()
            settled = True
            self._done(fwd, w, resp.status < 500)
            return Response(body, resp.status, answer_headers(resp, fwd))
        finally:
            if not settled:  # cancelled: the client left, which is not the worker's failure
                if resp is not None:
                    resp.close()
                self._done(fwd, w, None)

    def _failed(self, fwd: Forward, w: Worker, e: BaseException, where: str) -> str:
        msg = describe_error(e) + where
        self._done(fwd, w, False, msg)
        self.on_connect_error(w.url)  # refused, reset, closed or silent: is the worker gone? (a probe is cheap)
        logger.info("request to %s failed before its answer reached the client: %s", w.url, msg)
        return msg

    def final_answer(self, fwd: Forward, t0: float, resp: Response) -> Response:
        self.metrics.observe(fwd.route, resp.status_code, time.perf_counter() - t0)
        return resp

    def _stream_done(self, fwd: Forward, w: Worker, t0: float, end: int, error: str | None) -> None:
        self._done(fwd, w, {OK: True, FAILED: False}.get(end), error)  # a client that left: no verdict
        if end == FAILED:
            self.on_connect_error(w.url)
        self.metrics.observe(fwd.route, end, time.perf_counter() - t0)
        if fwd.on_finish is not None:
            fwd.on_finish()

    async def fan_out(self, method: str, path: str, headers: dict[str, str],
                      workers: list[Worker] | None = None) -> list[tuple[str, int, Any]]:
        """The same call to every worker (of `workers`, default the registry) at once:
        (url, status or 0, parsed body or error text)."""
        async def one(w: Worker) -> tuple[str, int, Any]:
            try:
                r = await self.client.request(method, w.url + path, headers=headers, timeout=self.timeout)
            except httpx.HTTPError as e:
                return w.url, 0, describe_error(e)
            try:
                return w.url, r.status_code, r.json()
            except ValueError:
                return w.url, r.status_code, r.text

        targets = self.registry.all() if workers is None else workers
        return list(await asyncio.gather(*(one(w) for w in targets)))


def describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def read_quietly(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return b""
    finally:
        resp.release()


def answer_headers(resp: aiohttp.ClientResponse, fwd: Forward) -> dict[str, str]:
    out = {k.lower(): v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
    rid = fwd.headers.get("x-request-id")  # the client's id wins over one the worker made up
    if rid:
        out["x-request-id"] = rid
    return out


class Passthrough(Response):
    """Streams the worker's bytes to the client as they arrive (no buffering, no parsing).

    Ends with an SSE error event + `data: [DONE]` if the worker's stream breaks, and closes
    the upstream connection (so the worker aborts) if the client leaves first.
    """

    def __init__(self, upstream: aiohttp.ClientResponse, fwd: Forward, first: bytes,
                 done: Callable[..., None]) -> None:
        self.upstream = upstream
        self.first = first
        self.done = done
        self.status_code = upstream.status
        self.background = None
        self.init_headers(answer_headers(upstream, fwd))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome: list[Any] = [CLIENT_CLOSED, None]
        streamer = asyncio.ensure_future(self._stream(send, outcome))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streamer, watcher):
                t.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            if outcome[0] == OK:
                self.upstream.release()
            else:  # closing the connection is what tells the worker to abort
                self.upstream.close()
            self.done(*outcome)

    async def _stream(self, send: Send, outcome: list[Any]) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        tail = self.first[-2:] if self.first else b"\n\n"
        try:
            if self.first:
                await send({"type": "http.response.body", "body": self.first, "more_body": True})
            async for chunk in self.upstream.content.iter_any():
                if chunk:
                    tail = chunk[-2:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            outcome[:] = [OK, None]
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            msg = f"worker stream failed: {describe_error(e)}"
            logger.warning("%s (%s)", msg, self.upstream.url)
            outcome[:] = [FAILED, msg]
            # Finish a frame cut in half, so the error event parses as its own frame.
            lead = b"" if tail == b"\n\n" else (b"\n" if tail.endswith(b"\n") else b"\n\n")
            await send({"type": "http.response.body", "body": lead + sse_error(msg) + DONE, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def read_json(request: Request) -> tuple[bytes, dict[str, Any]]:
    """The raw body and its JSON object; ValueError for a body that is not a JSON object."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except ValueError as e:
        raise ValueError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return raw, body

