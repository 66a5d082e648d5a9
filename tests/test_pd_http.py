"""The HTTP side of PD disaggregation in-process, against a fake engine (no model): the
bootstrap fields sglang-router 0.3.2 sends (bodies as observed on the wire) reach the
engine as one room per sample, requests without a room are refused on a PD worker
(400 naming bootstrap_room), and a PD failure's status (5xx) reaches the client."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sgl.server.app import create_app
from tests.test_server_openai_inprocess import CharTokenizer

FAIL_ROOM = 666


class FakePDEngine:
    model_path = "fake-model"
    context_length = 512
    chat_template = None

    def __init__(self, mode: str) -> None:
        self.tokenizer = CharTokenizer()
        self.config = SimpleNamespace(disaggregation_mode=mode, disaggregation_bootstrap_port=8998)
        self.calls: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)

    async def async_generate(self, prompt: str | None = None, sampling_params: dict | None = None,
                             stream: bool = False, **kw: Any) -> Any:
        self.calls.append({"n": (sampling_params or {}).get("n", 1), **kw})
        rooms = kw.get("bootstrap_room") or []
        failed = FAIL_ROOM in rooms
        fr = ({"type": "abort", "message": "KV transfer timed out", "status_code": 504} if failed
              else {"type": "length", "length": 1})
        res = {"text": "x", "output_ids": [1], "meta_info": {"prompt_tokens": 3, "completion_tokens": 1,
                                                             "cached_tokens": 0, "finish_reason": fr}}
        if stream:
            async def chunks() -> Any:
                yield res
            return chunks()
        n = (sampling_params or {}).get("n", 1)
        return res if n == 1 else [res] * n

    def abort(self, rid: str) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def get_server_info(self) -> dict[str, Any]:
        return {"disaggregation_mode": self.config.disaggregation_mode}


@pytest.fixture
def decode():
    eng = FakePDEngine("decode")
    with TestClient(create_app(eng, served_model_name="m")) as c:
        yield c, eng


def rooms(eng: FakePDEngine) -> list[tuple[list[str], list[int], list[int]]]:
    return [(c["bootstrap_host"], c["bootstrap_port"], c["bootstrap_room"]) for c in eng.calls]


def test_router_bodies_become_one_room_per_sample(decode):
    http, eng = decode
    # /generate as the router sends it (default-filled fields included); n=2 with a scalar room
    r = http.post("/generate", json={"text": "hello", "model": None, "sampling_params": {"max_new_tokens": 4, "n": 2},
                                     "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                                     "return_hidden_states": False, "background": False, "no_logs": False,
                                     "return_bytes": False, "return_entropy": False, "bootstrap_host": "127.0.0.1",
                                     "bootstrap_port": 8998, "bootstrap_room": 5308345789580723425})
    assert r.status_code == 200, r.text
    assert rooms(eng) == [(["127.0.0.1"] * 2, [8998] * 2, [5308345789580723425, 5308345789580723426])]
    # chat with n=2: one room per choice, null ports = this worker's bootstrap port
    eng.calls.clear()
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "model": "unknown", "logprobs": False,
        "max_completion_tokens": 3, "n": 2, "stream": False, "no_stop_trim": False, "ignore_eos": False,
        "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
        "stream_reasoning": True, "return_hidden_states": False, "bootstrap_host": ["localhost", "localhost"],
        "bootstrap_port": [None, None], "bootstrap_room": [2947933337754633786, 372440239548006706]})
    assert r.status_code == 200, r.text
    assert rooms(eng) == [(["localhost"] * 2, [8998] * 2, [2947933337754633786, 372440239548006706])]
    # completions with two prompts: one room per prompt
    eng.calls.clear()
    r = http.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "max_tokens": 3, "stream": False,
                                           "echo": False, "bootstrap_host": ["h", "h"], "bootstrap_port": [9, 9],
                                           "bootstrap_room": [10, 20]})
    assert r.status_code == 200, r.text
    assert sorted(rooms(eng)) == [(["h"], [9], [10]), (["h"], [9], [20])]
    # a streamed n=2: one engine stream per sample, each with its own room
    eng.calls.clear()
    r = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 2}, "stream": True,
                                     "bootstrap_host": "h", "bootstrap_port": None, "bootstrap_room": 40})
    assert r.status_code == 200, r.text
    assert sorted(rooms(eng)) == [(["h"], [8998], [40]), (["h"], [8998], [41])]


def test_requests_without_a_room_are_refused_naming_it(decode):
    http, eng = decode
    for path, body in (("/generate", {"text": "hi"}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room", r.text
        assert "decode worker" in r.json()["error"]["message"]
    r = http.post("/generate", json={"text": "hi", "bootstrap_host": "h", "bootstrap_port": 1,
                                     "bootstrap_room": [1, 2]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"
    r = http.post("/generate", json={"text": "hi", "bootstrap_host": "h", "bootstrap_port": 99999, "bootstrap_room": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_port"
    assert eng.calls == []


def test_pd_failure_status_reaches_the_client(decode):
    http, _ = decode
    body = {"text": "hi", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": FAIL_ROOM}
    r = http.post("/generate", json=body)
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
    r = http.post("/generate", json={**body, "stream": True})
    assert r.status_code == 504
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "bootstrap_host": "h",
                                                "bootstrap_port": 1, "bootstrap_room": FAIL_ROOM})
    assert r.status_code == 504


def test_colocated_worker_ignores_bootstrap_fields():
    eng = FakePDEngine("null")
    with TestClient(create_app(eng, served_model_name="m")) as http:
        r = http.post("/generate", json={"text": "hi", "bootstrap_host": "h", "bootstrap_port": None,
                                         "bootstrap_room": 3})
        assert r.status_code == 200 and "bootstrap_room" not in eng.calls[0]
        assert http.post("/generate", json={"text": "hi"}).status_code == 200


def test_pd_metrics_render_from_server_info():
    from prometheus_client.parser import text_string_to_metric_families

    from sgl.runtime.disaggregation.stats import PDStats
    from sgl.server.metrics import Metrics

    st = PDStats("decode")
    st.transfer(1000, 10, 0.004)
    st.transfer(3000, 30, 2.0)
    st.failure("timeout")
    m = Metrics("m")
    assert "sgl_pd_" not in m.render({"disaggregation_mode": "null"}).decode()
    text = m.render(st.snapshot(rooms_held=2)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert samples[("sgl_pd_transfer_bytes_total", ())] == 4000
    assert samples[("sgl_pd_transfer_failures_total", (("reason", "timeout"),))] == 1
    assert samples[("sgl_pd_rooms_held", ())] == 2
    assert samples[("sgl_pd_transfer_seconds_bucket", (("le", "0.005"),))] == 1
    assert samples[("sgl_pd_transfer_seconds_bucket", (("le", "+Inf"),))] == 2
    assert samples[("sgl_pd_transfer_seconds_count", ())] == 2
    assert samples[("sgl_pd_transfer_seconds_sum", ())] == 2.004
