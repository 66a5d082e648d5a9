"""The router's state and lifecycle: `Router` owns the workers, the policy, the HTTP
clients, health checks, admission, metrics, the chat tokenizer and service discovery.

Workers come in sets (`Registry`), each with its own policy instance: one set in regular
mode; in PD mode (`--pd-disaggregation`) a prefill set and a decode set, and the request
path is `PdProxy` (pd_proxy.py). Everything else (health checks, circuit breakers,
retries, admission, metrics) is the same code over every set (`Fleet`).

Startup: the policies start, every `--worker-urls` (PD: `--prefill`, `--decode`) worker is
registered out of rotation and joins it at its first good health check; the router serves as
soon as one has in every set (the rest
join in the background; one that does not pass within `--worker-startup-timeout-secs`
stays out until the periodic checks bring it in). Then health checks, service discovery
and the optional Prometheus listener start, and the chat tokenizer is fetched from a
healthy worker in the background, retried with back-off until one serves it. No
module-level state: `create_app` (app.py) hangs one `Router` off `app.state.router`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
from typing import Any

import aiohttp
import httpx

from sgl.router.admission import Admission
from sgl.router.circuit import STATE_CODE, CircuitOptions
from sgl.router.config import RouterConfig, normalize_url
from sgl.router.health import HealthChecker, wait_healthy
from sgl.router.metrics import RouterMetrics
from sgl.router.pd_proxy import PdProxy
from sgl.router.policies import PolicyOptions, make_policy
from sgl.router.policies.base import Policy
from sgl.router.proxy import Proxy
from sgl.router.registry import Fleet, Registry, Worker
from sgl.router.retry import RetryOptions

logger = logging.getLogger("sgl.router")
CONNECT_TIMEOUT_S = 10.0

__version__ = "0.1.0"

# Back-off between rounds of tokenizer fetches over the healthy workers (doubling, capped).
TOKENIZER_RETRY_INITIAL_SECS = 1.0
TOKENIZER_RETRY_MAX_SECS = 30.0


def worker_headers(cfg: RouterConfig) -> dict[str, str]:
    """Headers of every call the router makes to a worker (its API key, the router's own)."""
    return {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def policy_options(cfg: RouterConfig) -> PolicyOptions:
    """The policy's options: the configured knobs, plus the workers' headers for its own calls."""
    return dataclasses.replace(cfg.policy_options, worker_headers=tuple(worker_headers(cfg).items()))


def _wants_token_ids(policy: Policy) -> bool:
    return bool(getattr(policy, "wants_token_ids", policy.name == "kv_aware"))


class Router:
    def __init__(self, cfg: RouterConfig, policy: Policy | None = None) -> None:
        """`policy`, if given, replaces the configured one (of the prefill set in PD mode)."""
        self.cfg = cfg
        circuit = CircuitOptions(cfg.cb_failure_threshold, cfg.cb_success_threshold, cfg.cb_timeout_duration_secs,
                                 cfg.cb_window_duration_secs, enabled=not cfg.disable_circuit_breaker)
        sets = []
        for i, (role, name) in enumerate(cfg.role_policies().items()):
            chosen = policy if policy is not None and i == 0 else make_policy(name, policy_options(cfg))
            sets.append(Registry(chosen, circuit, role))
        self.fleet = Fleet(sets)
        self.pd = cfg.pd_disaggregation
        # The first set: the only one, or PD mode's prefill set (where control calls go).
        self.registry = sets[0]
        self.policy = self.registry.policy
        self.wants_token_ids = any(_wants_token_ids(r.policy) for r in sets)
        self.admission = Admission(cfg.max_concurrent_requests, cfg.queue_size, cfg.queue_timeout_secs)
        self.metrics = RouterMetrics(self.snapshot)
        self.worker_headers = worker_headers(cfg)
        self.tokenizer: Any = None  # sgl.router.tokenizer.RouterTokenizer, once fetched
        self._fetching_tokenizer = False
        self._tokenizer_wake = asyncio.Event()
        self._bg: set[asyncio.Task[Any]] = set()
        self.client: httpx.AsyncClient | None = None
        self.session: aiohttp.ClientSession | None = None
        self.health: HealthChecker | None = None
        self.proxy: Proxy | None = None
        self.pd_proxy: PdProxy | None = None  # PD mode's generation path
        self._discovery: Any = None
        self._metrics_server: Any = None

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        # Control calls (health, fan-out, tokenizer); they carry the workers' key, if any.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_secs), headers=self.worker_headers)
        self.health = HealthChecker(self.fleet, self.client, endpoint=cfg.health_check_endpoint,
                                    timeout=cfg.health_check_timeout_secs, interval=cfg.health_check_interval_secs,
                                    failure_threshold=cfg.health_failure_threshold,
                                    success_threshold=cfg.health_success_threshold, headers=self.worker_headers)
        # The request path's pool: keep-alive, no connection cap (admission limits concurrency),
        # each read bounded by the request timeout, a connect by at most 10 s (a host that went
        # silent must cost a retry, not the request timeout); bytes pass undecoded.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None,
                                          sock_connect=min(cfg.request_timeout_secs, CONNECT_TIMEOUT_S),
                                          sock_read=cfg.request_timeout_secs),
            auto_decompress=False)
        retry = RetryOptions(cfg.max_attempts, cfg.retry_initial_backoff_ms, cfg.retry_max_backoff_ms,
                             cfg.retry_backoff_multiplier, cfg.retry_jitter_factor)
        # Control calls go to self.registry's workers: PD mode's prefill set.
        self.proxy = Proxy(self.registry, self.policy, self.session, self.client, retry, self.metrics,
                           self._on_connect_error, cfg.request_timeout_secs)
        if self.pd:
            prefill, decode = self.fleet.role("prefill"), self.fleet.role("decode")
            assert prefill is not None and decode is not None
            self.pd_proxy = PdProxy(self.proxy, prefill, decode, cfg.pd_wait_for_prefill)
        for r in self.fleet.sets:
            await r.policy.start()
        await self._add_startup_workers()
        if not cfg.disable_health_check:
            self.health.start()
        if cfg.service_discovery:
            self._start_discovery()
        if cfg.prometheus_port:
            await self._start_metrics_server()
        self.spawn(self.ensure_tokenizer())

    async def stop(self) -> None:
        if self._discovery is not None:
            with contextlib.suppress(Exception):
                await _maybe_await(self._discovery.stop())
        if self._metrics_server is not None:
            self._metrics_server.should_exit = True
        if self.health is not None:
            await self.health.stop()
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        if self.pd_proxy is not None:
            await self.pd_proxy.close()
        for r in self.fleet.sets:
            with contextlib.suppress(Exception):
                await r.policy.stop()
        if self.client is not None:
            await self.client.aclose()
        if self.session is not None:
            await self.session.close()

    def spawn(self, aw: Any) -> None:
        task = asyncio.get_running_loop().create_task(aw)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _on_connect_error(self, url: str) -> None:
        if not self.cfg.disable_health_check and self.health is not None:
            self.health.probe_soon(url)

    # ---- workers --------------------------------------------------------------------------

    def _startup_workers(self) -> list[tuple[Registry, str, int | None]]:
        """(set, url, bootstrap port) of every worker listed on the command line."""
        if not self.pd:
            return [(self.registry, url, None) for url in self.cfg.worker_urls]
        prefill, decode = self.fleet.role("prefill"), self.fleet.role("decode")
        assert prefill is not None and decode is not None
        return ([(prefill, url, port) for url, port in self.cfg.prefill]
                + [(decode, url, None) for url in self.cfg.decode])

    async def _add_startup_workers(self) -> None:
        """Register every listed worker out of rotation, and return as soon as one of them
        in every set (PD mode: a prefill and a decode) passed its first health check, or all
        have had their --worker-startup-timeout-secs: the router serves from then on, and the
        others join when they pass. A worker that never passes stays registered out of
        rotation; the periodic checks can bring it in."""
        listed = self._startup_workers()
        if self.cfg.disable_health_check:
            for reg, url, port in listed:
                reg.add(url, healthy=True, bootstrap_port=port)
            return
        joins = {asyncio.get_running_loop().create_task(self._join(reg.add(url, healthy=False, bootstrap_port=port))):
                 reg.role for reg, url, port in listed if url not in self.fleet}
        for t in joins:
            self._bg.add(t)
            t.add_done_callback(self._bg.discard)
        waiting_for = {r.role for r in self.fleet.sets}
        pending = set(joins)
        while pending and waiting_for:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            waiting_for -= {joins[t] for t in done if not t.cancelled() and t.result()}

    async def _join(self, w: Worker) -> bool:
        """Bring a registered, out-of-rotation startup worker in at its first good check."""
        assert self.client is not None
        err = await wait_healthy(self.client, w.url, self.cfg.health_check_endpoint,
                                 self.cfg.health_check_timeout_secs, self.cfg.worker_startup_timeout_secs,
                                 self.worker_headers)
        if self.fleet.get(w.url) is not w:
            return False  # removed meanwhile
        if err is not None:
            w.last_error = err
            logger.warning("worker %s did not pass a health check within %gs (%s); it stays out of rotation "
                           "until the health checks pass", w.url, self.cfg.worker_startup_timeout_secs, err)
            return False
        if not w.state.healthy:  # the periodic checks may have been first
            w.state.healthy, w.last_error, w.health_failures = True, None, 0
            logger.info("worker %s added", w.url)
        self.wake_tokenizer()
        return True

    async def add_worker(self, url: str, role: str = "worker",
                         bootstrap_port: int | None = None) -> tuple[Worker | None, str | None]:
        """Wait for `url`'s first good health check (none with --disable-health-check), then
        put it in rotation in the `role` set ("worker"; PD mode: "prefill" or "decode"); a
        worker that does not pass is not registered, and the reason is returned (POST
        /add_worker, service discovery). ValueError for a role this mode has not."""
        assert self.client is not None
        url = normalize_url(url)
        reg = self.fleet.role(role)
        if reg is None:
            if not self.pd:
                raise ValueError(f"worker_type {role!r} needs a router in PD mode (--pd-disaggregation)")
            raise ValueError(f"worker_type must be prefill or decode in PD mode; got {role!r}")
        if url in self.fleet:
            return self.fleet.get(url), None
        err = None if self.cfg.disable_health_check else await wait_healthy(
            self.client, url, self.cfg.health_check_endpoint, self.cfg.health_check_timeout_secs,
            self.cfg.worker_startup_timeout_secs, self.worker_headers)
        if err is not None:
            return None, err
        if url in self.fleet:  # added concurrently
            return self.fleet.get(url), None
        w = reg.add(url, healthy=True, bootstrap_port=bootstrap_port)
        logger.info("%s %s added", "worker" if role == "worker" else role + " worker", url)
        self.wake_tokenizer()
        return w, None

    async def add_discovered(self, url: str, retry_initial_s: float = 1.0, retry_max_s: float = 60.0) -> None:
        """add_worker for a pod that Kubernetes calls Ready, tried until it passes. The pod
        sends no further event while it stays Ready, so one failed first check must not keep
        it out for good; discovery cancels this when the pod goes away."""
        delay = retry_initial_s
        while (err := (await self.add_worker(url))[1]) is not None:
            logger.warning("discovered worker %s not added yet: %s; trying again in %.0f s", url, err, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, retry_max_s)

    def remove_worker(self, url: str) -> Worker | None:
        reg = self.fleet.owner(normalize_url(url))
        w = reg.remove(normalize_url(url)) if reg is not None else None
        if w is not None:
            logger.info("worker %s removed (%d request(s) still finishing on it)", w.url, w.state.in_flight)
            self.metrics.forget_worker(w.url)
        return w

    def _start_discovery(self) -> None:
        from sgl.router.discovery import PodDiscovery  # optional: needs the kubernetes package

        async def on_remove(url: str) -> None:
            self.remove_worker(url)

        self._discovery = PodDiscovery(dict(self.cfg.selector), self.cfg.service_discovery_namespace,
                                       self.cfg.service_discovery_port, self.add_discovered, on_remove)
        self.spawn(self._discovery.run())

    def wake_tokenizer(self) -> None:
        """A worker joined: fetch the tokenizer now if it is still missing (ends the back-off)."""
        if self.tokenizer is None:
            self._tokenizer_wake.set()
            self.spawn(self.ensure_tokenizer())

    async def ensure_tokenizer(self) -> None:
        """Fetch the chat template / tokenizer from the first healthy worker that serves one,
        retrying with back-off (a worker may be down, busy or not yet up) until one does; chat
        routing uses the rendered conversation once it is here, the joined contents before."""
        if self.tokenizer is not None or self._fetching_tokenizer:
            return
        try:
            from sgl.router.tokenizer import fetch_tokenizer
        except ImportError:
            return
        self._fetching_tokenizer = True
        delay = TOKENIZER_RETRY_INITIAL_SECS
        try:
            while self.tokenizer is None:
                self._tokenizer_wake.clear()
                await self._fetch_tokenizer(fetch_tokenizer)
                if self.tokenizer is not None:
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._tokenizer_wake.wait(), delay)
                delay = min(delay * 2, TOKENIZER_RETRY_MAX_SECS)
        finally:
            self._fetching_tokenizer = False

    async def _fetch_tokenizer(self, fetch_tokenizer: Any) -> None:
        for w in self.fleet.healthy():
            try:
                tok = await _maybe_await(fetch_tokenizer(self.client, w.url))
            except Exception:  # a worker without /get_tokenizer: try the next
                logger.debug("no tokenizer from %s", w.url, exc_info=True)
                continue
            if tok is not None:
                self.tokenizer = tok
                logger.info("chat routing uses the tokenizer of %s", w.url)
                return

    async def _start_metrics_server(self) -> None:
        assert self.cfg.prometheus_port is not None
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        from sgl.router.metrics import CONTENT_TYPE

        async def metrics(_: Any) -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)

        class NoSignalServer(uvicorn.Server):  # the main server handles SIGINT/SIGTERM
            @contextlib.contextmanager
            def capture_signals(self) -> Any:
                yield

        app = Starlette(routes=[Route("/metrics", metrics)])
        server = NoSignalServer(uvicorn.Config(app, host=self.cfg.prometheus_host, port=self.cfg.prometheus_port,
                                                log_level="warning", access_log=False, log_config=None))
        self._metrics_server = server
        self.spawn(server.serve())

    # ---- views ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        policies = []
        for r in self.fleet.sets:
            try:
                stats = r.policy.stats()
            except Exception:  # metrics must render even if a policy's stats fail
                logger.exception("policy.stats failed")
                stats = {}
            policies.append({"role": r.role, "policy": r.policy.name, "stats": stats})
        return {"workers": [dict(w.describe(), circuit_code=STATE_CODE[w.circuit.state]) for w in self.fleet.all()],
                "admission_active": self.admission.active, "admission_queued": self.admission.waiting,
                "rejected_full": self.admission.rejected_full, "rejected_timeout": self.admission.rejected_timeout,
                "policies": policies, "tokenizer_loaded": self.tokenizer is not None}


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x
