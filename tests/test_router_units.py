"""The router's pure parts, without servers: CLI generated from RouterConfig, circuit
breaker transitions (injected clock), retry delays, admission control, routing input."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from sgl.launch_router import build_parser, parse
from sgl.router.admission import Admission, Rejected
from sgl.router.circuit import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, CircuitOptions
from sgl.router.config import RouterConfig, flag_name
from sgl.router.policies import POLICY_NAMES, PolicyOptions
from sgl.router.retry import RetryOptions, retryable_status
from sgl.router.route_input import route_request

# ---- config / CLI ---------------------------------------------------------------------------


def test_every_field_is_a_flag_with_help():
    help_text = build_parser().format_help()
    for f in dataclasses.fields(RouterConfig):
        assert f.metadata["help"]
        if f.name != "policy_options":
            assert "--" + flag_name(f.name) in help_text
    for f in dataclasses.fields(PolicyOptions):  # the policies' knobs: declared once, there
        assert f.metadata["help"]
        assert ("--" + flag_name(f.name) in help_text) == (f.name != "worker_headers")


def test_policy_flags_come_from_policy_options():
    cfg = parse(["--policy", "kv_aware", "--kv-aware-prefill-weight", "8", "--kv-events-stale-secs", "5",
                 "--load-poll-interval-secs", "0.5", "--cache-threshold", "0.4"])
    assert cfg.policy_options == PolicyOptions(kv_aware_prefill_weight=8, kv_events_stale_secs=5,
                                               load_poll_interval_secs=0.5, cache_threshold=0.4)
    assert parse([]).policy_options == PolicyOptions()
    assert set(POLICY_NAMES) == {"cache_aware", "round_robin", "random", "power_of_two", "kv_aware"}
    assert "--policy {" + ",".join(POLICY_NAMES) + "}" in build_parser().format_help().replace("\n", " ")


def test_sglang_router_flag_names_are_accepted():
    cfg = parse(["--worker-urls", "http://a:1/", "http://b:2", "--policy", "round_robin", "--cache-threshold", "0.5",
                 "--balance-abs-threshold", "32", "--balance-rel-threshold", "1.2", "--eviction-interval-secs", "30",
                 "--max-tree-size", "1000", "--retry-max-retries", "3", "--retry-initial-backoff-ms", "10",
                 "--retry-max-backoff-ms", "100", "--retry-backoff-multiplier", "2", "--retry-jitter-factor", "0.1",
                 "--cb-failure-threshold", "4", "--cb-success-threshold", "2", "--cb-timeout-duration-secs", "5",
                 "--cb-window-duration-secs", "9", "--health-failure-threshold", "2", "--health-success-threshold",
                 "1", "--health-check-timeout-secs", "1", "--health-check-interval-secs", "3",
                 "--health-check-endpoint", "/health_generate", "--max-concurrent-requests", "8", "--queue-size", "4",
                 "--queue-timeout-secs", "2", "--api-key", "k", "--request-id-headers", "X-Trace-Id",
                 "--prometheus-port", "29001", "--prometheus-host", "0.0.0.0", "--request-timeout-secs", "30",
                 "--worker-startup-timeout-secs", "60", "--log-level", "warn", "--service-discovery",
                 "--selector", "app=sgl", "tier=a", "--service-discovery-namespace", "ns",
                 "--service-discovery-port", "8000", "--disable-retries", "--disable-circuit-breaker",
                 "--disable-health-check"])
    assert cfg.worker_urls == ["http://a:1", "http://b:2"]
    assert cfg.selector == {"app": "sgl", "tier": "a"}
    assert cfg.request_id_headers == ["x-trace-id"]
    assert cfg.max_attempts == 1 and cfg.disable_circuit_breaker and cfg.service_discovery
    assert (cfg.cb_failure_threshold, cfg.queue_size, cfg.prometheus_port) == (4, 4, 29001)
    assert (cfg.policy_options.cache_threshold, cfg.policy_options.max_tree_size) == (0.5, 1000)


def test_defaults():
    cfg = parse([])
    assert cfg.policy == "cache_aware" and cfg.host == "127.0.0.1" and cfg.max_concurrent_requests == -1
    assert cfg.retry_max_retries == 5 and cfg.cb_failure_threshold == 10 and cfg.health_check_endpoint == "/health"
    assert "x-request-id" in cfg.request_id_headers


@pytest.mark.parametrize("argv, needle", [
    (["--policy", "fastest"], "--policy"),
    (["--retry-jitter-factor", "2"], "--retry-jitter-factor"),
    (["--worker-urls", "localhost:1"], "--worker-urls"),
    (["--service-discovery"], "--selector"),
    (["--selector", "novalue"], "--selector"),
    (["--max-concurrent-requests", "0"], "--max-concurrent-requests"),
    (["--cache-threshold", "1.5"], "--cache-threshold"),
    (["--load-poll-interval-secs", "0"], "--load-poll-interval-secs"),
    (["--health-check-endpoint", "health"], "--health-check-endpoint"),
])
def test_bad_flags_are_usage_errors_naming_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


# ---- circuit breaker -----------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_circuit_opens_half_opens_and_closes():
    clock = Clock()
    cb = CircuitBreaker(CircuitOptions(failure_threshold=3, success_threshold=2, timeout_secs=10, window_secs=100),
                        clock)
    for _ in range(2):
        cb.record(False)
    cb.record(True)  # a success resets the streak
    for _ in range(2):
        cb.record(False)
    assert cb.state == CLOSED and cb.allow()
    cb.record(False)
    assert cb.state == OPEN and not cb.allow()
    clock.t = 9.9
    assert not cb.allow()
    clock.t = 10.0
    assert cb.state == HALF_OPEN and cb.allow()
    cb.record(False)  # the trial failed: open again, timeout restarts
    assert cb.state == OPEN and not cb.allow()
    clock.t = 20.0
    assert cb.allow()
    cb.record(True)
    assert cb.state == HALF_OPEN
    cb.record(True)
    assert cb.state == CLOSED and cb.opened_total == 2


def test_half_open_admits_one_trial_at_a_time():
    clock = Clock()
    cb = CircuitBreaker(CircuitOptions(failure_threshold=1, success_threshold=2, timeout_secs=10), clock)
    cb.record(False)
    clock.t = 10.0
    assert cb.allow() and cb.allow()  # may be chosen until a trial is sent
    cb.begin()
    assert cb.state == HALF_OPEN and not cb.allow()  # one trial outstanding: nothing else goes
    cb.record(True)
    assert cb.state == HALF_OPEN and cb.allow()
    cb.begin()
    cb.abandon()  # the client left: no verdict, the next trial may go
    assert cb.allow()
    cb.begin()
    cb.record(True)
    assert cb.state == CLOSED
    cb.begin()  # closed: no trial bookkeeping
    assert cb.allow() and cb.allow()


def test_circuit_window_forgets_old_failures():
    clock = Clock()
    cb = CircuitBreaker(CircuitOptions(failure_threshold=2, window_secs=5), clock)
    cb.record(False)
    clock.t = 6.0
    cb.record(False)
    assert cb.state == CLOSED
    cb.record(False)
    assert cb.state == OPEN


def test_disabled_circuit_always_allows():
    cb = CircuitBreaker(CircuitOptions(failure_threshold=1, enabled=False))
    for _ in range(5):
        cb.record(False)
    assert cb.allow() and cb.state == CLOSED


# ---- retries ---------------------------------------------------------------------------------


def test_backoff_grows_caps_and_jitters():
    opts = RetryOptions(max_attempts=10, initial_backoff_ms=100, max_backoff_ms=1000, multiplier=2, jitter=0)
    assert [opts.delay_secs(i) for i in range(1, 6)] == [0.1, 0.2, 0.4, 0.8, 1.0]
    rng = random.Random(0)
    jittered = RetryOptions(initial_backoff_ms=100, jitter=0.2)
    delays = [jittered.delay_secs(1, rng) for _ in range(200)]
    assert all(0.08 <= d <= 0.12 for d in delays) and len(set(delays)) > 100
    assert [s for s in range(400, 600) if retryable_status(s)] == [408, 429, 500, 502, 503, 504]


# ---- admission -------------------------------------------------------------------------------


def test_admission_queue_full_429_and_fifo_handoff():
    async def main():
        adm = Admission(limit=1, queue_size=1, queue_timeout_secs=30)
        await adm.acquire()
        waiter = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        assert adm.waiting == 1
        with pytest.raises(Rejected) as e:
            await adm.acquire()
        assert e.value.status == 429 and adm.rejected_full == 1
        adm.release()  # handed to the waiter
        await waiter
        assert adm.active == 1 and adm.waiting == 0
        adm.release()
        assert adm.active == 0

    asyncio.run(main())


def test_admission_queue_timeout_408_frees_its_place():
    async def main():
        adm = Admission(limit=1, queue_size=4, queue_timeout_secs=0.05)
        await adm.acquire()
        with pytest.raises(Rejected) as e:
            await adm.acquire()
        assert e.value.status == 408 and adm.waiting == 0
        adm.release()
        assert adm.active == 0
        await adm.acquire()  # the slot is usable again

    asyncio.run(main())


def test_admission_unlimited():
    async def main():
        adm = Admission(limit=-1, queue_size=0, queue_timeout_secs=1)
        for _ in range(100):
            await adm.acquire()
        assert adm.active == 100

    asyncio.run(main())


# ---- routing input ---------------------------------------------------------------------------


class FakeTokenizer:
    """Stands in for the worker's tokenizer: a template of role tags, ids = code points."""

    def encode(self, text):
        return [ord(c) for c in text]

    def render_chat(self, messages, tools=None):
        return "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"


def test_route_inputs():
    tok = FakeTokenizer()
    r = route_request("/generate", {"text": ["first", "second"]}, None, False, "rid-1")
    assert (r.text, r.token_ids, r.request_id) == ("first", None, "rid-1")
    assert route_request("/generate", {"input_ids": [[1, 2], [3]]}, None, True).token_ids == [1, 2]
    assert route_request("/v1/completions", {"prompt": "abc"}, tok, True).token_ids == [97, 98, 99]
    assert route_request("/v1/completions", {"prompt": [5, 6]}, None, False).token_ids == [5, 6]
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text",
                                                                                              "text": "U"}]}]}
    assert route_request("/v1/chat/completions", chat, None, False).text == "S\nU"
    assert route_request("/v1/chat/completions", {"messages": [{"role": "user", "content": "U"}]}, tok,
                         False).text == "<|user|>U<|assistant|>"


@pytest.mark.parametrize("endpoint, body, field", [
    ("/generate", {"text": 3}, "text"),
    ("/generate", {"input_ids": ["a"]}, "input_ids"),
    ("/v1/completions", {"prompt": {"x": 1}}, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/generate", {"input_ids": [1, -1]}, "input_ids"),
    ("/generate", {"input_ids": [[2**32]]}, "input_ids"),
    ("/generate", {"input_ids": [1.5]}, "input_ids"),
    ("/v1/completions", {"prompt": [3, 2**40]}, "prompt"),
])
def test_bad_route_input_names_the_field(endpoint, body, field):
    with pytest.raises(ValueError, match=field):
        route_request(endpoint, body, None, False)


# ---- registry: health streaks ----------------------------------------------------------------


def test_health_streaks_take_a_worker_out_and_back():
    from sgl.router.policies import make_policy
    from sgl.router.registry import Registry

    reg = Registry(make_policy("round_robin"), CircuitOptions())
    w = reg.add("http://w1")
    reg.add("http://w2")
    assert reg.record_health(w, False, "refused", 2, 2) is None and w.state.healthy
    assert reg.record_health(w, False, "refused", 2, 2) is False and not w.state.healthy
    assert [c.url for c in reg.candidates()] == ["http://w2"]
    assert reg.record_health(w, True, None, 2, 2) is None and not w.state.healthy
    assert reg.record_health(w, True, None, 2, 2) is True and w.state.healthy
    assert [c.url for c in reg.candidates(exclude=["http://w2"])] == ["http://w1"]
    assert [c.url for c in reg.candidates(exclude=["http://w1", "http://w2"])] == ["http://w1", "http://w2"]
    for _ in range(10):
        w.circuit.record(False)  # an open circuit also leaves rotation
    assert [c.url for c in reg.candidates()] == ["http://w2"]
    assert reg.remove("http://w2") is not None and reg.candidates() == []


# ---- proxy: the policy is always asked, and its failure is not the request's --------------------


class _CountingPolicy:
    name = "counting"

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.selects, self.added = fail, 0, []

    def add_worker(self, worker):  # noqa: ANN001
        self.added.append(worker.url)

    def remove_worker(self, url):  # noqa: ANN001
        pass

    def select(self, req, candidates):  # noqa: ANN001
        self.selects += 1
        if self.fail:
            raise KeyError("policy bug")
        return candidates[-1]


def _proxy(policy, urls):  # noqa: ANN001
    from sgl.router.metrics import RouterMetrics
    from sgl.router.proxy import Proxy
    from sgl.router.registry import Registry

    reg = Registry(policy, CircuitOptions())
    for u in urls:
        reg.add(u)
    return Proxy(reg, policy, None, None, RetryOptions(1), RouterMetrics(lambda: {}),  # type: ignore[arg-type]
                 lambda url: None, 1.0), reg


def test_policy_is_asked_even_with_one_candidate():
    from sgl.router.policies import RouteRequest
    from sgl.router.proxy import Forward

    policy = _CountingPolicy()
    proxy, _ = _proxy(policy, ["http://w1"])
    fwd = Forward("POST", "/generate", "/generate", b"{}", {}, route_req=RouteRequest("/generate", "hi"))
    assert proxy._choose(fwd, []).url == "http://w1" and policy.selects == 1


def test_a_failing_policy_falls_back_to_the_least_loaded_worker():
    from sgl.router.policies import RouteRequest
    from sgl.router.proxy import Forward

    policy = _CountingPolicy(fail=True)
    proxy, reg = _proxy(policy, ["http://w1", "http://w2"])
    reg.get("http://w1").state.in_flight = 3  # type: ignore[union-attr]
    fwd = Forward("POST", "/generate", "/generate", b"{}", {}, route_req=RouteRequest("/generate", "hi"))
    assert proxy._choose(fwd, []).url == "http://w2" and policy.selects == 1


def test_a_removed_workers_metric_series_are_dropped():
    from sgl.router.metrics import RouterMetrics

    m = RouterMetrics(lambda: {})  # the live gauges are not scraped here
    m.worker_requests.labels("http://a:1", "ok").inc()
    m.worker_requests.labels("http://a:1", "abandoned").inc()
    m.worker_requests.labels("http://b:1", "ok").inc()
    m.pd_requests.labels("http://a:1", "http://d:1", "ok").inc()
    m.pd_requests.labels("http://p:1", "http://b:1", "ok").inc()
    m.forget_worker("http://a:1")

    def labels(counter):  # noqa: ANN001, ANN202
        return {tuple(sorted(s.labels.items())) for fam in counter.collect() for s in fam.samples}

    seen = {v for ls in labels(m.worker_requests) | labels(m.pd_requests) for _, v in ls}
    assert "http://a:1" not in seen and {"http://b:1", "http://p:1"} <= seen
