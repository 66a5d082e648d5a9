"""The server's processes (issue #12): the API process and its worker processes start,
stop and fail together. Real servers on loopback ports, real signals; every process a
test starts is in the server's process group and is killed at the end by group.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.server_proc import group_pids, start_server

pytestmark = [pytest.mark.server, pytest.mark.model]

LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}


def _wait_exit(srv, timeout: float) -> int:
    try:
        return srv.proc.wait(timeout=timeout)
    except Exception:  # noqa: BLE001 - reported as a failure by the caller
        return -999


def _wait_no_group(pgid: int, timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return group_pids(pgid)


@pytest.mark.slow
@pytest.mark.parametrize("sig,group", [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGINT, True)],
                         ids=["sigterm", "sigterm-group", "ctrl-c"])
def test_signal_stops_the_server_and_every_worker(sig, group):
    """SIGTERM to the server (Kubernetes), to its whole group (systemd's default), or
    Ctrl-C in a terminal (SIGINT to the group): a prompt, clean stop of every process."""
    srv = start_server("--max-total-tokens", "4096")
    try:
        info = httpx.get(srv.url + "/get_server_info", timeout=30).json()
        workers = info["worker_pids"]
        assert info["tp_size"] == 1 and len(workers) == 1 and info["kv_pool_tokens_per_rank"] == [4096]
        assert workers[0] in group_pids(srv.proc.pid) and workers[0] != srv.proc.pid
        t0 = time.monotonic()
        if group:
            os.killpg(srv.proc.pid, sig)
        else:
            srv.proc.send_signal(sig)
        # uvicorn re-raises the signal after its graceful shutdown: dying of it is a clean stop
        assert _wait_exit(srv, 60) in (0, -sig), srv.log()[-3000:]
        assert time.monotonic() - t0 < 20, "the stop waited on something"
        assert "did not stop cleanly" not in srv.log()
        assert _wait_no_group(srv.proc.pid) == [], "a worker outlived the server"
    finally:
        srv.stop()


@pytest.mark.slow
def test_killed_worker_fails_8_streams_then_the_server_exits_nonzero():
    srv = start_server("--max-total-tokens", "8192")
    try:
        worker = httpx.get(srv.url + "/get_server_info", timeout=30).json()["worker_pids"][0]
        ended: dict[int, tuple[float, str]] = {}
        started = threading.Barrier(9)

        def stream(i: int) -> None:
            body = {"text": f"Story number {i}:", "sampling_params": LONG, "stream": True}
            last = prev = ""
            try:
                with httpx.stream("POST", srv.url + "/generate", json=body, timeout=60) as r:
                    first = True
                    for line in r.iter_lines():
                        if first and line.startswith("data:"):
                            first = False
                            started.wait(timeout=120)
                        if line.startswith("data:"):
                            prev, last = last, line
            except httpx.HTTPError as e:
                last = f"transport error {e!r}"
            ended[i] = (time.monotonic(), prev + "\n" + last)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait(timeout=120)  # every stream has its first chunk
        t0 = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        for t in threads:
            t.join(timeout=30)
        assert len(ended) == 8, "a stream hung after the worker was killed"
        assert max(t for t, _ in ended.values()) - t0 < 10
        for _, tail in ended.values():  # the stream's error event naming the cause, then [DONE]
            error, done = tail.split("\n")
            assert done == "data: [DONE]" and '"error"' in error and "SIGKILL" in error, tail
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and "SIGKILL" in health.text, health.text
        assert _wait_exit(srv, 60) not in (0, -999), srv.log()[-3000:]
        assert _wait_no_group(srv.proc.pid) == []
        assert "SIGKILL" in srv.log()
    finally:
        srv.stop()


@pytest.mark.slow
def test_rank_that_never_joins_fails_startup_naming_the_address():
    from tests.server_proc import free_port

    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError) as err:  # node 1 is never started
        start_server("--max-total-tokens", "1024", "--tp-size", "2", "--nnodes", "2", "--node-rank", "0",
                     "--dist-init-addr", addr, "--dist-timeout", "5", timeout=240)
    msg = str(err.value)
    assert "exited with 1" in msg and addr in msg and "--dist-timeout" in msg, msg[-3000:]


@pytest.mark.slow
def test_two_nodes_serve_the_same_greedy_ids_as_one_process():
    """Two launches on one machine, as on two: node 1 hosts rank 1 only, node 0 serves."""
    import subprocess
    import sys

    from tests.server_proc import REPO, free_port

    addr = f"127.0.0.1:{free_port()}"
    common = ["--dtype", "float32", "--max-total-tokens", "2048", "--tp-size", "2", "--nnodes", "2",
              "--dist-init-addr", addr]
    node1 = subprocess.Popen([sys.executable, "-m", "sgl.launch_server", *common, "--node-rank", "1"],
                             cwd=REPO, start_new_session=True)
    single = node0 = None
    try:
        node0 = start_server(*common, "--node-rank", "0")
        single = start_server("--dtype", "float32", "--max-total-tokens", "2048")
        body = {"text": ["The capital of France is", "def fibonacci(n):"],
                "sampling_params": {"temperature": 0, "max_new_tokens": 24, "min_new_tokens": 24}}
        got = httpx.post(node0.url + "/generate", json=body, timeout=300).json()
        ref = httpx.post(single.url + "/generate", json=body, timeout=300).json()
        assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]
        info = httpx.get(node0.url + "/get_server_info", timeout=30).json()
        assert info["tp_size"] == 2 and info["nnodes"] == 2
        assert node0.stop() in (0, -signal.SIGTERM)
        assert node1.wait(timeout=60) == 0, "node 1 should stop when node 0 says so"
    finally:
        for srv in (node0, single):
            if srv is not None:
                srv.stop()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait()
