"""PD mode's pure parts, without servers: the CLI as sglang-router spells it, the bootstrap
fields and their shapes (batches, n > 1), the logprob merge, SSE error events."""

from __future__ import annotations

import json

import pytest

from sgl.launch_router import build_parser, parse
from sgl.router.pd_request import (ROOM_LIMIT, batch_size, error_event, merge_input_logprobs, rooms_of,
                                   with_bootstrap)
from sgl.router.registry import Registry
from sgl.router.circuit import CircuitOptions
from sgl.router.policies import make_policy


def test_pd_flags_as_sglang_router_spells_them():
    cfg = parse(["--pd-disaggregation", "--prefill", "http://127.0.0.1:30001/", "8998",
                 "--prefill", "http://localhost:30002", "none", "--prefill", "http://p3:30003",
                 "--decode", "http://127.0.0.1:30011", "--decode", "http://d2:30012",
                 "--policy", "round_robin", "--prefill-policy", "cache_aware"])
    assert cfg.pd_disaggregation
    assert cfg.prefill == [("http://127.0.0.1:30001", 8998), ("http://localhost:30002", None),
                           ("http://p3:30003", None)]
    assert cfg.decode == ["http://127.0.0.1:30011", "http://d2:30012"]
    assert cfg.role_policies() == {"prefill": "cache_aware", "decode": "round_robin"}
    assert parse(["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1",
                  "--decode-policy", "power_of_two"]).role_policies() == {"prefill": "cache_aware",
                                                                          "decode": "power_of_two"}
    assert parse([]).role_policies() == {"worker": "cache_aware"}
    help_text = build_parser().format_help()
    for flag in ("--pd-disaggregation", "--prefill URL [BOOTSTRAP_PORT", "--decode URL", "--prefill-policy",
                 "--decode-policy", "--pd-wait-for-prefill"):
        assert flag in help_text


@pytest.mark.parametrize("argv, needle", [
    (["--prefill", "http://p:1", "--decode", "http://d:1"], "--prefill needs --pd-disaggregation"),
    (["--decode-policy", "random"], "--decode-policy needs --pd-disaggregation"),
    (["--pd-disaggregation", "--prefill", "http://p:1"], "at least one --prefill URL and one --decode URL"),
    (["--pd-disaggregation", "--prefill", "http://p:1", "x", "--decode", "http://d:1"], "bootstrap port 'x'"),
    (["--pd-disaggregation", "--prefill", "http://p:1", "70000", "--decode", "http://d:1"], "1..65535"),
    (["--pd-disaggregation", "--prefill", "http://p:1", "http://p:2", "--decode", "http://d:1"], "--prefill"),
    (["--pd-disaggregation", "--prefill", "http://p:1", "1", "2", "--decode", "http://d:1"], "URL [BOOTSTRAP_PORT]"),
    (["--pd-disaggregation", "--prefill", "p:1", "--decode", "http://d:1"], "must start with http"),
    (["--pd-disaggregation", "--prefill", "http://w:1", "--decode", "http://w:1/"], "listed twice"),
    (["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "--worker-urls", "http://w:1"],
     "--worker-urls is for regular mode"),
    (["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "--service-discovery",
      "--selector", "a=b"], "--service-discovery is not supported in PD mode"),
    (["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "--prefill-policy", "x"],
     "--prefill-policy"),
])
def test_bad_pd_flags_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("endpoint, body, k", [
    ("/generate", {"text": "a"}, None),
    ("/generate", {"text": "a", "sampling_params": {"n": 2}}, None),
    ("/generate", {"text": ["a", "b", "c"]}, 3),
    ("/generate", {"text": ["a"]}, 1),
    ("/generate", {"input_ids": [1, 2, 3]}, None),
    ("/generate", {"input_ids": [[1, 2], [3]]}, 2),
    ("/v1/completions", {"prompt": "a", "n": 2}, None),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 3}, 2),
    ("/v1/completions", {"prompt": [1, 2, 3]}, None),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, 2),
    ("/v1/chat/completions", {"messages": [], "n": 3}, 3),
    ("/v1/chat/completions", {"messages": [], "n": 1}, None),
    ("/v1/chat/completions", {"messages": []}, None),
])
def test_bootstrap_shapes(endpoint, body, k):
    assert batch_size(endpoint, body) == k
    out = with_bootstrap(endpoint, {**body, "bootstrap_room": 7, "bootstrap_host": "x"}, "10.0.0.1", 8998)
    assert {key: v for key, v in out.items() if not key.startswith("bootstrap_")} == body  # nothing else changes
    rooms = rooms_of(out)
    assert all(isinstance(r, int) and 0 <= r < ROOM_LIMIT for r in rooms) and 7 not in rooms
    assert len(set(rooms)) == len(rooms)
    if k is None:
        assert (out["bootstrap_host"], out["bootstrap_port"]) == ("10.0.0.1", 8998)
        assert isinstance(out["bootstrap_room"], int)
    else:
        assert out["bootstrap_host"] == ["10.0.0.1"] * k and out["bootstrap_port"] == [8998] * k and len(rooms) == k
    again = with_bootstrap(endpoint, body, "10.0.0.1", None)  # a new attempt: new rooms
    assert not set(rooms_of(again)) & set(rooms)
    assert again["bootstrap_port"] is None or again["bootstrap_port"] == [None] * (k or 0)
    json.dumps(out)  # plain JSON, rooms as integers


def test_prefill_host_is_the_url_host_verbatim():
    reg = Registry(make_policy("round_robin"), CircuitOptions(), role="prefill")
    assert reg.add("http://localhost:30001", bootstrap_port=None).host == "localhost"
    w = reg.add("http://10.1.2.3:30002", bootstrap_port=9000)
    assert (w.host, w.bootstrap_port, w.role) == ("10.1.2.3", 9000, "prefill")
    assert w.describe()["bootstrap_port"] == 9000 and w.describe()["role"] == "prefill"


def test_logprob_merge():
    p = {"text": "", "meta_info": {"input_token_logprobs": [[-0.5, 11, None], [-0.6, 12, None]]}}
    d = {"text": "hi", "meta_info": {"input_token_logprobs": [[None, 99, None]], "output_token_logprobs": [[-1, 5]]}}
    merged = json.loads(merge_input_logprobs(json.dumps(p).encode(), json.dumps(d).encode()) or b"")
    assert merged["meta_info"]["input_token_logprobs"] == [[-0.5, 11, None], [-0.6, 12, None], [None, 99, None]]
    assert merged["meta_info"]["output_token_logprobs"] == [[-1, 5]] and merged["text"] == "hi"
    batch = merge_input_logprobs(json.dumps([p, p]).encode(), json.dumps([d, d]).encode())
    assert [len(x["meta_info"]["input_token_logprobs"]) for x in json.loads(batch or b"")] == [3, 3]
    no_list = {"text": "hi", "meta_info": {}}
    assert merge_input_logprobs(json.dumps(p).encode(), json.dumps(no_list).encode()) is None
    assert merge_input_logprobs(json.dumps([p]).encode(), json.dumps([d, d]).encode()) is None
    assert merge_input_logprobs(b"not json", json.dumps(d).encode()) is None


def test_error_event():
    assert error_event(b'data: {"text":"a"}\n\ndata: [DONE]\n\n') is None
    assert error_event(b'data: {"text":"a"}\n\ndata: {"error":{"message":"KV transfer timed out"}}\n\n') == \
        "KV transfer timed out"
    assert error_event(b'data: {"error":"plain"}\n\n') == "plain"
    assert error_event(b'{"error": {"message": "not SSE"}}') is None
