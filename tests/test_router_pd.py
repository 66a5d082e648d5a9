"""The router in PD mode (a real `python -m sgl.launch_router` subprocess) in front of real
HTTP servers standing in for prefill and decode workers (tests/pd_fake_worker.py: they record
what arrives and answer as scripted). Only the router's own logic: the same body plus the
bootstrap fields on both sides, room shapes, the logprob merge, stream passthrough, retries
with new rooms that close the other side's connection, 4xx passthrough, broken streams,
and the control endpoints over both worker sets."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.pd_fake_worker import DECODE_LOGPROBS, PREFILL_LOGPROBS, FakePdWorker, Step
from tests.router_proc import start_router
from tests.server_proc import ServerProc, free_port

pytestmark = pytest.mark.timeout(120)


def until(pred: Callable[[], bool], what: str, bound: float = 30.0) -> None:
    """Wait for `pred` (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + bound
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def prefill() -> Iterator[FakePdWorker]:
    w = FakePdWorker("prefill")
    yield w
    w.close()


@pytest.fixture(scope="module")
def decode() -> Iterator[FakePdWorker]:
    w = FakePdWorker("decode")
    yield w
    w.close()


@pytest.fixture(scope="module")
def router(prefill: FakePdWorker, decode: FakePdWorker) -> Iterator[ServerProc]:
    r = start_router("--pd-disaggregation", "--prefill", prefill.url, "8998", "--decode", decode.url,
                     "--policy", "round_robin", "--prefill-policy", "cache_aware", "--retry-max-retries", "3",
                     "--retry-initial-backoff-ms", "1", "--disable-circuit-breaker", "--log-level", "warn")
    yield r
    r.stop()


@pytest.fixture
def http(router: ServerProc, prefill: FakePdWorker, decode: FakePdWorker) -> Iterator[httpx.Client]:
    prefill.reset()
    decode.reset()
    with httpx.Client(base_url=router.url, timeout=60) as c:
        yield c


def frames(text: str) -> list[str]:
    return [x[len("data: "):] for x in text.split("\n\n") if x.startswith("data: ")]


def bootstrap(body: dict) -> tuple:
    return body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]


def test_same_body_with_bootstrap_fields_to_both_and_decode_answers(http, prefill, decode):
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}, "foo": [1, 2], "rid": "r1",
            "bootstrap_room": 7, "bootstrap_host": "evil"}
    r = http.post("/generate", json=body, headers={"X-Request-Id": "req-9"})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "decode text" and r.headers["x-request-id"] == "req-9"
    [p], [d] = prefill.bodies(), decode.bodies()
    assert p == d  # the same body, byte for byte as JSON
    host, port, room = bootstrap(p)
    assert (host, port) == ("127.0.0.1", 8998) and isinstance(room, int) and 0 <= room < 2**63 and room != 7
    assert {k: v for k, v in p.items() if not k.startswith("bootstrap_")} == {k: v for k, v in body.items()
                                                                                if not k.startswith("bootstrap_")}
    assert r.json()["meta_info"]["room"] == room
    assert prefill.requests[0][2]["x-request-id"] == decode.requests[0][2]["x-request-id"] == "req-9"
    for path, req in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        out = http.post(path, json=req)
        assert out.status_code == 200 and out.json()["role"] == "decode"
        assert prefill.requests[-1][0] == decode.requests[-1][0] == path
        assert prefill.bodies()[-1] == decode.bodies()[-1] and isinstance(decode.bodies()[-1]["bootstrap_room"], int)


@pytest.mark.parametrize("path, body, k", [
    ("/generate", {"text": ["a", "b", "c"]}, 3),
    ("/generate", {"input_ids": [[1, 2], [3, 4]]}, 2),
    ("/generate", {"text": "a", "sampling_params": {"n": 2}}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 3),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 2}, 2),
    ("/v1/completions", {"prompt": "a", "n": 2}, None),
])
def test_room_shapes(http, prefill, decode, path, body, k):
    assert http.post(path, json=body).status_code == 200
    [p], [d] = prefill.bodies(), decode.bodies()
    assert p == d
    host, port, room = bootstrap(d)
    if k is None:
        assert (host, port) == ("127.0.0.1", 8998) and isinstance(room, int)
    else:
        assert host == ["127.0.0.1"] * k and port == [8998] * k and len(set(room)) == k


def test_logprobs_of_the_prompt_come_from_prefill(http):
    body = {"text": "hi", "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    out = http.post("/generate", json=body).json()
    assert out["meta_info"]["input_token_logprobs"] == PREFILL_LOGPROBS + DECODE_LOGPROBS
    assert out["meta_info"]["role"] == "decode"
    batch = http.post("/generate", json={**body, "text": ["a", "b"]}).json()
    assert [o["meta_info"]["input_token_logprobs"] for o in batch] == [PREFILL_LOGPROBS + DECODE_LOGPROBS] * 2
    plain = http.post("/generate", json={"text": "hi"}).json()
    assert "input_token_logprobs" not in plain["meta_info"]


def test_decode_stream_flows_before_the_prefill_answer_ends(http, prefill, decode):
    prefill_go, decode_go = threading.Event(), threading.Event()
    prefill.reset(Step(hold=prefill_go))
    decode.reset(Step(pause=decode_go))
    got = ""
    with http.stream("POST", "/generate", json={"text": "hi", "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = r.iter_text()
        while "decode-0" not in got:
            got += next(chunks)
        # The first decode frame reached the client while the prefill still holds its answer.
        assert prefill.finished == 0 and decode.finished == 0
        prefill_go.set()
        decode_go.set()
        got += "".join(chunks)
    assert frames(got) == [json.dumps({"text": f"decode-{i}", "index": i}) for i in range(3)] + ["[DONE]"]
    until(lambda: prefill.finished == 1, "the prefill answer was read to its end")
    assert prefill.aborted == 0


def test_wait_for_prefill_holds_the_stream_until_the_prefill_answer_ended(prefill, decode):
    r = start_router("--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
                     "--pd-wait-for-prefill", "--log-level", "warn")
    try:
        prefill.reset(Step(hold_s=0.5))
        decode.reset()
        with httpx.Client(base_url=r.url, timeout=60) as c:
            with c.stream("POST", "/generate", json={"text": "hi", "stream": True}) as resp:
                first = next(resp.iter_text())
                assert "decode-0" in first and prefill.finished == 1
        assert bootstrap(decode.bodies()[0])[1] is None  # `--prefill URL` without a port: null
    finally:
        r.stop()


def test_prefill_failure_closes_decode_and_retries_with_a_new_room(http, prefill, decode):
    prefill.reset(Step(status=500))
    decode.reset(Step(hold_s=60))  # would answer only after a minute: the router must close it
    r = http.post("/generate", json={"text": "hi"})
    assert r.status_code == 200 and r.json()["text"] == "decode text"
    until(lambda: decode.aborted == 1, "the decode request of the failed attempt was closed")
    rooms = [b["bootstrap_room"] for b in decode.bodies()]
    assert len(rooms) == 2 and rooms[0] != rooms[1]
    assert [b["bootstrap_room"] for b in prefill.bodies()] == rooms


def test_decode_failure_closes_prefill_and_retries(http, prefill, decode):
    prefill.reset(Step(hold_s=60))
    decode.reset(Step(status=503))
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": False})
    assert r.status_code == 200 and r.json()["role"] == "decode"
    until(lambda: prefill.aborted == 1, "the prefill request of the failed attempt was closed")
    assert len({b["bootstrap_room"] for b in prefill.bodies()}) == 2


def test_decode_error_event_before_any_byte_is_retried(http, prefill, decode):
    decode.reset(Step(error_event=True))
    with http.stream("POST", "/generate", json={"text": "hi", "stream": True}) as r:
        text = r.read().decode()
    assert r.status_code == 200 and "error" not in text and frames(text)[-1] == "[DONE]"
    assert len(decode.bodies()) == 2


def test_client_errors_pass_through_without_retry(http, prefill, decode):
    err = {"error": {"message": "max_new_tokens must be >= 0", "param": "sampling_params.max_new_tokens"}}
    prefill.reset(Step(hold_s=60))
    decode.reset(Step(status=400, error=err))
    r = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": -1}})
    assert r.status_code == 400 and r.json() == err
    until(lambda: prefill.aborted == 1, "the prefill request was closed")
    # The prefill fails only once the decode holds its request: failing at once could beat
    # the decode request to its worker (seen once in a full run), and a request that never
    # arrived is never aborted.
    decode_has_it = threading.Event()
    prefill.reset(Step(status=400, error=err, hold=decode_has_it))
    decode.reset(Step(hold_s=60))
    threading.Thread(target=lambda: (until(lambda: len(decode.bodies()) == 1, "the decode got the request"),
                                     decode_has_it.set()), daemon=True).start()
    r = http.post("/generate", json={"text": "hi"})
    assert r.status_code == 400 and r.json() == err
    until(lambda: decode.aborted == 1, "the decode request was closed")
    assert len(prefill.bodies()) == len(decode.bodies()) == 1


def test_a_pair_failing_every_attempt_names_the_side(http, prefill, decode):
    prefill.reset(*[Step(status=503)] * 3)
    decode.reset(*[Step(hold_s=60)] * 3)  # a real decode waits for the KV that never comes
    r = http.post("/generate", json={"text": "hi"})
    assert r.status_code == 503
    msg = r.json()["error"]["message"]
    assert "prefill worker " + prefill.url in msg and "prefill failed" in msg
    assert len(prefill.bodies()) == 3 and len({b["bootstrap_room"] for b in prefill.bodies()}) == 3
    until(lambda: decode.aborted == 3, "every attempt's decode request was closed")


def test_broken_decode_stream_ends_with_a_json_error_event(http, prefill, decode):
    decode.reset(Step(frames=3, break_after=1))
    with http.stream("POST", "/generate", json={"text": "hi", "stream": True}) as r:
        text = r.read().decode()
    fs = frames(text)
    assert json.loads(fs[0])["text"] == "decode-0" and fs[-1] == "[DONE]"
    err = json.loads(fs[-2])  # valid JSON, unlike sglang-router 0.3.2's
    assert "worker stream failed" in err["error"]["message"]
    assert len(decode.bodies()) == 1  # bytes had reached the client: no retry


def test_client_that_leaves_closes_both_sides(router, prefill, decode):
    prefill.reset(Step(hold_s=60))
    decode.reset(Step(hold_s=60))
    body = json.dumps({"text": "hi", "stream": True}).encode()
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:  # the router answers nothing before the decode
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        until(lambda: len(decode.bodies()) == 1 and len(prefill.bodies()) == 1, "both sides got the request")
    until(lambda: prefill.aborted == 1 and decode.aborted == 1, "both upstream requests were closed")


def test_control_endpoints_cover_both_sets(http, prefill, decode):
    info = http.get("/get_server_info").json()
    assert info["router"]["mode"] == "pd" and info["router"]["policies"] == {"prefill": "cache_aware",
                                                                             "decode": "round_robin"}
    roles = {w["url"]: (w["role"], w["server_info"]["disaggregation_mode"]) for w in info["workers"]}
    assert roles == {prefill.url: ("prefill", "prefill"), decode.url: ("decode", "decode")}
    assert next(w for w in info["workers"] if w["role"] == "prefill")["bootstrap_port"] == 8998
    flushed = (prefill.flushed, decode.flushed)
    assert http.post("/flush_cache").status_code == 200
    assert (prefill.flushed, decode.flushed) == (flushed[0] + 1, flushed[1] + 1)
    assert http.get("/health").json() == {"status": "ok", "healthy_workers": 2, "healthy_prefill": 1,
                                          "healthy_decode": 1}
    assert http.get("/get_model_info").json()["role"] == "prefill"
    assert http.get("/health_generate").status_code == 200
    assert prefill.bodies()[-1] == decode.bodies()[-1] and "bootstrap_room" in decode.bodies()[-1]
    assert http.post("/add_worker", params={"url": "http://127.0.0.1:1"}).json()["error"]["param"] == "worker_type"
    workers = http.get("/workers").json()
    assert {w["role"] for w in workers["workers"]} == {"prefill", "decode"}


def test_metrics_count_pairs_retries_and_failures_by_side(http, prefill, decode):
    prefill.reset(Step(status=500))
    assert http.post("/generate", json={"text": "hi"}).status_code == 200
    text = http.get("/metrics").text
    pair = f'sgl_router_pd_requests_total{{decode="{decode.url}",outcome="ok",prefill="{prefill.url}"}}'
    assert re.search(re.escape(pair) + r" [1-9]", text)
    assert re.search(r'sgl_router_pd_failures_total\{reason="status",side="prefill"\} [1-9]', text)
    assert re.search(r'sgl_router_retries_total\{route="/generate"\} [1-9]', text)
    assert re.search(r'sgl_router_cache_hits\{policy="cache_aware",role="prefill"\}', text)  # the prefill set's


def test_unhealthy_side_and_failover_to_another_prefill(decode):
    dead = f"http://127.0.0.1:{free_port()}"
    alive = FakePdWorker("prefill")
    localhost = alive.url.replace("127.0.0.1", "localhost")
    r = start_router("--pd-disaggregation", "--prefill", dead, "9000", "--prefill", localhost, "none",
                     "--decode", decode.url, "--policy", "round_robin", "--disable-health-check",
                     "--retry-initial-backoff-ms", "1", "--log-level", "warn")
    try:
        decode.reset()
        with httpx.Client(base_url=r.url, timeout=60) as c:
            for _ in range(2):  # round robin: one of the two starts on the dead prefill
                assert c.post("/generate", json={"text": "hi"}).status_code == 200
            assert all(bootstrap(b)[:2] == ("localhost", None) for b in alive.bodies())
            ok = [b for b in decode.bodies() if b in alive.bodies()]
            assert len(ok) == 2  # the decode's answered attempts are the ones paired with the live prefill
            assert 'sgl_router_pd_failures_total{reason="connection",side="prefill"}' in c.get("/metrics").text
    finally:
        r.stop()
        alive.close()
    r = start_router("--pd-disaggregation", "--prefill", dead, "--decode", decode.url,
                     "--worker-startup-timeout-secs", "1", "--log-level", "warn")
    try:
        h = httpx.get(r.url + "/health", timeout=10)
        assert h.status_code == 503 and "no healthy prefill workers" in h.json()["message"]
        g = httpx.post(r.url + "/generate", json={"text": "hi"}, timeout=30)
        assert g.status_code == 503 and "prefill" in g.json()["error"]["message"]
    finally:
        r.stop()


def test_kv_aware_prefill_policy_and_workers_added_by_role(prefill, decode):
    r = start_router("--pd-disaggregation", "--prefill", prefill.url, "8998", "--decode", decode.url,
                     "--prefill-policy", "kv_aware", "--decode-policy", "cache_aware", "--log-level", "warn")
    extra = FakePdWorker("decode")
    try:
        prefill.reset()
        decode.reset()
        with httpx.Client(base_url=r.url, timeout=60) as c:
            assert c.post("/generate", json={"text": "hi"}).status_code == 200
            assert c.get("/workers").json()["policies"] == {"prefill": "kv_aware", "decode": "cache_aware"}
            bad = c.post("/add_worker", params={"url": extra.url, "worker_type": "decode", "bootstrap_port": "9"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "bootstrap_port"
            assert c.post("/add_worker", params={"url": extra.url, "worker_type": "decode"}).status_code == 200
            roles = {w["url"]: w["role"] for w in c.get("/workers").json()["workers"]}
            assert roles == {prefill.url: "prefill", decode.url: "decode", extra.url: "decode"}
            for i in range(4):  # cache_aware spreads new prompts over both decode workers
                assert c.post("/generate", json={"text": f"prompt {i} " * 8}).status_code == 200
            assert extra.bodies() and decode.bodies()
            assert c.post("/remove_worker", params={"url": extra.url}).status_code == 200
            assert extra.url not in c.get("/list_workers").json()["urls"]
    finally:
        r.stop()
        extra.close()


def test_every_attempt_was_settled(router, prefill, decode):
    """After all of the above (streams, retries, 4xx, broken streams, clients that left), the
    router holds no admission slot and counts nothing in flight on either worker."""
    def settled() -> bool:
        text = httpx.get(router.url + "/metrics", timeout=30).text
        return ("sgl_router_admission_active 0.0" in text
                and f'sgl_router_worker_in_flight{{worker="{prefill.url}"}} 0.0' in text
                and f'sgl_router_worker_in_flight{{worker="{decode.url}"}} 0.0' in text)

    until(settled, "no slot held and nothing in flight")
