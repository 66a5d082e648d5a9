"""Kubernetes service discovery (sgl/router/discovery.py) against watch events on the wire.

The fixtures in tests/data/k8s_watch are watch streams in kube-apiserver's wire format
(one JSON event per line). They are turned into V1Pod events by the `kubernetes` client's
own unmarshalling (`Watch.unmarshal_event`), exactly as a live watch yields them. The
resume / 410 / backoff logic runs against a real local HTTP server that speaks the list and
watch protocol to the real client (no mocked client).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

kubernetes = pytest.importorskip("kubernetes", reason="install the router-k8s extra")
from kubernetes import client, watch  # noqa: E402

from sgl.router.discovery import PodDiscovery, pod_worker_url  # noqa: E402

DATA = Path(__file__).parent / "data" / "k8s_watch"
W0, W1, W1_NEW = "http://10.244.1.23:30000", "http://10.244.2.9:30000", "http://10.244.2.31:30000"


def lines(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines()


def events(name: str) -> list[dict]:
    w = watch.Watch()
    return [w.unmarshal_event(line, "V1Pod") for line in lines(name)]


def pod_list(name: str):
    return client.ApiClient().deserialize((DATA / name).read_text(), "V1PodList", "application/json")


async def _noop(url: str) -> None:
    pass


def discovery(**kw) -> PodDiscovery:
    return PodDiscovery({"app": "sgl-worker"}, "sgl", 30000, kw.pop("on_add", _noop), kw.pop("on_remove", _noop), **kw)


def test_rollout_events_add_ready_pods_and_remove_unready_terminating_and_deleted():
    d = discovery()
    got = [d.handle_event(e) for e in events("rollout.jsonl")]
    assert got == [
        [], [], [],                      # scheduled, IP assigned, Running but not Ready yet
        [],                              # worker-1 added, unscheduled
        [("add", W0)],                   # worker-0 Ready
        [], [],                          # worker-1 Running not Ready; a BOOKMARK
        [("add", W1)],                   # worker-1 Ready
        [("remove", W0)],                # worker-0's readiness probe fails ...
        [("add", W0)],                   # ... and passes again
        [("remove", W1)],                # worker-1 terminating (deletionTimestamp, still Ready)
        [], [],                          # not ready any more, then DELETED: already gone
        [], [],                          # recreated under the same name, new uid and IP, not Ready
        [("add", W1_NEW)],               # Ready
        [("remove", W0)],                # worker-0 DELETED while Ready (node lost)
    ]
    assert d.workers == {W1_NEW}


def test_an_ip_reused_by_a_new_pod_stays_until_no_pod_holds_it():
    d = discovery()
    got = [d.handle_event(e) for e in events("ip_reuse.jsonl")]
    assert got == [[("add", W1)], [], [], [("remove", W1)]]
    assert d.workers == set()


def test_reconcile_with_a_fresh_list_catches_up_what_the_watch_missed():
    d = discovery()
    assert d.reconcile(pod_list("list_48400.json").items) == [("add", W0)]  # worker-1 not Ready
    for e in events("rollout.jsonl")[7:10]:
        d.handle_event(e)
    assert d.workers == {W0, W1}
    # after a 410: worker-0 is gone and worker-1 was replaced while nobody watched
    assert d.reconcile(pod_list("list_50300.json").items) == [("remove", W0), ("remove", W1), ("add", W1_NEW)]
    assert d.reconcile(pod_list("list_50300.json").items) == []


def _pod(ip: str | None, phase: str = "Running", ready: str = "True", deleting: bool = False) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name="w", namespace="ns",
                                     deletion_timestamp="2025-06-02T10:02:44Z" if deleting else None),
        status=client.V1PodStatus(phase=phase, pod_ip=ip,
                                  conditions=[client.V1PodCondition(type="Ready", status=ready)]))


def test_worker_url_rules():
    assert pod_worker_url(_pod("10.0.0.5"), 8000) == "http://10.0.0.5:8000"
    assert pod_worker_url(_pod("fd00::5"), 8000) == "http://[fd00::5]:8000"
    assert pod_worker_url(_pod(None), 8000) is None
    assert pod_worker_url(_pod("10.0.0.5", phase="Succeeded"), 8000) is None
    assert pod_worker_url(_pod("10.0.0.5", ready="False"), 8000) is None
    assert pod_worker_url(_pod("10.0.0.5", deleting=True), 8000) is None


def test_selector_is_required_and_joined_in_a_stable_order():
    with pytest.raises(ValueError, match="selector"):
        PodDiscovery({}, None, 30000, _noop, _noop)
    assert PodDiscovery({"tier": "gpu", "app": "sgl"}, None, 1, _noop, _noop).label_selector == "app=sgl,tier=gpu"


# -- the watch loop against a local API server -------------------------------------------


class ApiServer:
    """A loopback HTTP server answering pod list / watch requests from a script: each
    request takes the next (status, body lines, then) entry, and is recorded. `then`: False
    ends the response, True holds it open (a quiet watch), a queue streams the lines put
    into it until None (a live watch)."""

    def __init__(self, script: list[tuple[int, list[str], bool | queue.Queue]]):
        self.script = list(script)
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.release = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urllib.parse.urlsplit(self.path)
                owner.requests.append((url.path, dict(urllib.parse.parse_qsl(url.query))))
                status, body, hold = owner.script.pop(0) if owner.script else (500, ['{"code":500}'], False)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")  # as the API server streams a watch
                self.end_headers()
                for line in body:  # newline-delimited JSON, one event per chunk
                    data = line.encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                if isinstance(hold, queue.Queue):
                    while (line := hold.get()) is not None:
                        data = line.encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                elif hold:  # an open watch with nothing new to say
                    owner.release.wait(30)
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _api_client(url: str) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = url
    return client.ApiClient(cfg)


async def _run_until(d: PodDiscovery, server: ApiServer, calls: list, n_requests: int, n_calls: int) -> None:
    task = asyncio.create_task(d.run())
    for _ in range(400):  # a bound, not a timing assertion: the script is finite
        if len(server.requests) >= n_requests and len(calls) >= n_calls or task.done():
            break
        await asyncio.sleep(0.05)
    d.stop()  # the last watch is still open: stop() must end it
    await asyncio.wait_for(task, 20)


@pytest.mark.timeout(60)
def test_watch_resumes_from_last_version_relists_on_410_and_backs_off_on_errors():
    rollout, status500 = lines("rollout.jsonl"), json.dumps({"kind": "Status", "code": 500, "message": "etcd"})
    server = ApiServer([
        (500, [status500], False),                                   # list fails: back off, list again
        (200, [(DATA / "list_48400.json").read_text().replace("\n", "")], False),
        (200, rollout[7:10], False),                                 # watch; the server ends it
        (200, lines("gone_410.jsonl"), False),                       # resumed watch: too old
        (200, [(DATA / "list_50300.json").read_text().replace("\n", "")], False),
        (200, [], True),                                             # watch, held open
    ])
    calls: list[tuple[str, str]] = []

    async def on_add(url: str) -> None:
        calls.append(("add", url))

    async def on_remove(url: str) -> None:
        calls.append(("remove", url))

    d = discovery(on_add=on_add, on_remove=on_remove, api_client=_api_client(server.url),
                  backoff_initial_s=0.05)
    try:
        asyncio.run(_run_until(d, server, calls, n_requests=6, n_calls=7))
    finally:
        server.close()
    assert calls == [("add", W0), ("add", W1), ("remove", W0), ("add", W0),
                     ("remove", W0), ("remove", W1), ("add", W1_NEW)]
    paths = {p for p, _ in server.requests}
    assert paths == {"/api/v1/namespaces/sgl/pods"}
    queries = [q for _, q in server.requests]
    assert all(q["labelSelector"] == "app=sgl-worker" for q in queries)
    watched = [(q.get("watch"), q.get("resourceVersion")) for q in queries]
    assert watched == [(None, None), (None, None), ("true", "48400"), ("true", "49015"), (None, None),
                       ("true", "50300")]
    assert queries[2]["allowWatchBookmarks"] == "true"


@pytest.mark.timeout(60)
def test_an_add_that_waits_blocks_neither_other_adds_nor_its_removal():
    server = ApiServer([
        (200, [(DATA / "list_48400.json").read_text().replace("\n", "")], False),  # W0, W1
        (200, lines("rollout.jsonl")[7:10], True),                                  # W0 out, then in again
    ])
    calls: list[tuple[str, str]] = []
    first = [True]

    async def on_add(url: str) -> None:
        calls.append(("add", url))
        if url == W0 and first[0]:  # the first W0 never passes its health check
            first[0] = False
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                calls.append(("cancelled", url))
                raise

    async def on_remove(url: str) -> None:
        calls.append(("remove", url))

    d = discovery(on_add=on_add, on_remove=on_remove, api_client=_api_client(server.url))
    try:
        asyncio.run(_run_until(d, server, calls, n_requests=2, n_calls=5))
    finally:
        server.close()
    assert calls == [("add", W0), ("add", W1), ("cancelled", W0), ("remove", W0), ("add", W0)]


@pytest.mark.timeout(60)
def test_all_namespaces_without_a_namespace():
    empty = json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"}, "items": []})
    server = ApiServer([(200, [empty], False), (200, lines("rollout.jsonl")[:5], True)])
    added: list[str] = []

    async def on_add(url: str) -> None:
        added.append(url)

    d = PodDiscovery({"app": "sgl-worker"}, None, 30000, on_add, _noop, api_client=_api_client(server.url))
    try:
        asyncio.run(_run_until(d, server, added, n_requests=2, n_calls=1))
    finally:
        server.close()
    assert added == [W0]
    assert [p for p, _ in server.requests] == ["/api/v1/pods", "/api/v1/pods"]


# -- the router finds a real worker through discovery ------------------------------------


def _pod_at(event_or_pod: dict, ip: str) -> dict:
    pod = copy.deepcopy(event_or_pod)
    pod["status"]["podIP"], pod["status"]["podIPs"] = ip, [{"ip": ip}]
    return pod


def _event(kind: str, pod: dict) -> str:
    return json.dumps({"type": kind, "object": pod})


def _list_workers(router_url: str) -> list[str]:
    try:
        return httpx.get(router_url + "/list_workers", timeout=5).json()["urls"]
    except httpx.HTTPError:
        return ["(router not up)"]


def _wait_for(fn, want, what: str, bound: float = 120):
    deadline = time.time() + bound  # a bound on waiting, not a timing assertion
    while time.time() < deadline:
        if (got := fn()) == want:
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: still {got!r}, want {want!r}")


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.timeout(600)
def test_router_adds_and_removes_a_real_worker_as_its_pod_turns_ready_and_not():
    pytest.importorskip("sgl.launch_router", reason="the router is on another branch")
    from tests.server_proc import REPO, free_port, group_pids, start_server

    worker = start_server("--max-total-tokens", "4096")
    port = int(worker.url.rsplit(":", 1)[1])
    pods = json.loads((DATA / "list_48400.json").read_text())
    ready = _pod_at(pods["items"][0], "127.0.0.1")
    not_ready = _pod_at(json.loads(lines("rollout.jsonl")[8])["object"], "127.0.0.1")
    pods["items"] = [ready]
    live: queue.Queue = queue.Queue()
    api = ApiServer([(200, [json.dumps(pods)], False), (200, [], live)])
    kubeconfig = tempfile.NamedTemporaryFile("w", suffix=".kubeconfig", delete=False)
    kubeconfig.write(json.dumps({  # JSON is YAML: a kubeconfig for the local API server
        "apiVersion": "v1", "kind": "Config", "current-context": "local",
        "clusters": [{"name": "local", "cluster": {"server": api.url}}],
        "users": [{"name": "local", "user": {}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "local"}}]}))
    kubeconfig.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}  # not in-cluster
    router_url = f"http://127.0.0.1:{free_port()}"
    router = subprocess.Popen(
        [sys.executable, "-m", "sgl.launch_router", "--host", "127.0.0.1", "--port", router_url.rsplit(":", 1)[1],
         "--service-discovery", "--selector", "app=sgl-worker", "--service-discovery-namespace", "sgl",
         "--service-discovery-port", str(port), "--policy", "round_robin"],
        cwd=REPO, env={**env, "KUBECONFIG": kubeconfig.name, "PYTHONPATH": REPO}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: _list_workers(router_url), [worker.url], "discovered from the list")
        r = httpx.post(router_url + "/generate", timeout=120,
                       json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text
        live.put(_event("MODIFIED", not_ready))  # readiness probe failed
        _wait_for(lambda: _list_workers(router_url), [], "removed when not Ready")
        live.put(_event("MODIFIED", ready))
        _wait_for(lambda: _list_workers(router_url), [worker.url], "back when Ready")
        live.put(_event("DELETED", ready))
        _wait_for(lambda: _list_workers(router_url), [], "removed when DELETED")
        q = api.requests
        assert [r[1].get("watch") for r in q] == [None, "true"] and q[1][1]["resourceVersion"] == "48400"
    finally:
        live.put(None)
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(30)
        except subprocess.TimeoutExpired:
            router.kill()
        for pid in group_pids(router.pid):
            os.kill(pid, signal.SIGKILL)
        api.close()
        worker.stop()
        os.unlink(kubeconfig.name)
