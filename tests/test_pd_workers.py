"""A prefill and a decode worker behind the real sglang-router 0.3.2 in PD mode give the
colocated worker's greedy outputs, and report their transfers.

One prefill (`--disaggregation-mode prefill`, bootstrap port B), one decode (`decode`,
its default bootstrap port also B) and one colocated worker, real processes on loopback;
sglang-router `--pd-disaggregation --prefill P B --decode D` in front of the pair (it
sends the same body, with bootstrap_host/port/room, to both; the client gets the
decode's answer). Eight prompts: plain /generate, return_logprob (the router merges the
prefill's prompt logprobs into the decode's answer), a JSON-schema constraint, n=2, a
streamed /generate, /v1/completions, and a two-turn /v1/chat conversation (the second
turn streamed) whose second turn reuses the decode worker's own cache, seen in how few
tokens it transferred. Afterwards both workers hold no KV but their caches.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.pd_procs import (PDRouter, assert_kv_free, decode_flags, prefill_flags, server_info,
                            start_pd_workers, worker_call)
from tests.server_proc import free_port
from tests.test_server_router_compat import _router_dir

pytestmark = [pytest.mark.server, pytest.mark.model]

GREEDY = {"temperature": 0, "max_new_tokens": 8}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def cluster():
    bport = free_port()
    pkg = _router_dir()  # skips the module if sglang-router cannot be installed
    prefill, decode, colocated = start_pd_workers(prefill_flags(bport), decode_flags(bport), ())
    router = None
    try:
        router = PDRouter(pkg, prefill, bport, decode)
        router.wait_ready()
        yield {"p": prefill, "d": decode, "c": colocated, "router": router, "bport": bport}
    finally:
        if router is not None:
            router.stop()
        for s in (prefill, decode, colocated):
            s.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=180)


def both(cluster, path: str, body: dict) -> tuple[dict, dict]:
    """(colocated answer, answer through the PD router), both 200 (asked at once: they
    run on different workers)."""
    with ThreadPoolExecutor(2) as ex:
        fc = ex.submit(post, cluster["c"].url, path, body)
        fr = ex.submit(post, cluster["router"].url, path, body)
        c, r = fc.result(), fr.result()
    assert c.status_code == 200, c.text
    assert r.status_code == 200, (r.text, cluster["router"].log())
    return c.json(), r.json()


def test_workers_report_their_mode_and_refuse_requests_without_a_room(cluster):
    bport = cluster["bport"]
    for key, mode in (("p", "prefill"), ("d", "decode"), ("c", "null")):
        info = httpx.get(cluster[key].url + "/server_info", timeout=60).json()
        assert info["disaggregation_mode"] == mode
        assert httpx.get(cluster[key].url + "/model_info", timeout=30).status_code == 200
    for key in ("p", "d"):
        for path, body in (("/generate", {"text": "hi"}), ("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = post(cluster[key].url, path, body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room", r.text
        r = post(cluster[key].url, "/generate", {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": bport,
                                                 "bootstrap_room": -5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"
    # the router's default-filled fields are accepted (colocated worker, as a regular router sends them)
    r = post(cluster["c"].url, "/generate", {"text": "hi", "model": None, "sampling_params": {"max_new_tokens": 2},
                                             "log_metrics": True, "background": False, "no_logs": False,
                                             "return_hidden_states": False, "bootstrap_host": "x",
                                             "bootstrap_port": None, "bootstrap_room": 5})
    assert r.status_code == 200, r.text


def test_generate_plain_and_logprobs(cluster):
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    c, r = both(cluster, "/generate", body)
    assert r["text"] == c["text"] and r["output_ids"] == c["output_ids"]
    m = r["meta_info"]
    assert m["prefill_worker"] == f"127.0.0.1:{cluster['bport']}"
    assert m["kv_transfer_tokens"] == m["prompt_tokens"] and m["kv_transfer_bytes"] > 0 and m["kv_transfer_ms"] >= 0
    assert 0 <= m["kv_copy_ms"] <= m["kv_transfer_ms"] + 50  # one host's clock: the copy is part of the wait
    body = {"text": "List three fruits:", "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0}
    c, r = both(cluster, "/generate", body)
    assert r["output_ids"] == c["output_ids"]
    cm, rm = c["meta_info"], r["meta_info"]
    # the router prepends the prefill's prompt logprobs to the decode's (an empty list)
    assert [e[1] for e in rm["input_token_logprobs"]] == [e[1] for e in cm["input_token_logprobs"]]
    assert rm["input_token_logprobs"][0][0] is None
    for a, b in zip(rm["input_token_logprobs"][1:] + rm["output_token_logprobs"],
                    cm["input_token_logprobs"][1:] + cm["output_token_logprobs"]):
        assert a[1] == b[1] and a[0] == pytest.approx(b[0], abs=0.05)


def test_json_schema_and_n2(cluster):
    body = {"text": "Give a person as JSON:", "sampling_params": {**GREEDY, "max_new_tokens": 12,
                                                                  "json_schema": json.dumps(SCHEMA)}}
    c, r = both(cluster, "/generate", body)
    assert r["text"] == c["text"] and r["output_ids"] == c["output_ids"]
    if r["meta_info"]["finish_reason"]["type"] == "stop":
        assert set(json.loads(r["text"])) == {"name", "age"}
    body = {"text": "Once upon a time", "sampling_params": {**GREEDY, "n": 2}}
    c, r = both(cluster, "/generate", body)
    assert isinstance(r, list) and len(r) == 2
    assert [x["output_ids"] for x in r] == [x["output_ids"] for x in c]
    assert r[0]["meta_info"]["bootstrap_room"] != r[1]["meta_info"]["bootstrap_room"]


def _sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=180) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def _both_sse(cluster, path: str, body: dict) -> tuple[list[dict], list[dict]]:
    with ThreadPoolExecutor(2) as ex:
        fc = ex.submit(_sse, cluster["c"].url, path, body)
        fr = ex.submit(_sse, cluster["router"].url, path, body)
        return fc.result(), fr.result()


def test_generate_stream_and_completions(cluster):
    body = {"text": "Count: one, two,", "sampling_params": GREEDY, "stream": True}
    c, r = _both_sse(cluster, "/generate", body)
    assert r[-1]["text"] == c[-1]["text"] and r[-1]["output_ids"] == c[-1]["output_ids"]
    assert r[-1]["meta_info"]["kv_transfer_tokens"] > 0
    body = {"prompt": "The sky is", "max_tokens": 10, "temperature": 0, "model": "default"}
    c, r = both(cluster, "/v1/completions", body)
    assert r["choices"][0]["text"] == c["choices"][0]["text"]


def test_chat_two_turns_second_hits_the_decode_cache(cluster):
    turn1 = [{"role": "user", "content": "Name a color."}]
    body = {"messages": turn1, "max_tokens": 8, "temperature": 0}
    c, r = both(cluster, "/v1/chat/completions", body)
    answer = r["choices"][0]["message"]["content"]
    assert answer == c["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And another one?"}]
    before = server_info(cluster["d"])
    body = {"messages": turn2, "max_tokens": 8, "temperature": 0, "stream": True}
    c, r = _both_sse(cluster, "/v1/chat/completions", body)

    def text(chunks: list[dict]) -> str:
        return "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])

    assert text(r) == text(c) and text(r)
    after = server_info(cluster["d"])
    prompt2 = post(cluster["c"].url, "/v1/chat/completions", {**body, "stream": False, "max_tokens": 1}).json()
    prompt_tokens = prompt2["usage"]["prompt_tokens"]
    moved = after["pd_transfer_tokens_total"] - before["pd_transfer_tokens_total"]
    assert after["pd_transfers_total"] - before["pd_transfers_total"] == 1
    # turn one's prompt and answer were in the decode's radix tree: only the new part moved
    assert 0 < moved < prompt_tokens // 2, (moved, prompt_tokens)


def test_metrics_and_all_kv_free_after(cluster):
    for key in ("p", "d"):
        info = assert_kv_free(cluster[key])
        assert info["pd_transfers_total"] >= 8 and info["pd_transfer_bytes_total"] > 0
        assert info["pd_transfer_failures_total"] == {}
        prom = httpx.get(cluster[key].url + "/metrics", timeout=60).text
        assert "sgl_pd_transfer_bytes_total" in prom and "sgl_pd_rooms_held 0.0" in prom
        assert "sgl_pd_transfer_seconds_bucket" in prom
    assert_kv_free(cluster["c"])
    assert worker_call(cluster["c"], "check_invariants") is None
