"""The router in front of two real workers (real subprocesses, embedded model): every
proxied endpoint, SSE passthrough, auth, request ids, metrics, the `openai` client and
SGLang's own `RuntimeEndpoint` through it, add/remove worker, queue full -> 429, and no
workers -> 503. The workers share the router's API key, which the router sends them.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.router_proc import start_router
from tests.server_proc import start_server

pytestmark = [pytest.mark.server, pytest.mark.model]

KEY = "router-key-1"
GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def workers():
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        procs = list(ex.map(lambda _: start_server("--max-total-tokens", "4096", api_key=KEY), range(2)))
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def router(workers):
    r = start_router("--worker-urls", *[w.url for w in workers], "--health-check-interval-secs", "1",
                     "--worker-startup-timeout-secs", "3", api_key=KEY)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def http(router):
    with httpx.Client(base_url=router.url, headers=router.headers(), timeout=120) as c:
        yield c


def frames(text: str) -> list[str]:
    return [x[len("data: "):] for x in text.split("\n\n") if x.startswith("data: ")]


def test_generate_request_id_and_batch(http):
    r = http.post("/generate", json={"text": "The capital of France is", "sampling_params": GREEDY},
                  headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["text"] and r.headers["x-request-id"] == "abc-123"
    outs = http.post("/generate", json={"text": ["One, two,", "A, B,"], "sampling_params": GREEDY}).json()
    assert isinstance(outs, list) and len(outs) == 2 and all(o["meta_info"]["completion_tokens"] == 6 for o in outs)
    ids = http.post("/generate", json={"input_ids": [504, 3575, 282], "sampling_params": GREEDY}).json()
    assert ids["meta_info"]["prompt_tokens"] == 3


def test_generate_stream_is_passed_through_unbuffered(http, workers):
    # Long enough to still be running when the first frame arrives (a step is ~14 ms here).
    body = {"text": "Count: 1, 2, 3,", "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    running_at_first_frame = None
    text = ""
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_text():
            if running_at_first_frame is None and "data: {" in chunk:
                # The worker is still generating when the first frame reached us: not buffered.
                running_at_first_frame = sum(
                    httpx.get(w.url + "/get_server_info", headers=w.headers()).json()["num_running_reqs"]
                    for w in workers)
            text += chunk
    assert running_at_first_frame and running_at_first_frame >= 1
    fs = frames(text)
    assert fs[-1] == "[DONE]" and len(fs) >= 3
    last = json.loads(fs[-2])
    assert last["meta_info"]["completion_tokens"] == 200


def test_openai_client_completions_chat_and_stream(router):
    from openai import OpenAI

    client = OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert "Paris" in comp.choices[0].text
    chat = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Which city is the capital of France?"}])
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, max_tokens=8, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Which city is the capital of France?"}]) if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content


def test_info_endpoints(http, workers):
    models = http.get("/v1/models").json()
    assert models["data"] and models["data"][0]["id"]
    info = http.get("/get_model_info").json()
    assert info["model_path"] and info["is_generation"] is True
    si = http.get("/get_server_info").json()
    assert si["router"]["policy"] == "cache_aware" and si["router"]["config"]["api_key"] == "***"
    # The router fetched the workers' tokenizer (with its key): chats are routed on the rendered template.
    assert si["router"]["chat_routing"] == "template"
    assert sorted(w["url"] for w in si["workers"]) == sorted(w.url for w in workers)
    assert all(w["server_info"]["max_total_tokens"] == 4096 for w in si["workers"])
    assert si["max_total_tokens"] == 4096  # the first worker's info at the top, as SGLang clients read it
    assert http.post("/flush_cache").status_code == 200
    assert http.get("/health_generate").status_code == 200
    h = http.get("/health").json()
    assert h == {"status": "ok", "healthy_workers": 2}
    ws = http.get("/workers").json()
    assert sorted(ws["healthy"]) == sorted(w.url for w in workers)
    assert http.get("/list_workers").json()["urls"]


def test_auth_and_bad_requests(router, http):
    for method, path in (("POST", "/generate"), ("GET", "/workers"), ("GET", "/metrics"), ("GET", "/v1/models")):
        r = httpx.request(method, router.url + path, json={} if method == "POST" else None)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(router.url + "/health").status_code == 200
    r = http.post("/generate", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
    assert r.status_code == 400  # the worker's own validation error comes through unchanged
    assert http.get("/nope").status_code == 404


def test_metrics(http, workers):
    http.post("/generate", json={"text": "Hello there", "sampling_params": GREEDY})
    text = http.get("/metrics").text
    assert re.search(r'^sgl_router_requests_total\{route="/generate",status="200"\} [1-9]', text, re.M)
    assert 'sgl_router_request_duration_seconds_bucket{le="+Inf",route="/generate"}' in text
    for w in workers:
        assert f'sgl_router_worker_in_flight{{worker="{w.url}"}} 0.0' in text
        assert f'sgl_router_circuit_state{{worker="{w.url}"}} 0.0' in text
        assert f'sgl_router_worker_healthy{{worker="{w.url}"}} 1.0' in text
    assert re.search(r"^sgl_router_healthy_workers 2\.0$", text, re.M)
    assert re.search(r'^sgl_router_cache_hits\{policy="cache_aware"\} ', text, re.M)
    assert re.search(r'^sgl_router_tree_size\{policy="cache_aware"\} [1-9]', text, re.M)
    assert "sgl_router_retries_total" in text or "sgl_router_retries" in text


def test_sglang_runtime_endpoint_through_router(router):
    from tests.test_server_native import FRONTEND_PROGRAM, _sglang_dir

    target = _sglang_dir()
    r = subprocess.run([sys.executable, "-c", FRONTEND_PROGRAM, target, router.url, KEY],
                       capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir())
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads([x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert "Paris" in out["answer"] and out["city"] == "Paris"
    assert re.fullmatch(r"1[89][0-9]{2}", out["year"])


def test_remove_worker_finishes_its_requests_then_add_back(router, http, workers):
    assert http.post("/add_worker", params={"url": "nonsense"}).status_code == 400
    assert http.post("/add_worker", params={"url": workers[0].url}).status_code == 400  # already there
    assert http.post("/remove_worker", params={"url": "http://127.0.0.1:9"}).status_code == 404
    body = {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as r:
        chunks = r.iter_text()
        text = next(chunks)
        busy = [w["url"] for w in http.get("/workers").json()["workers"] if w["in_flight"] == 1]
        assert len(busy) == 1
        assert http.post("/remove_worker", params={"url": busy[0]}).status_code == 200
        assert busy[0] not in http.get("/list_workers").json()["urls"]
        text += "".join(chunks)
    fs = frames(text)
    assert fs[-1] == "[DONE]" and json.loads(fs[-2])["meta_info"]["completion_tokens"] == 16
    assert not any('"error"' in f for f in fs)
    for _ in range(3):  # everything goes to the one left
        assert http.post("/generate", json={"text": "Hi", "sampling_params": GREEDY}).status_code == 200
    r = http.post("/add_worker", params={"url": busy[0]})
    assert r.status_code == 200, r.text
    assert sorted(http.get("/workers").json()["healthy"]) == sorted(w.url for w in workers)
    r = http.post("/add_worker", params={"url": "http://127.0.0.1:9"})  # nothing listens there
    assert r.status_code == 503 and "health check" in r.json()["error"]["message"]


def one_slot_router(worker):  # noqa: ANN001, ANN201
    """A router admitting one generation at a time, with one place in its queue."""
    return start_router("--worker-urls", worker.url, "--max-concurrent-requests", "1", "--queue-size", "1",
                        "--policy", "round_robin", api_key=KEY)


def test_queue_full_429(workers):
    r = one_slot_router(workers[0])
    try:
        with httpx.Client(base_url=r.url, headers=r.headers(), timeout=120) as c, \
                concurrent.futures.ThreadPoolExecutor(1) as ex:
            body = {"text": "Tell me a story", "stream": True,
                    "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
            with c.stream("POST", "/generate", json=body) as s:
                chunks = s.iter_text()
                next(chunks)  # the stream holds the only slot
                queued = ex.submit(c.post, "/generate", json={"text": "Hi", "sampling_params": GREEDY})
                deadline = time.time() + 30
                while "sgl_router_admission_queued 1.0" not in c.get("/metrics").text:
                    assert time.time() < deadline and not queued.done()
                    time.sleep(0.05)
                full = c.post("/generate", json={"text": "Hi", "sampling_params": GREEDY})
                assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
                assert "".join(chunks).rstrip().endswith("data: [DONE]")
            assert queued.result().status_code == 200  # it got the slot when the stream ended
            assert 'sgl_router_admission_rejected_total{reason="queue_full"} 1.0' in c.get("/metrics").text
    finally:
        r.stop()


@pytest.mark.parametrize("policy", ["round_robin", "random", "power_of_two", "kv_aware"])
def test_other_policies_route(workers, policy):
    r = start_router("--worker-urls", *[w.url for w in workers], "--policy", policy, api_key=KEY)
    try:
        with httpx.Client(base_url=r.url, headers=r.headers(), timeout=120) as c:
            for i in range(3):
                g = c.post("/generate", json={"text": f"Hello {i}", "sampling_params": {"max_new_tokens": 2}})
                assert g.status_code == 200, g.text
            chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 2})
            assert chat.status_code == 200, chat.text
            assert 'sgl_router_requests_total{route="/generate",status="200"} 3.0' in c.get("/metrics").text
            if policy in ("power_of_two", "kv_aware"):  # their own /get_load calls carry the workers' key
                assert _eventually_positive(c, f'sgl_router_load_polls_ok{{policy="{policy}"}}')
    finally:
        r.stop()


def _eventually_positive(c: httpx.Client, series: str, wait_s: float = 60) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for line in c.get("/metrics").text.splitlines():
            if line.startswith(series + " ") and float(line.split()[-1]) > 0:
                return True
        time.sleep(0.2)
    return False


def test_client_that_leaves_aborts_the_worker_request(http, workers):
    def running() -> int:
        return sum(httpx.get(w.url + "/get_server_info", headers=w.headers()).json()["num_running_reqs"]
                   for w in workers)

    long = {"max_new_tokens": 2000, "ignore_eos": True}
    for stream in (False, True):
        with httpx.Client(base_url=http.base_url, headers=http.headers, timeout=httpx.Timeout(60, read=1.5)) as c:
            if stream:  # read the first frame, then hang up
                with c.stream("POST", "/generate", json={"text": "Go on", "stream": True, "sampling_params": long}) as r:
                    assert next(r.iter_raw())
            else:  # give up waiting for the answer
                with pytest.raises(httpx.ReadTimeout):
                    c.post("/generate", json={"text": "Go on and on", "sampling_params": long})
        deadline = time.time() + 30
        while running() or any(w["in_flight"] for w in http.get("/workers").json()["workers"]):
            assert time.time() < deadline, "the worker kept generating for a client that left"
            time.sleep(0.1)


def test_no_workers_503():
    from tests.server_proc import free_port

    prom = free_port()
    r = start_router("--worker-startup-timeout-secs", "1", "--prometheus-port", str(prom), api_key=KEY)
    try:
        assert httpx.get(r.url + "/health").status_code == 503
        g = httpx.post(r.url + "/generate", json={"text": "Hi"}, headers=r.headers())
        assert g.status_code == 503 and "no workers" in g.json()["error"]["message"]
        assert httpx.get(r.url + "/v1/models", headers=r.headers()).status_code == 503
        # The separate metrics listener answers without the key.
        text = httpx.get(f"http://127.0.0.1:{prom}/metrics").text
        assert 'sgl_router_requests_total{route="/generate",status="503"} 1.0' in text
    finally:
        r.stop()


def test_dead_worker_without_health_checks_retries_then_502_and_opens_circuit():
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    r = start_router("--worker-urls", dead, "--disable-health-check", "--retry-max-retries", "3",
                     "--retry-initial-backoff-ms", "1", "--cb-failure-threshold", "3")
    try:
        assert httpx.get(r.url + "/workers").json()["healthy"] == [dead]  # no startup check either
        g = httpx.post(r.url + "/generate", json={"text": "Hi"})
        assert g.status_code == 502 and "all 3 attempt(s) failed" in g.json()["error"]["message"]
        text = httpx.get(r.url + "/metrics").text
        assert 'sgl_router_retries_total{route="/generate"} 2.0' in text
        assert f'sgl_router_circuit_state{{worker="{dead}"}} 1.0' in text  # 3 failures opened it
        g = httpx.post(r.url + "/generate", json={"text": "Hi"})
        assert g.status_code == 503 and "circuit" in g.json()["error"]["message"]
    finally:
        r.stop()


def test_a_client_that_leaves_while_queued_frees_its_place(workers):
    r = one_slot_router(workers[0])
    try:
        with httpx.Client(base_url=r.url, headers=r.headers(), timeout=120) as c, \
                concurrent.futures.ThreadPoolExecutor(1) as ex:
            body = {"text": "Tell me a story", "stream": True,  # long enough to hold the slot throughout
                    "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
            with c.stream("POST", "/generate", json=body) as s:
                chunks = s.iter_text()
                next(chunks)  # the stream holds the only slot
                with pytest.raises(httpx.TimeoutException):  # queued, then gone
                    with httpx.Client(base_url=r.url, headers=r.headers(), timeout=1.0) as impatient:
                        impatient.post("/generate", json={"text": "Hi", "sampling_params": GREEDY})
                deadline = time.time() + 30
                while "sgl_router_admission_queued 0.0" not in c.get("/metrics").text:
                    assert time.time() < deadline, "the departed client still holds its place"
                    time.sleep(0.05)
                queued = ex.submit(c.post, "/generate", json={"text": "Hi", "sampling_params": GREEDY})
                while "sgl_router_admission_queued 1.0" not in c.get("/metrics").text:
                    assert time.time() < deadline and not queued.done()
                    time.sleep(0.05)
                assert "".join(chunks).rstrip().endswith("data: [DONE]")
            assert queued.result().status_code == 200  # the queue's one place was free for it
    finally:
        r.stop()
