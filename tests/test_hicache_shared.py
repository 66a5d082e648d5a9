"""The redis storage tier between real servers (issue 14's shared-store and fault points):
two workers (`python -m sgl.launch_server` subprocesses, small pools) on one real
`redis-server`. Worker B starts while Redis is not there yet (it starts, logs that the
tier is off, serves), then Redis comes up and B connects; a ~1,500-token prompt computed
on worker A is served on B from the store, same greedy output. Then Redis is killed:
requests recompute with unchanged outputs, and once Redis is back both workers
reconnect and share again. A uses the best_effort prefetch policy, B the timeout one.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest

from tests.hicache_http import PAGE, flush, generate, info, prompt, wait_for, written
from tests.redis_proc import RedisProc, ensure_redis_server, free_port
from tests.server_proc import ServerProc, start_server

pytestmark = pytest.mark.slow  # multi-process set: `make test-slow`


def hicache_args(url: str, policy: str, **extra: Any) -> list[str]:
    return ["--max-total-tokens", "4096", "--page-size", str(PAGE), "--enable-hierarchical-cache",
            "--hicache-storage-backend", "redis", "--hicache-storage-prefetch-policy", policy,
            "--hicache-storage-backend-extra-config", json.dumps({"url": url, "retry_interval_s": 0.5, **extra})]


@pytest.fixture(scope="module")
def cluster():
    redis = RedisProc(ensure_redis_server(), free_port())  # not started yet
    servers: list[ServerProc] = []
    try:
        b = start_server(*hicache_args(redis.url, "timeout", prefetch_timeout=60))
        servers.append(b)
        early = generate(b, prompt(99, 40))  # Redis unreachable: served anyway
        redis.start()
        a = start_server(*hicache_args(redis.url, "best_effort"))
        servers.append(a)
        yield {"a": a, "b": b, "redis": redis, "early": early}
    finally:
        for s in servers:
            s.stop()
        redis.stop()


def test_unreachable_at_start_then_shared_prefix_across_workers(cluster) -> None:
    a, b = cluster["a"], cluster["b"]
    assert cluster["early"]["meta_info"]["completion_tokens"] > 0
    assert "cannot reach" in b.log() and "storage tier is off" in b.log()
    ids = prompt(1, 1500)
    ra = generate(a, ids)
    wait_for("A's pages in redis", lambda: written(a, len(ids) // PAGE))
    # B connects on its first call after the back-off; a throwaway prompt makes that call
    wait_for("B connected", lambda: info(b).get("storage_connected") == 1.0,
             poke=lambda: generate(b, prompt(random.randrange(10**6), 40), 1))
    rb = generate(b, ids)
    assert rb["text"] == ra["text"]
    mb = rb["meta_info"]
    assert mb["cached_tokens"] >= 1400, mb
    assert mb["cached_tokens_details"]["storage"] >= 1400, mb
    ib = info(b)
    assert ib["storage_pages_prefetched"] >= 1400 // PAGE
    metrics = httpx.get(b.url + "/metrics", timeout=60).text
    assert "sglang:prefetched_tokens_total" in metrics and "sgl_hicache_hit_tokens_total" in metrics
    # best_effort on A: it never waits for storage; its split always adds up
    d = ra["meta_info"]["cached_tokens_details"]
    assert sum(d.values()) == ra["meta_info"]["cached_tokens"]


def test_redis_killed_mid_run_recompute_then_reconnect(cluster) -> None:
    a, b, redis = cluster["a"], cluster["b"], cluster["redis"]
    ids = prompt(2, 600)
    before = info(a)["storage_pages_written"]
    ref = generate(a, ids)
    wait_for("A's pages in redis", lambda: written(a, before + len(ids) // PAGE))
    redis.stop()  # SIGKILL: a crash, as the workers see it
    flush(b)
    rb = generate(b, ids)  # the store is gone: B recomputes
    assert rb["text"] == ref["text"]
    assert rb["meta_info"]["cached_tokens_details"]["storage"] == 0
    other = prompt(3, 300)
    assert generate(a, other)["meta_info"]["completion_tokens"] > 0
    wait_for("A to see Redis gone", lambda: info(a)["storage_connected"] == 0.0)
    redis.start()  # same port, empty (no persistence)
    for srv in (a, b):
        wait_for("reconnect", lambda srv=srv: info(srv).get("storage_connected") == 1.0
                 and info(srv)["storage_reconnects"] >= 1,
                 poke=lambda srv=srv: generate(srv, prompt(random.randrange(10**6), 40), 1))
    ids2 = prompt(4, 600)
    before = info(a)["storage_pages_written"]
    r2a = generate(a, ids2)
    wait_for("A's new pages in redis", lambda: written(a, before + len(ids2) // PAGE))
    r2b = generate(b, ids2)
    assert r2b["text"] == r2a["text"]
    assert r2b["meta_info"]["cached_tokens_details"]["storage"] >= 0.9 * len(ids2)
