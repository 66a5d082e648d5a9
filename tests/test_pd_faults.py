"""Faults between a real prefill and a real decode worker: a KV transfer that times out,
a decode worker that restarts while the prefill holds a room for it, and a prefill worker
killed while it holds a room the decode is waiting for. Each request ends with a clear
error (5xx, so a router retries) within the configured timeout, and afterwards the
surviving workers hold no KV but their caches (invariants checked in the worker).

The decode notices a killed prefill through its broken connection (a 502 at once); a
prefill that never answers at all is bounded by --disaggregation-timeout (a 504).

The requests are posted to both workers directly, with the bootstrap fields the router
would add (test_pd_workers.py runs the real router): a fault test needs to control which
worker is where when it breaks. The prefill's `pd_fault hold_sends` (a test-only worker
call) keeps it from sending a pulled room, so the fault lands mid-transfer every time.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.pd_procs import (assert_kv_free, decode_flags, kill_group, prefill_flags, server_info,
                            start_pd_workers, wait_until, worker_call)
from tests.server_proc import free_port, start_server

pytestmark = [pytest.mark.server, pytest.mark.model, pytest.mark.slow]

DECODE_TIMEOUT = 5  # seconds the decode waits for KV; the prefill keeps the default (300)
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def pd():
    bport = free_port()
    procs: dict[str, Any] = {"bport": bport}
    procs["p"], procs["d"] = start_pd_workers(
        prefill_flags(bport), decode_flags(bport, "--disaggregation-timeout", str(DECODE_TIMEOUT)))
    try:
        yield procs
    finally:
        for key in ("p", "d"):
            procs[key].stop()


def body(bport: int, room: int, **extra: Any) -> dict[str, Any]:
    return {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room, **extra}


class Post(threading.Thread):
    """A request in the background; `.status` / `.json` once done (`.error` if the
    connection broke: the worker was killed)."""

    def __init__(self, url: str, payload: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.payload = url, payload
        self.status: int | None = None
        self.json: Any = None
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        try:
            r = httpx.post(self.url + "/generate", json=self.payload, timeout=120)
            self.status, self.json = r.status_code, r.json()
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"


def held(s: Any) -> int:
    return server_info(s)["pd_rooms_held"]


def pulled(s: Any) -> int:
    """Rooms a prefill holds that a decode has pulled (its KV ready or being computed)."""
    return server_info(s)["pd_rooms_pulled"]


def test_transfer_timeout_ends_with_504_and_frees_pages(pd):
    nobody = free_port()  # no prefill listens there
    r = httpx.post(pd["d"].url + "/generate", json=body(nobody, 11), timeout=60)
    assert r.status_code == 504, r.text
    msg = r.json()["error"]["message"]
    assert "--disaggregation-timeout" in msg and f"127.0.0.1:{nobody}" in msg
    info = assert_kv_free(pd["d"])
    assert info["pd_transfer_failures_total"].get("timeout") == 1
    # a stream ends the same way, before any data: an HTTP error a router can retry
    r = httpx.post(pd["d"].url + "/generate", json=body(nobody, 12, stream=True), timeout=60)
    assert r.status_code == 504, r.text
    assert_kv_free(pd["d"])


def test_decode_restart_leaves_no_stale_rooms(pd):
    p, bport = pd["p"], pd["bport"]
    worker_call(p, "pd_fault", "hold_sends")
    try:
        old_p, old_d = Post(p.url, body(bport, 21)), Post(pd["d"].url, body(bport, 21))
        wait_until(lambda: pulled(p) == 1, 60, "the decode to pull the room the prefill holds")
        port = int(pd["d"].url.rsplit(":", 1)[1])
        kill_group(pd["d"])
        old_d.join(30)
        assert old_d.error is not None  # its connection died with it
        pd["d"] = start_server("--max-total-tokens", "4096", "--enable-debug-calls",
                               *decode_flags(bport, "--disaggregation-timeout", str(DECODE_TIMEOUT)), port=port)
        assert held(p) == 1  # still held for the dead decode (the prefill's timeout is 300 s)
        new_p, new_d = Post(p.url, body(bport, 22)), Post(pd["d"].url, body(bport, 22))
        # the restarted decode's first Pull tells the prefill its old self is gone
        old_p.join(60)
        assert old_p.status == 502 and "restarted" in old_p.json["error"]["message"], old_p.json
    finally:
        worker_call(p, "pd_fault", None)
    new_p.join(60)
    new_d.join(60)
    assert new_p.status == new_d.status == 200, (new_p.json, new_d.json)
    assert new_d.json["meta_info"]["completion_tokens"] == 6, new_d.json
    assert new_d.json["output_ids"][0] == new_p.json["output_ids"][0]  # the prefill's first token
    assert server_info(p)["pd_transfer_failures_total"].get("decode_restarted") == 1
    assert_kv_free(p)
    assert_kv_free(pd["d"])


def test_prefill_killed_mid_transfer(pd):
    p, bport = pd["p"], pd["bport"]
    worker_call(p, "pd_fault", "hold_sends")
    req_p, req_d = Post(p.url, body(bport, 31)), Post(pd["d"].url, body(bport, 31))
    wait_until(lambda: pulled(p) == 1, 60, "the decode to pull the room the prefill holds")
    assert held(pd["d"]) == 1
    kill_group(p)
    req_d.join(DECODE_TIMEOUT + 30)
    assert not req_d.is_alive(), "the decode request hung"
    # the broken connection ends it at once (a 502 the router retries), not at the deadline
    assert req_d.status == 502 and "lost the connection" in req_d.json["error"]["message"], req_d.json
    req_p.join(30)
    info = assert_kv_free(pd["d"])  # every slot it reserved for the room is back
    assert info["pd_transfer_failures_total"].get("prefill_lost") == 1
    # a new prefill where the old one was: the decode reaches it again
    pd["p"] = start_server("--max-total-tokens", "4096", "--enable-debug-calls", *prefill_flags(bport),
                           port=int(p.url.rsplit(":", 1)[1]))
    a, b = Post(pd["p"].url, body(bport, 32)), Post(pd["d"].url, body(bport, 32))
    a.join(60)
    b.join(60)
    assert a.status == b.status == 200, (a.json, b.json)
    assert_kv_free(pd["p"])
    assert_kv_free(pd["d"])
