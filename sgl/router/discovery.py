"""Kubernetes service discovery: worker pods in, worker URLs out.

`PodDiscovery` watches the pods that match a label selector (in one namespace, or in all)
with the official `kubernetes` client and tells the router, through two async callbacks,
which URLs to add to and remove from its rotation. A pod counts as a worker while it is
Running, its Ready condition is True, it has a pod IP and it is not being deleted; its URL
is `http://{podIP}:{port}`. The watch runs in a thread (the client is blocking): it lists
the pods once (the list is reconciled against what the router was told, so anything missed
while not watching is caught up), then watches from the list's resourceVersion, resumes from
the last version it saw when the server ends a watch, re-lists when the server answers
410 Gone (that version is too old), and backs off exponentially on any other error.
Which URLs to add and remove is decided by `handle_event` / `reconcile`, plain functions of
the membership they keep, so they are tested against recorded watch events without a
cluster. The `kubernetes` package is imported only when discovery runs (extra `router-k8s`).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

log = logging.getLogger("sgl.router.discovery")

Action = tuple[Literal["add", "remove"], str]

# The server ends each watch after this many seconds (a jittered value is what kubectl
# uses too); the thread then resumes from the last resourceVersion it saw. Short enough that
# a watch silently cut by a proxy is noticed, long enough to cost nothing.
WATCH_TIMEOUT_S = 300
# Client-side read timeout: a connection that sends nothing (not even a bookmark) for
# this long past the server's own timeout is dead.
READ_SLACK_S = 30


def pod_worker_url(pod: Any, port: int) -> str | None:
    """The worker URL of a V1Pod, or None when it must not receive requests."""
    meta, status = pod.metadata, pod.status
    if meta is None or status is None or meta.deletion_timestamp is not None:
        return None  # terminating pods keep Ready=True for a while; drain them at once
    if status.phase != "Running" or not status.pod_ip:
        return None
    ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))
    if not ready:
        return None
    host = status.pod_ip
    if ipaddress.ip_address(host).version == 6:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _forget_add(adding: dict[str, asyncio.Task[None]], url: str, task: asyncio.Task[None]) -> None:
    if adding.get(url) is task:  # not a later add of the same URL
        del adding[url]


def _pod_key(pod: Any) -> str:
    return f"{pod.metadata.namespace}/{pod.metadata.name}"


class PodDiscovery:
    """Keeps the router's worker set equal to the ready pods matching `selector`."""

    def __init__(self, selector: dict[str, str], namespace: str | None, port: int,
                 on_add: Callable[[str], Awaitable[None]], on_remove: Callable[[str], Awaitable[None]],
                 *, api_client: Any = None, backoff_initial_s: float = 1.0, backoff_max_s: float = 30.0,
                 watch_timeout_s: int = WATCH_TIMEOUT_S) -> None:
        if not selector:
            raise ValueError("service discovery needs a non-empty --selector (e.g. app=sgl-worker)")
        self.selector = dict(selector)
        self.namespace = namespace
        self.port = port
        self.on_add, self.on_remove = on_add, on_remove
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.watch_timeout_s = watch_timeout_s
        self._api_client = api_client  # built from in-cluster config or kubeconfig when None
        # pod "namespace/name" -> URL, for the pods currently in rotation; a URL is counted
        # because a new pod can get the IP of a deleted one before that pod's DELETED arrives.
        self._pods: dict[str, str] = {}
        self._urls: Counter[str] = Counter()
        self._stopping = threading.Event()
        self._watch: Any = None
        self._wake: Callable[[], None] | None = None

    @property
    def label_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))

    @property
    def workers(self) -> set[str]:
        """The URLs currently in rotation (as announced through on_add / on_remove)."""
        return set(self._urls)

    # -- decisions (no I/O) -------------------------------------------------------------

    def handle_event(self, event: dict[str, Any]) -> list[Action]:
        """What one watch event ({"type", "object": V1Pod}) changes in the worker set."""
        kind, pod = event.get("type"), event.get("object")
        if kind in ("ADDED", "MODIFIED"):
            return self._set(_pod_key(pod), pod_worker_url(pod, self.port))
        if kind == "DELETED":
            return self._set(_pod_key(pod), None)
        return []  # BOOKMARK only moves the resourceVersion; ERROR is handled by the watch loop

    def reconcile(self, pods: Iterable[Any]) -> list[Action]:
        """Make the worker set equal to `pods` (a fresh list): removals first, then adds."""
        desired = {_pod_key(p): pod_worker_url(p, self.port) for p in pods}
        actions: list[Action] = []
        for key in [k for k in self._pods if not desired.get(k)]:
            actions += self._set(key, None)
        for key, url in desired.items():
            actions += self._set(key, url)
        return actions

    def _set(self, key: str, url: str | None) -> list[Action]:
        old = self._pods.get(key)
        if old == url:
            return []
        actions: list[Action] = []
        if old is not None:
            del self._pods[key]
            self._urls[old] -= 1
            if not self._urls[old]:
                del self._urls[old]
                actions.append(("remove", old))
        if url is not None:
            self._pods[key] = url
            self._urls[url] += 1
            if self._urls[url] == 1:
                actions.append(("add", url))
        return actions

    # -- running --------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch until stop() (or cancellation), calling on_add / on_remove in order (an add
        runs in the background; a later removal of its URL cancels it)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[Action] | None] = asyncio.Queue()

        def emit(actions: list[Action] | None) -> None:
            if actions is None or actions:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, actions)
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    pass

        self._stopping.clear()
        self._wake = lambda: emit(None)
        thread = threading.Thread(target=self._watch_loop, args=(emit,), name="sgl-pod-discovery", daemon=True)
        thread.start()
        # An add may wait long for the worker's first health check: each runs as its own task,
        # so one unreachable pod never holds up the adds and removals behind it; a removal of
        # the same URL cancels it.
        adding: dict[str, asyncio.Task[None]] = {}
        try:
            while (actions := await queue.get()) is not None:
                for kind, url in actions:
                    log.info("service discovery: %s %s", kind, url)
                    pending = adding.pop(url, None)
                    if pending is not None:
                        pending.cancel()
                        await asyncio.gather(pending, return_exceptions=True)
                    if kind == "add":
                        task = adding[url] = loop.create_task(self._call(self.on_add, kind, url))
                        task.add_done_callback(functools.partial(_forget_add, adding, url))
                        await asyncio.sleep(0)  # let it start: callbacks begin in the order announced
                    else:
                        await self._call(self.on_remove, kind, url)
        finally:
            for task in adding.values():
                task.cancel()
            await asyncio.gather(*adding.values(), return_exceptions=True)
            self.stop()
            await asyncio.to_thread(thread.join, 5.0)

    @staticmethod
    async def _call(fn: Callable[[str], Awaitable[None]], kind: str, url: str) -> None:
        try:
            await fn(url)
        except Exception:  # a callback's failure must not end discovery
            log.exception("service discovery: %s %s failed", kind, url)

    def stop(self) -> None:
        """End the watch; run() returns soon after. Safe from any thread, and repeatable."""
        self._stopping.set()
        if self._watch is not None:
            self._watch.stop()  # also shuts the socket a blocked read waits on
        if self._wake is not None:
            self._wake()

    def _core_api(self) -> Any:
        from kubernetes import client, config

        if self._api_client is None:
            cfg = client.Configuration()
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
            self._api_client = client.ApiClient(cfg)
        return client.CoreV1Api(self._api_client)

    def _list_call(self, api: Any) -> tuple[Callable[..., Any], dict[str, Any]]:
        kwargs: dict[str, Any] = {"label_selector": self.label_selector}
        if self.namespace:
            return api.list_namespaced_pod, {"namespace": self.namespace, **kwargs}
        return api.list_pod_for_all_namespaces, kwargs

    def _watch_loop(self, emit: Callable[[list[Action] | None], None]) -> None:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        backoff = self.backoff_initial_s
        version: str | None = None  # None: list (again) before watching
        try:
            while not self._stopping.is_set():
                try:
                    api = self._core_api()
                    fn, kwargs = self._list_call(api)
                    if version is None:
                        pods = fn(**kwargs)
                        emit(self.reconcile(pods.items))
                        version = pods.metadata.resource_version
                    w = watch.Watch()
                    self._watch = w
                    if self._stopping.is_set():
                        break
                    # timeout_seconds also turns off the client's own one-shot 410 retry, so
                    # a 410 reaches us as ApiException and we re-list (it cannot know what
                    # it missed; a list can).
                    for event in w.stream(fn, **kwargs, resource_version=version, allow_watch_bookmarks=True,
                                          timeout_seconds=self.watch_timeout_s,
                                          _request_timeout=self.watch_timeout_s + READ_SLACK_S):
                        emit(self.handle_event(event))
                        version = w.resource_version or version
                        backoff = self.backoff_initial_s
                        if self._stopping.is_set():
                            break
                except ApiException as e:
                    if e.status == 410:
                        log.info("service discovery: resourceVersion %s expired, listing again", version)
                        version = None
                        continue
                    backoff = self._pause(f"API error {e.status} {e.reason}", backoff)
                except Exception as e:  # noqa: BLE001 - connection errors, bad config: retry
                    backoff = self._pause(f"{type(e).__name__}: {e}", backoff)
        finally:
            self._watch = None
            emit(None)

    def _pause(self, why: str, backoff: float) -> float:
        if not self._stopping.is_set():
            log.warning("service discovery: %s; retrying in %.1fs", why, backoff)
            self._stopping.wait(backoff)
        return min(backoff * 2, self.backoff_max_s)
