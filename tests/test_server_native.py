"""The SGLang-native API over a real server subprocess (real engine, embedded model).

Also runs SGLang's own frontend (`sglang.RuntimeEndpoint` from PyPI sglang==0.5.23,
installed with --no-deps into a temp dir) against the server, and checks the API key
guard, the JSON access log, and /metrics.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

import httpx
import pytest

from tests.server_proc import start_server

pytestmark = [pytest.mark.server, pytest.mark.model]

KEY = "test-key-123"


@pytest.fixture(scope="module")
def srv():
    s = start_server("--max-total-tokens", "16384", "--context-length", "2048", api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=120) as c:
        yield c


def gen(http, **body):
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_single_greedy(http):
    out = gen(http, text="The capital of France is", sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert "Paris" in out["text"]
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] > 0 and isinstance(meta["id"], str)
    assert "input_token_logprobs" not in meta


def test_generate_batch_ids_and_rid(http):
    ids = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 0}}).json()
    assert ids["output_ids"] == [] and ids["meta_info"]["prompt_tokens"] >= 1
    outs = gen(http, text=["One, two,", "A, B,"], rid=["r-a", "r-b"],
               sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert [o["meta_info"]["id"] for o in outs] == ["r-a", "r-b"]
    assert all(o["meta_info"]["completion_tokens"] == 3 for o in outs)
    # input_ids give the same greedy answer as the text they encode
    single = gen(http, text="One, two,", sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert single["text"] == outs[0]["text"]
    # n > 1 on one prompt returns n results
    many = gen(http, text="Pick a number:", sampling_params={"max_new_tokens": 3, "n": 3, "seed": 7})
    assert isinstance(many, list) and len(many) == 3


def test_generate_logprobs_with_text(http):
    out = gen(http, text="1, 2, 3, 4,", sampling_params={"max_new_tokens": 2, "temperature": 0},
              return_logprob=True, logprob_start_len=0, top_logprobs_num=3, return_text_in_logprobs=True)
    meta = out["meta_info"]
    inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inp) == meta["prompt_tokens"] and len(outp) == 2
    assert inp[0][0] is None and all(isinstance(e[0], float) and e[0] <= 0 for e in inp[1:])
    assert "".join(e[2] for e in inp) == "1, 2, 3, 4,"
    assert [e[1] for e in outp] == out["output_ids"]
    # greedy: the chosen token is the top-1 alternative
    for e, top in zip(outp, meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == e[1]


def test_generate_stream_cumulative(http):
    body = {"text": "Count: 1, 2, 3,", "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "stream": True}
    frames = []
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                frames.append(line[5:].strip())
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    plain = gen(http, text=body["text"], sampling_params=body["sampling_params"])
    assert texts[-1] == plain["text"] and chunks[-1]["output_ids"] == plain["output_ids"]


def test_constrained_generate(http):
    out = gen(http, text="Phone number: ", sampling_params={"max_new_tokens": 20, "regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", out["text"])
    bad = http.post("/generate", json={"text": "x", "sampling_params": {"regex": "(("}})
    assert bad.status_code == 400 and "regex" in bad.json()["error"]["message"]


def test_info_health_flush_abort(srv, http):
    info = http.get("/get_model_info").json()
    assert info["model_path"] and info["is_generation"] is True
    sinfo = http.get("/get_server_info").json()
    for k in ("num_running_reqs", "kv_used_tokens", "kv_total_tokens", "max_total_tokens"):
        assert k in sinfo
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    assert http.post("/flush_cache").status_code == 200
    assert http.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200
    # abort a running stream by rid: it ends with an abort or stops early
    body = {"text": "Tell me a long story.", "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    last = None
    with http.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            last = json.loads(line[5:])
            if "meta_info" in last and last["meta_info"]["completion_tokens"] == 2:
                again = http.post("/generate", json={**body, "stream": False})  # the rid is taken
                assert again.status_code == 400 and "'to-abort' is already in use" in again.text, again.text
                assert http.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
    assert last is not None
    assert "error" in last or last["meta_info"]["completion_tokens"] < 1000


def test_abort_by_rid_reaches_every_sample_of_a_non_stream_request(http):
    import concurrent.futures

    body = {"text": "Tell me a long story.", "rid": "abort-n2",
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "n": 2, "temperature": 0.8}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(http.post, "/generate", json=body)
        for _ in range(600):  # a bound on waiting, not a timing assertion
            if http.get("/get_server_info").json()["num_running_reqs"] >= 2:
                break
            time.sleep(0.05)
        assert http.post("/abort_request", json={"rid": "abort-n2"}).status_code == 200
        r = fut.result(timeout=120)
    # the samples were stopped: the reply is the abort, not two 1,000-token stories
    assert r.status_code == 400 and "abort" in r.text.lower(), r.text[:300]


def test_api_key_guard(srv):
    assert httpx.get(srv.url + "/health").status_code == 200
    r = httpx.post(srv.url + "/generate", json={"text": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_metrics_and_access_log(srv, http):
    gen(http, text="Hi", sampling_params={"max_new_tokens": 2})
    text = http.get("/metrics").text
    for name in ("sgl_http_requests_total", "sgl_prompt_tokens_total", "sgl_generation_tokens_total",
                 "sgl_num_running_reqs", "sgl_num_waiting_reqs", "sgl_kv_used_tokens", "sgl_cache_hit_rate",
                 "sgl_time_to_first_token_seconds_bucket", "sgl_time_per_output_token_seconds_bucket"):
        assert name in text, name
    m = re.search(r"^sgl_generation_tokens_total ([0-9.e+]+)$", text, re.M)
    assert m and float(m.group(1)) >= 2
    lines = [json.loads(x) for x in srv.log().splitlines() if x.startswith('{"ts"')]
    gens = [x for x in lines if x["path"] == "/generate" and x["status"] == 200]
    assert gens and all({"request_id", "duration_ms", "method"} <= set(x) for x in gens)
    assert any(x.get("completion_tokens", 0) > 0 for x in gens)
    assert any(x["status"] == 401 for x in lines)
    for path in ("/scanner-probe-1", "/scanner-probe-2"):  # refused before routing (no key)
        assert httpx.get(srv.url + path).status_code == 401
    assert httpx.post(srv.url + "/generate", json={"text": "hi"}).status_code == 401
    text = http.get("/metrics").text
    assert "scanner-probe" not in text and re.search(r'sgl_http_requests_total\{path="unmatched",status="401"\}', text)
    assert re.search(r'sgl_http_requests_total\{path="/generate",status="401"\}', text)  # a known path keeps its name


# ---- SGLang's own frontend against our server ------------------------------------------

SGLANG_VERSION = "0.5.23"
# What `import sglang` needs beyond this venv when installed with --no-deps.
SGLANG_FRONTEND_DEPS = ["orjson", "psutil", "pybase64", "pillow", "msgspec", "pyzmq", "ipython", "traitlets",
                        "aiohttp", "multidict", "yarl", "propcache", "aiohappyeyeballs", "aiosignal", "frozenlist"]


def _sglang_dir() -> str:
    target = os.path.join(tempfile.gettempdir(), f"sgl-test-sglang-{SGLANG_VERSION}")
    marker = os.path.join(target, ".ok")
    if os.path.exists(marker):
        return target
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
           "--target", target, f"sglang=={SGLANG_VERSION}", *SGLANG_FRONTEND_DEPS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"could not install sglang=={SGLANG_VERSION} from PyPI: {r.stderr[-500:]}")
    open(marker, "w").close()
    return target


FRONTEND_PROGRAM = textwrap.dedent(r'''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import sglang as sgl
    sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[2], api_key=sys.argv[3]))

    @sgl.function
    def few_shot(s, q):
        s += "Q: What is the capital of Germany?\nA: Berlin\n"
        s += "Q: What is the capital of Italy?\nA: Rome\n"
        s += "Q: " + q + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n", temperature=0)

    @sgl.function
    def pick(s):
        s += "Q: What is the capital of France?\nA: " + sgl.select("city", choices=["Paris", "London", "Tokyo"])

    @sgl.function
    def year(s):
        s += "The Eiffel Tower was completed in the year " + sgl.gen("year", max_tokens=8, regex=r"1[89][0-9]{2}")

    out = {"answer": few_shot.run(q="What is the capital of France?")["answer"],
           "city": pick.run()["city"], "year": year.run()["year"]}
    print("RESULT " + json.dumps(out))
''')


def test_sglang_runtime_endpoint(srv):
    target = _sglang_dir()
    r = subprocess.run([sys.executable, "-c", FRONTEND_PROGRAM, target, srv.url, KEY],
                       capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir())
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    assert "Paris" in out["answer"]
    assert out["city"] == "Paris"
    assert re.fullmatch(r"1[89][0-9]{2}", out["year"])


def test_sgl_runtime_endpoint_chat(srv):
    # sgl's own DSL over HTTP: the chat template comes from /get_model_info.
    import sgl

    backend = sgl.RuntimeEndpoint(srv.url, api_key=KEY)

    @sgl.function
    def prog(s):
        s += sgl.user("What is the capital of France? Answer in one word.")
        s += sgl.assistant(sgl.gen("ans", max_tokens=8, temperature=0))
        s += sgl.user("Pick a letter.")
        s += sgl.assistant(sgl.select("letter", choices=["A", "B", "C"]))

    st = prog.run(backend=backend)
    assert "Paris" in st["ans"] and st["letter"] in ("A", "B", "C")
    assert "<|im_start|>assistant" in st.text()
