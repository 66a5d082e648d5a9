"""Our router in PD mode (`python -m sgl.launch_router --pd-disaggregation`) in front of a
real prefill and a real decode worker, and a colocated worker to compare with (real
subprocesses on loopback, tests/pd_procs.py).

Greedy outputs through the router equal the colocated worker's on eight prompts: plain
/generate, return_logprob (the router puts the prefill's prompt logprobs before the
decode's), a JSON-schema constraint, n=2, a streamed /generate, /v1/completions, and a
two-turn chat whose second turn (streamed) reuses the decode worker's cache (it moves few
tokens). Then the prefill worker is killed while it holds a room the decode waits for: the
request ends with a clear error naming the prefill (the only prefill is gone, so every
retry fails too), the decode frees what it reserved, and once a prefill is back where it
was the router brings it into rotation and requests succeed; afterwards both workers hold
no KV but their caches (invariants checked in the workers).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from tests.pd_procs import (assert_kv_free, decode_flags, kill_group, prefill_flags, server_info,
                            start_pd_workers, wait_until, worker_call)
from tests.router_proc import start_router
from tests.server_proc import free_port, start_server

pytestmark = [pytest.mark.server, pytest.mark.model, pytest.mark.slow]

GREEDY = {"temperature": 0, "max_new_tokens": 12}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
DECODE_TIMEOUT = 10  # seconds the decode waits for KV


@pytest.fixture(scope="module")
def cluster():
    bport = free_port()
    prefill, decode, colocated = start_pd_workers(
        prefill_flags(bport), decode_flags(bport, "--disaggregation-timeout", str(DECODE_TIMEOUT)), ())
    procs: dict[str, Any] = {"p": prefill, "d": decode, "c": colocated, "bport": bport}
    try:
        procs["router"] = start_router(
            "--pd-disaggregation", "--prefill", prefill.url, str(bport), "--decode", decode.url,
            "--prefill-policy", "cache_aware", "--decode-policy", "cache_aware", "--retry-max-retries", "3",
            "--health-check-interval-secs", "1", "--health-success-threshold", "1")
        yield procs
    finally:
        if "router" in procs:
            procs["router"].stop()
        for key in ("p", "d", "c"):
            procs[key].stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=180)


def both(cluster: dict, path: str, body: dict) -> tuple[Any, Any]:
    """(colocated answer, answer through our PD router), both 200."""
    c = post(cluster["c"].url, path, body)
    r = post(cluster["router"].url, path, body)
    assert c.status_code == 200, c.text
    assert r.status_code == 200, (r.text, cluster["router"].log()[-3000:])
    return c.json(), r.json()


def sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=180) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_eight_prompts_equal_the_colocated_worker(cluster):
    bport = cluster["bport"]
    # 1. plain
    c, r = both(cluster, "/generate", {"text": "The capital of France is", "sampling_params": GREEDY})
    assert r["text"] == c["text"] and r["output_ids"] == c["output_ids"]
    m = r["meta_info"]
    assert m["prefill_worker"] == f"127.0.0.1:{bport}" and m["kv_transfer_tokens"] == m["prompt_tokens"]
    # 2. return_logprob: the prompt's logprobs come from the prefill, merged by the router
    body = {"text": "List three fruits:", "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0}
    c, r = both(cluster, "/generate", body)
    assert r["output_ids"] == c["output_ids"]
    cm, rm = c["meta_info"], r["meta_info"]
    assert [e[1] for e in rm["input_token_logprobs"]] == [e[1] for e in cm["input_token_logprobs"]]
    for a, b in zip(rm["input_token_logprobs"][1:] + rm["output_token_logprobs"],
                    cm["input_token_logprobs"][1:] + cm["output_token_logprobs"]):
        assert a[1] == b[1] and a[0] == pytest.approx(b[0], abs=0.05)
    # 3. JSON schema
    body = {"text": "Give a person as JSON:",
            "sampling_params": {**GREEDY, "max_new_tokens": 16, "json_schema": json.dumps(SCHEMA)}}
    c, r = both(cluster, "/generate", body)
    assert r["text"] == c["text"] and r["output_ids"] == c["output_ids"]
    # 4. n = 2 (one scalar room from the router; the workers derive one per sample)
    c, r = both(cluster, "/generate", {"text": "Once upon a time", "sampling_params": {**GREEDY, "n": 2}})
    assert isinstance(r, list) and [x["output_ids"] for x in r] == [x["output_ids"] for x in c]
    # 5. a streamed /generate: the decode's frames, passed through
    body = {"text": "Count: one, two,", "sampling_params": GREEDY, "stream": True}
    c5, r5 = sse(cluster["c"].url, "/generate", body), sse(cluster["router"].url, "/generate", body)
    assert r5[-1]["text"] == c5[-1]["text"] and r5[-1]["output_ids"] == c5[-1]["output_ids"]
    # 6. /v1/completions
    c, r = both(cluster, "/v1/completions", {"prompt": "The sky is", "max_tokens": 10, "temperature": 0})
    assert r["choices"][0]["text"] == c["choices"][0]["text"]
    # 7. + 8. a two-turn chat; the second turn reuses the decode worker's cache
    turn1 = [{"role": "user", "content": "Name a color."}]
    c, r = both(cluster, "/v1/chat/completions", {"messages": turn1, "max_tokens": 8, "temperature": 0})
    answer = r["choices"][0]["message"]["content"]
    assert answer == c["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And another one?"}]
    body = {"messages": turn2, "max_tokens": 8, "temperature": 0, "stream": True}
    before = server_info(cluster["d"])
    c8, r8 = sse(cluster["c"].url, "/v1/chat/completions", body), sse(cluster["router"].url, "/v1/chat/completions",
                                                                        body)

    def text(chunks: list[dict]) -> str:
        return "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])

    assert text(r8) == text(c8) and text(r8)
    after = server_info(cluster["d"])
    usage = post(cluster["c"].url, "/v1/chat/completions", {**body, "stream": False, "max_tokens": 1}).json()["usage"]
    moved = after["pd_transfer_tokens_total"] - before["pd_transfer_tokens_total"]
    assert after["pd_transfers_total"] - before["pd_transfers_total"] == 1
    assert 0 < moved < usage["prompt_tokens"] // 2, (moved, usage)
    metrics = httpx.get(cluster["router"].url + "/metrics", timeout=30).text
    assert f'sgl_router_pd_requests_total{{decode="{cluster["d"].url}",outcome="ok",prefill="{cluster["p"].url}"}}' \
        in metrics
    for key in ("p", "d"):
        assert_kv_free(cluster[key])


class Post(threading.Thread):
    """A request through the router in the background; `.status` / `.json` once done."""

    def __init__(self, url: str, payload: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.payload = url, payload
        self.status: int | None = None
        self.json: Any = None
        self.start()

    def run(self) -> None:
        r = httpx.post(self.url + "/generate", json=self.payload, timeout=180)
        self.status, self.json = r.status_code, r.json()


def test_prefill_killed_mid_request_clear_error_kv_freed_then_back(cluster):
    p, d, router = cluster["p"], cluster["d"], cluster["router"]
    body = {"text": "Write one sentence about the sea.", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    worker_call(p, "pd_fault", "hold_sends")  # the prefill computes but does not send: the kill lands mid-transfer
    req = Post(router.url, body)
    wait_until(lambda: server_info(p)["pd_rooms_pulled"] == 1, 60, "the decode to pull the room the prefill holds")
    kill_group(p)
    req.join(DECODE_TIMEOUT + 60)
    assert not req.is_alive(), "the request through the router hung"
    assert req.status in (502, 503), req.json
    assert "prefill" in req.json["error"]["message"], req.json
    wait_until(lambda: server_info(d)["pd_rooms_held"] == 0, 30, "the decode to drop the room")
    assert_kv_free(d)  # every slot it reserved for the failed attempts is back
    metrics = httpx.get(router.url + "/metrics", timeout=30).text
    assert 'side="prefill"' in metrics and "sgl_router_pd_failures_total" in metrics
    # a prefill back where it was: the health checks bring it into rotation, requests succeed
    cluster["p"] = start_server("--max-total-tokens", "4096", "--enable-debug-calls",
                                *prefill_flags(cluster["bport"]), port=int(p.url.rsplit(":", 1)[1]))
    wait_until(lambda: httpx.get(router.url + "/health", timeout=10).status_code == 200, 60,
               "the router to see a prefill again")
    c, r = both(cluster, "/generate", body)
    assert r["output_ids"] == c["output_ids"] and r["meta_info"]["prefill_worker"] == f"127.0.0.1:{cluster['bport']}"
    assert_kv_free(cluster["p"])
    assert_kv_free(d)
