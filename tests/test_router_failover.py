"""Failover over three real workers: SIGKILL one (its whole process group) while 48
non-streaming requests and three streams are in flight through the router.

All 48 requests succeed (those on the dead worker are retried on the others, since no byte
of their answer had reached the client); the stream that was flowing from the dead worker
ends with an SSE error event and `data: [DONE]` (no hang), the other two finish normally;
and the dead worker leaves the healthy set of /workers.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from tests.router_proc import start_router
from tests.server_proc import start_server

pytestmark = [pytest.mark.server, pytest.mark.model, pytest.mark.slow]

N_REQUESTS = 48
STREAM_TOKENS = 600


@pytest.fixture(scope="module")
def workers():
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        procs = list(ex.map(lambda _: start_server("--max-total-tokens", "4096"), range(3)))
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def router(workers):
    # round_robin: three consecutive streams land on three different workers.
    r = start_router("--worker-urls", *[w.url for w in workers], "--policy", "round_robin",
                     "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                     "--retry-initial-backoff-ms", "20")
    yield r
    r.stop()


def _read_stream(resp: httpx.Response) -> str:
    return "".join(resp.iter_text())


def test_kill_one_of_three_under_load(router, workers):
    victim = workers[1]
    client = httpx.Client(base_url=router.url, timeout=httpx.Timeout(180))
    try:
        assert client.post("/generate", json={"text": "warm up", "sampling_params": {"max_new_tokens": 1}}
                           ).status_code == 200
        # Long enough to be still running when the victim dies, on a fast decode step too.
        stream_body = {"text": "Write a long list of fruits:", "stream": True,
                       "sampling_params": {"max_new_tokens": STREAM_TOKENS, "ignore_eos": True}}
        streams, firsts = [], []
        for _ in range(3):
            s = client.send(client.build_request("POST", "/generate", json=stream_body), stream=True)
            assert s.status_code == 200
            it = s.iter_text()
            firsts.append(next(it))  # bytes are flowing on each stream
            streams.append((s, it))
        busy = {w["url"]: w["in_flight"] for w in client.get("/workers").json()["workers"]}
        assert all(busy[w.url] == 1 for w in workers), busy

        def one(i: int) -> httpx.Response:
            return httpx.post(router.url + "/generate", timeout=180,
                              json={"text": f"Request {i}: the number after {i} is",
                                    "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})

        with concurrent.futures.ThreadPoolExecutor(N_REQUESTS) as ex:
            futures = [ex.submit(one, i) for i in range(N_REQUESTS)]
            deadline = time.time() + 60
            while True:  # wait until the victim holds some of the 48 (besides its stream)
                in_flight = {w["url"]: w["in_flight"] for w in client.get("/workers").json()["workers"]}
                if in_flight[victim.url] >= 3:
                    break
                assert time.time() < deadline, in_flight
                time.sleep(0.02)
            os.killpg(victim.proc.pid, signal.SIGKILL)
            results = [f.result() for f in futures]

        assert [r.status_code for r in results] == [200] * N_REQUESTS, [r.text for r in results if r.status_code != 200]
        assert all(r.json()["meta_info"]["completion_tokens"] == 8 for r in results)

        ends = []
        for (s, it), first in zip(streams, firsts):
            text = first + "".join(it)
            s.close()
            fs = [x[len("data: "):] for x in text.split("\n\n") if x.startswith("data: ")]
            assert fs[-1] == "[DONE]", text[-500:]
            errors = [json.loads(f)["error"] for f in fs[:-1] if '"error"' in f]
            ends.append("error" if errors else json.loads(fs[-2])["meta_info"]["completion_tokens"])
        assert sorted(ends, key=str) == [STREAM_TOKENS, STREAM_TOKENS, "error"], ends

        deadline = time.time() + 30
        while victim.url in client.get("/workers").json()["healthy"]:
            assert time.time() < deadline, "the killed worker stayed in the healthy set"
            time.sleep(0.2)
        healthy = client.get("/workers").json()["healthy"]
        assert sorted(healthy) == sorted(w.url for w in workers if w is not victim)
        metrics = client.get("/metrics").text
        assert f'sgl_router_worker_healthy{{worker="{victim.url}"}} 0.0' in metrics
        assert "sgl_router_retries_total" in metrics
        # New requests keep working on the two that are left.
        for i in range(4):
            assert client.post("/generate", json={"text": f"after {i}", "sampling_params": {"max_new_tokens": 2}}
                               ).status_code == 200
    finally:
        client.close()
