"""PD mode's request path: each attempt sends one body to a (prefill, decode) pair at once.

    pick a prefill P (prefill policy) and a decode D (decode policy), preferring untried ones
      └─ body + bootstrap_host (P's host), bootstrap_port (P's, or null), bootstrap_room
         (fresh per attempt; lists for batches, pd_request.py) POSTed to P and D concurrently
           ├─ D answered (non-stream: its whole body; stream: its first chunk) -> D's answer goes
           │     to the client; P's body is read to its end (in the background unless needed)
           ├─ either side fails first: connection error, 408/429/5xx, a read error, or an SSE
           │     error event -> the other side's connection is closed (the worker aborts its
           │     request, freeing what it reserved), the failure is counted on its side
           │     (circuit, health probe, metrics), back off, retry the pair with new rooms
           └─ either side answers another 4xx -> that answer to the client, the other closed

What the client sees is D's: its status, headers and bytes, streamed chunk by chunk; a
non-streamed `return_logprob` /generate answer gets P's `input_token_logprobs` put before
D's (sglang-router's merge). A D stream that breaks later ends with an SSE error event (valid
JSON) and `data: [DONE]`, as in regular mode.

Why D's stream is passed on before P's answer has ended (sglang-router 0.3.2 holds it until
then; `--pd-wait-for-prefill` restores that): D's first chunk carries the first token, which
D has only once P's KV and first token have reached it (a worker sends no byte of a stream
before its first output: sgl's server waits for that chunk before its answer head, so that
errors are still HTTP statuses). From then on P's work for the request is done, and nothing
P does can change D's answer; holding the stream would only add the tail of P's response to
the time to first token. A failure of P after that point is counted on P and does not touch
the client's answer.

`PdProxy` reuses the regular `Proxy` for everything but the pairing: its worker choice
(`pick`, per set and policy), its accounting (`settle`: in-flight, circuit, policy, metrics),
its retry options, HTTP session and passthrough. Control calls (/v1/models, /get_model_info)
stay on that `Proxy`, whose registry in PD mode is the prefill set (as sglang-router sends
them to a prefill worker).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp
from starlette.responses import Response

from sgl.router.pd_request import error_event, merge_input_logprobs, with_bootstrap
from sgl.router.policies.base import Policy
from sgl.router.proxy import (CLIENT_CLOSED, FAILED, OK, Forward, NoWorkers, Passthrough, Proxy, answer_headers,
                              describe_error, error_response, logger, read_quietly)
from sgl.router.registry import Registry, Worker
from sgl.router.retry import retryable_status


@dataclass
class _Result:
    """What one side's call came to."""

    status: int = 0  # 0: no answer head
    body: bytes = b""  # the whole body, or a stream's first chunk
    failure: str | None = None  # set when the side failed in a way worth a retry
    reason: str = ""  # the failure's kind, for metrics: connection, timeout, status, read, error_event

    @property
    def bad(self) -> bool:
        return self.failure is not None or self.status >= 400


@dataclass
class _Side:
    """One side (prefill or decode) of one attempt."""

    role: str
    worker: Worker
    policy: Policy
    task: asyncio.Task[_Result] | None = None
    resp: aiohttp.ClientResponse | None = None
    settled: bool = False


class PdProxy:
    def __init__(self, base: Proxy, prefill: Registry, decode: Registry, wait_for_prefill: bool = False) -> None:
        self.base = base
        self.session, self.retry, self.metrics = base.session, base.retry, base.metrics
        self.settle, self.pick, self.on_connect_error = base.settle, base.pick, base.on_connect_error
        self.prefill, self.decode = prefill, decode
        self.wait_for_prefill = wait_for_prefill
        self._drains: set[asyncio.Task[_Result]] = set()  # prefill answers still being read

    async def close(self) -> None:
        for t in list(self._drains):
            t.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)

    async def forward(self, fwd: Forward) -> Response:
        """The pair's answer as a response (`fwd` must carry `route_req` and `json`); never
        raises for worker trouble. Cancelling it (the client left) closes both connections."""
        assert fwd.route_req is not None and fwd.json is not None
        tried_p: list[str] = []
        tried_d: list[str] = []

        async def attempt(t0: float, final: bool) -> Response | str:
            p, d = self._pick_pair(fwd, tried_p, tried_d)
            tried_p.append(p.url)
            tried_d.append(d.url)
            return await self._attempt_pair(fwd, p, d, t0, final=final)

        return await self.base.with_retries(fwd, attempt)

    def _pick_pair(self, fwd: Forward, tried_p: list[str], tried_d: list[str]) -> tuple[Worker, Worker]:
        p = self.pick(self.prefill, self.prefill.policy, fwd.route_req, tried_p)
        try:
            d = self.pick(self.decode, self.decode.policy, fwd.route_req, tried_d)
        except NoWorkers:
            try:  # the prefill policy noted its choice (trees, pending pages): nothing was sent after all
                self.prefill.policy.on_done(fwd.route_req, p.state, True)  # type: ignore[arg-type]
            except Exception:
                logger.exception("policy.on_done failed")
            raise
        return p, d

    async def _attempt_pair(self, fwd: Forward, p: Worker, d: Worker, t0: float, final: bool) -> Response | str:
        """One try on the pair: the answer, or why to try again (the failures already counted)."""
        assert fwd.json is not None
        body = with_bootstrap(fwd.path.split("?")[0], fwd.json, p.host, p.bootstrap_port)
        data = json.dumps(body, separators=(",", ":")).encode()
        ps, ds = _Side("prefill", p, self.prefill.policy), _Side("decode", d, self.decode.policy)
        for s in (ps, ds):
            s.worker.state.in_flight += 1
            s.worker.circuit.begin()
        ps.task = asyncio.ensure_future(self._send(ps, fwd, data, whole=True))
        ds.task = asyncio.ensure_future(self._send(ds, fwd, data, whole=not fwd.stream))
        draining = False
        try:
            while True:
                await asyncio.wait({t for t in (ps.task, ds.task) if not t.done()},
                                   return_when=asyncio.FIRST_COMPLETED)
                if ds.task.done():
                    if not ds.task.result().bad:
                        break
                    # When both failed, the prefill's failure is the cause (the decode's KV never came).
                    culprit = ps if ps.task.done() and ps.task.result().bad else ds
                    return self._end_attempt(fwd, culprit, ds if culprit is ps else ps, final)
                pr = ps.task.result()
                if pr.bad:
                    return self._end_attempt(fwd, ps, ds, final)
                self._settle(fwd, ps, pr)  # the prefill is done: wait for the decode
            dr = ds.task.result()
            merge = not fwd.stream and fwd.path == "/generate" and bool(fwd.json.get("return_logprob"))
            if not ps.task.done() and (merge or (fwd.stream and self.wait_for_prefill)):
                await asyncio.wait({ps.task})
            if not ps.task.done():
                self._drain(fwd, ps)
                draining = True
            elif not ps.settled:
                self._settle(fwd, ps, ps.task.result())
            if fwd.stream:
                assert ds.resp is not None
                ds.settled = True  # the passthrough settles it when the stream ends
                return Passthrough(ds.resp, fwd, dr.body,
                                    lambda end, err: self._pair_stream_done(fwd, ps, ds, t0, end, err))
            out = dr.body
            if merge and ps.task.done() and not ps.task.result().bad:
                out = merge_input_logprobs(ps.task.result().body, dr.body) or dr.body
            self._settle(fwd, ds, dr)
            self.metrics.pd_requests.labels(p.url, d.url, "ok").inc()
            assert ds.resp is not None
            return Response(out, dr.status, answer_headers(ds.resp, fwd))
        finally:
            for s in (ps, ds):  # cancelled (the client left), or the other side failed first
                if s.settled or (s is ps and draining):
                    continue
                assert s.task is not None
                if not s.task.done():
                    s.task.cancel()  # closes its connection: the worker aborts the request
                await asyncio.gather(s.task, return_exceptions=True)
                if s.resp is not None:
                    s.resp.close()
                self._abandon(fwd, s)

    async def _send(self, side: _Side, fwd: Forward, data: bytes, whole: bool) -> _Result:
        """POST to one side: its whole body (`whole`) or the first chunk of its stream."""
        url = side.worker.url + fwd.path
        try:
            try:
                resp = await self.session.post(url, data=data, headers=fwd.headers)
            except asyncio.TimeoutError as e:
                return _Result(failure=describe_error(e), reason="timeout")
            except (aiohttp.ClientError, OSError) as e:
                return _Result(failure=describe_error(e), reason="connection")
            side.resp = resp
            if resp.status >= 400:
                body = await read_quietly(resp)
                if retryable_status(resp.status):
                    excerpt = body[:300].decode(errors="replace")
                    return _Result(resp.status, body, f"answered {resp.status}: {excerpt}", "status")
                return _Result(resp.status, body)
            try:
                body = await resp.read() if whole else await resp.content.readany()
            except asyncio.TimeoutError as e:
                resp.close()
                return _Result(resp.status, b"", describe_error(e) + " while reading the answer", "timeout")
            except aiohttp.ClientError as e:
                resp.close()
                return _Result(resp.status, b"", describe_error(e) + " while reading the answer", "read")
            if whole:
                resp.release()
            msg = error_event(body)
            if msg is not None:
                resp.close()
                return _Result(resp.status, body, f"error event: {msg}", "error_event")
            return _Result(resp.status, body)
        except asyncio.CancelledError:
            if side.resp is not None:
                side.resp.close()
            raise

    def _settle(self, fwd: Forward, side: _Side, r: _Result) -> None:
        """Count one side's finished call on its worker (circuit, policy, metrics)."""
        ok = r.failure is None or (r.reason == "status" and r.status < 500)
        self.settle(fwd.route_req, side.policy, side.worker, ok, r.failure)
        side.settled = True
        if r.failure is not None:
            self.metrics.pd_failures.labels(side.role, r.reason).inc()
            logger.info("PD %s call to %s failed: %s", side.role, side.worker.url, r.failure)
            if r.reason in ("connection", "read"):  # refused, reset, closed: is the worker gone?
                self.on_connect_error(side.worker.url)

    def _abandon(self, fwd: Forward, side: _Side) -> None:
        self.settle(fwd.route_req, side.policy, side.worker, None)
        side.settled = True

    def _end_attempt(self, fwd: Forward, culprit: _Side, other: _Side, final: bool) -> Response | str:
        """The attempt failed on `culprit`'s side; `other` is closed by `_attempt` unless done."""
        assert culprit.task is not None and other.task is not None
        r = culprit.task.result()
        self._settle(fwd, culprit, r)
        if other.task.done() and not other.settled:
            self._settle(fwd, other, other.task.result())
        p, d = (culprit, other) if culprit.role == "prefill" else (other, culprit)
        self.metrics.pd_requests.labels(p.worker.url, d.worker.url,
                                        "client_error" if r.failure is None else "error").inc()
        if r.failure is None:  # a 4xx the client caused: passed on as the worker answered it
            assert culprit.resp is not None
            return Response(r.body, r.status, answer_headers(culprit.resp, fwd))
        what = f"{culprit.role} worker {culprit.worker.url}: {r.failure}"
        if final:
            return error_response(r.status if r.status >= 400 else 502, f"PD request failed on the {what}")
        return what

    def _drain(self, fwd: Forward, side: _Side) -> None:
        """Let the prefill's answer finish in the background; count it when it has."""
        task = side.task
        assert task is not None
        self._drains.add(task)

        def done(t: asyncio.Task[_Result]) -> None:
            self._drains.discard(t)
            if side.settled:
                return
            if t.cancelled():
                self._abandon(fwd, side)
                return
            err = t.exception()
            self._settle(fwd, side, t.result() if err is None else _Result(failure=describe_error(err), reason="read"))

        task.add_done_callback(done)

    def _pair_stream_done(self, fwd: Forward, ps: _Side, ds: _Side, t0: float, end: int,
                          error: str | None) -> None:
        self.settle(fwd.route_req, ds.policy, ds.worker, {OK: True, FAILED: False}.get(end), error)
        if end == FAILED:
            self.metrics.pd_failures.labels("decode", "stream").inc()
            self.on_connect_error(ds.worker.url)
        elif end == CLIENT_CLOSED and ps.task is not None and not ps.task.done():
            ps.task.cancel()  # the prefill's drain is abandoned with the client
        outcome = {OK: "ok", FAILED: "error"}.get(end, "abandoned")
        self.metrics.pd_requests.labels(ps.worker.url, ds.worker.url, outcome).inc()
        self.metrics.observe(fwd.route, end, time.perf_counter() - t0)
        if fwd.on_finish is not None:
            fwd.on_finish()
