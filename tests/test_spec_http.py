"""Speculative decoding through the real server: the flags (SGLang's names), the
draft model from a file, meta_info and /metrics, the OpenAI client, and flag errors that
stop the launch with a message naming the flag."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from sgl.runtime.config import EngineConfig
from sgl.runtime.models.loader import embedded_gguf_path
from tests.server_proc import REPO, start_server

COPY = ("Copy this list exactly: apples, pears, plums, cherries, apricots, peaches, grapes, lemons, limes, "
        "oranges.\nCopy: apples, pears, plums,")


@pytest.fixture(scope="module")
def server():
    # The embedded model drafts for itself: every draft is accepted (the overhead ceiling).
    srv = start_server("--max-total-tokens", "4096", "--speculative-algorithm", "STANDALONE",
                       "--speculative-draft-policy", "always",
                       "--speculative-draft-model-path", str(embedded_gguf_path()),
                       "--speculative-num-draft-tokens", "3")
    yield srv
    srv.stop()


def test_generate_reports_speculation_and_metrics(server) -> None:
    r = httpx.post(server.url + "/generate", json={"text": COPY, "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}, timeout=300)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["completion_tokens"] == 12
    # a model drafting for itself is always right: 3 drafts + 1 token per step, after the first token
    assert meta["spec_accepted_tokens"] == meta["spec_draft_tokens"] > 0
    assert meta["spec_verify_ct"] <= 4 and meta["spec_accept_length"] >= 3
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["spec_algorithm"] == "draft" and info["spec_accept_rate"] == 1.0
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert "sgl_spec_accept_rate 1.0" in text
    assert any(line.startswith("sglang:spec_accept_length{") and float(line.split()[-1]) >= 3
               for line in text.splitlines())


def test_openai_chat_with_speculation(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Say hello."}],
                                         max_tokens=8, temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens <= 8


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative_algorithm": "eagle"}, "speculative_algorithm must be one of ngram, draft"),
    ({"speculative_algorithm": "draft"}, "needs --speculative-draft-model-path"),
    ({"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 0}, "--speculative-num-draft-tokens"),
    ({"speculative_algorithm": "ngram", "speculative_ngram_min_match_window_size": 5,
      "speculative_ngram_max_match_window_size": 3}, "--speculative-ngram-min-match-window-size"),
    ({"speculative_algorithm": "draft", "speculative_draft_model_path": "x.gguf", "tp_size": 2}, "--tp-size"),
])
def test_bad_flags_are_refused_with_the_flag_named(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs).resolved()


def test_launch_refuses_an_unknown_algorithm() -> None:
    p = subprocess.run([sys.executable, "-m", "sgl.launch_server", "--speculative-algorithm", "medusa"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "speculative_algorithm must be one of" in p.stderr

